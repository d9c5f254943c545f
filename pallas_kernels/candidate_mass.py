"""Attention mass on candidate pages, from a device copy of the keys: the second stage of the
two-stage selectors (``jaxkv.selectors.rescore``).

Operands: ``q`` [B, Hq, D] (post-RoPE query; query head ``i`` belongs to KV head ``i // G``);
``keys`` [L, B, H, Np, ps, D] (int8 or a float dtype; whole, every layer) with ``scales``
[L, B, H, Np, ps] float32 (a token's key is ``keys * scale``); ``layer`` int32 scalar;
``cand`` [B, H, C] int32 candidate pages (-1: none); ``positions`` [B] int32 (tokens at
indices ``<= positions[b]`` are valid).

Result [B, H, C] float32: per KV head, the softmax mass the group's query heads put on each
candidate's valid tokens, the softmax taken over the candidates' valid tokens only and the
masses summed over the G query heads; ``-inf`` for ``-1``.

One implementation, the jnp one (``candidate_mass``, on every backend): gather the candidates' keys, one einsum,
the softmax. A Pallas kernel that read each candidate's int8 rows once and wrote per-page
softmax statistics was 4.3x slower on the H200 at the Qwen-like B=8 128k step
(docs/decisions.md).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _check(q, keys, scales, cand, positions):
    if keys.ndim != 6:
        raise ValueError(f"keys must be [L, B, H, Np, ps, D], got {keys.shape}")
    L, B, H, Np, ps, D = keys.shape
    if scales.shape != keys.shape[:5]:
        raise ValueError(f"scales must be {keys.shape[:5]} ([L, B, H, Np, ps]), got {scales.shape}")
    if q.ndim != 3 or q.shape[0] != B or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"q must be [B, G*H, D] for keys {keys.shape}, got {q.shape}")
    if cand.ndim != 3 or cand.shape[:2] != (B, H):
        raise ValueError(f"cand must be [B, H, C] = [{B}, {H}, C], got {cand.shape}")
    if positions.shape != (B,):
        raise ValueError(f"positions must be [B] = [{B}], got {positions.shape}")


def candidate_mass_reference(q, keys, scales, layer, cand, positions):
    """See the module docstring."""
    _check(q, keys, scales, cand, positions)
    _, B, H, Np, ps, D = keys.shape
    G = q.shape[1] // H
    lk = lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)        # [B, H, Np, ps, D]
    ls = lax.dynamic_index_in_dim(scales, layer, 0, keepdims=False)      # [B, H, Np, ps]
    idx = jnp.clip(cand, 0, Np - 1)                                      # [B, H, C]
    k = jnp.take_along_axis(lk, idx[..., None, None], axis=2)            # [B, H, C, ps, D]
    sc = jnp.take_along_axis(ls, idx[..., None], axis=2)                 # [B, H, C, ps]
    qg = q.reshape(B, H, G, D).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhctd->bhgct", qg, k.astype(jnp.float32))
    s = s * (sc * D ** -0.5)[:, :, None]
    tok = idx[..., None] * ps + jnp.arange(ps, dtype=jnp.int32)          # [B, H, C, ps]
    valid = (cand[..., None] >= 0) & (tok <= positions[:, None, None, None])
    s = jnp.where(valid[:, :, None], s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=(-2, -1), keepdims=True)
    mass = jnp.sum(jnp.sum(p, axis=-1) / jnp.where(den[..., 0] > 0, den[..., 0], 1.0), axis=2)
    return jnp.where(cand >= 0, mass, -jnp.inf)


candidate_mass = candidate_mass_reference
