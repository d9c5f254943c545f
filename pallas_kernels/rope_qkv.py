"""Decode-step split of the fused q/k/v projection: RoPE, the K/V row, the Quest query groups.

``rope_qkv(qkv, bias, cos, sin, ...)`` turns one token's fused projection output into what a
decode layer consumes next, in one launch (XLA emits three kernels for the same: the rotated
q, the stacked K/V and the query-group sums):

* ``q`` [B, Hq, D]: the query heads, half-split (NeoX) RoPE at each request's angles;
* ``kv`` [B, 2, H, D]: the new token's K (rotated) and V, the row written to the cache;
* ``qp``, ``qn`` [B, H, D] f32: per KV head, the sums over its ``G = Hq // H`` query heads of
  ``max(q, 0)`` and ``min(q, 0)`` (from ``q`` as rounded to its dtype: Quest's scores
  ``U = Qp . M + Qn . m``, see ``quest._group_q``).

Math (f32): ``y = qkv + bias``; with ``r = D // 2``, ``out[j] = y[j] cos - y[j+r] sin`` and
``out[j+r] = y[j+r] cos + y[j] sin`` for q and k heads (``models.llama.apply_rope``); v is
``y`` cast. The reference ("xla") is that math in jnp (bit for bit the model's path); the
kernel equals it up to one rounding step (its multiply-adds may be contracted differently).
The kernel (Triton) runs one program
per request and loads each head's two halves as ``[heads, r]`` tiles (heads padded to a power
of two and masked).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common

OP = "rope_qkv"


def _check(qkv, bias, cos, sin, num_heads, num_kv_heads, head_dim):
    B, W = qkv.shape
    if W != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv width {W} != (Hq + 2 H) * D = "
                         f"({num_heads} + 2 * {num_kv_heads}) * {head_dim}")
    if bias is not None and bias.shape != (W,):
        raise ValueError(f"bias shape {bias.shape} != ({W},)")
    if head_dim % 2 or num_heads % num_kv_heads:
        raise ValueError(f"head_dim {head_dim} must be even and Hq {num_heads} a multiple of "
                         f"H {num_kv_heads}")
    if cos.shape != (B, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin shapes {cos.shape}/{sin.shape} != ({B}, {head_dim // 2})")


@_common.register(OP, "xla")
def rope_qkv_reference(qkv, bias, cos, sin, *, num_heads, num_kv_heads, head_dim, q_dtype,
                       kv_dtype):
    """Reference. qkv [B, (Hq + 2H) * D] any float; bias [(Hq + 2H) * D] or None; cos, sin
    [B, D // 2] f32. Returns (q [B, Hq, D] q_dtype, kv [B, 2, H, D] kv_dtype, qp, qn [B, H, D]
    f32)."""
    _check(qkv, bias, cos, sin, num_heads, num_kv_heads, head_dim)
    B = qkv.shape[0]
    Hq, H, D = num_heads, num_kv_heads, head_dim
    y = qkv.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]

    def rope(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    q = rope(y[:, : Hq * D].reshape(B, Hq, D)).astype(q_dtype)
    k = rope(y[:, Hq * D:(Hq + H) * D].reshape(B, H, D))
    v = y[:, (Hq + H) * D:].reshape(B, H, D)
    # K and V are rounded to q_dtype (the model's dtype) first, as the model path does
    kv = jnp.stack([k, v], axis=1).astype(q_dtype).astype(kv_dtype)
    qg = q.astype(jnp.float32).reshape(B, H, Hq // H, D)
    return q, kv, jnp.maximum(qg, 0.0).sum(axis=2), jnp.minimum(qg, 0.0).sum(axis=2)


def _kernel(qkv_ref, bias_ref, cos_ref, sin_ref, q_ref, kv_ref, qp_ref, qn_ref, *, Hq, H, D,
            has_bias):
    """Program b: request b's heads. Tiles [heads_pad, D // 2] per half."""
    b = pl.program_id(0)
    r = D // 2
    cos = cos_ref[b, :][None, :]
    sin = sin_ref[b, :][None, :]

    def load_half(head0, n, half):
        """y of heads [head0, head0 + n) (padded to a power of two), one half: [n_pad, r] f32."""
        n_pad = _common.next_pow2(n)
        hh = lax.broadcasted_iota(jnp.int32, (n_pad, r), 0)
        cc = (head0 + jnp.minimum(hh, n - 1)) * D + half * r + lax.broadcasted_iota(
            jnp.int32, (n_pad, r), 1)
        y = plgpu.load(qkv_ref.at[b, cc]).astype(jnp.float32)
        if has_bias:
            y = y + plgpu.load(bias_ref.at[cc]).astype(jnp.float32)
        return y, hh

    def rotated(head0, n):
        x1, hh = load_half(head0, n, 0)
        x2, _ = load_half(head0, n, 1)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin, hh

    # Extra (padding) lanes repeat the last head: their stores write the same values again.
    o1, o2, hh = rotated(0, Hq)
    hq = jnp.minimum(hh, Hq - 1)
    col = lax.broadcasted_iota(jnp.int32, hh.shape, 1)
    o1 = o1.astype(q_ref.dtype)
    o2 = o2.astype(q_ref.dtype)
    plgpu.store(q_ref.at[b, hq, col], o1)
    plgpu.store(q_ref.at[b, hq, r + col], o2)
    # Quest's group sums, from q as rounded to its dtype: head j belongs to KV head j // G.
    G = Hq // H
    for h in range(H):
        in_group = (hh >= h * G) & (hh < (h + 1) * G)
        for half, o in ((0, o1), (1, o2)):
            of = jnp.where(in_group, o.astype(jnp.float32), 0.0)
            qp_ref[b, h, pl.ds(half * r, r)] = jnp.sum(jnp.maximum(of, 0.0), axis=0)
            qn_ref[b, h, pl.ds(half * r, r)] = jnp.sum(jnp.minimum(of, 0.0), axis=0)
    k1, k2, hk = rotated(Hq, H)
    hk = jnp.minimum(hk, H - 1)
    colk = lax.broadcasted_iota(jnp.int32, hk.shape, 1)
    zero = jnp.zeros_like(hk)
    cast = lambda x: x.astype(q_ref.dtype).astype(kv_ref.dtype)  # noqa: E731  (as the model)
    plgpu.store(kv_ref.at[b, zero, hk, colk], cast(k1))
    plgpu.store(kv_ref.at[b, zero, hk, r + colk], cast(k2))
    v1, _ = load_half(Hq + H, H, 0)
    v2, _ = load_half(Hq + H, H, 1)
    plgpu.store(kv_ref.at[b, zero + 1, hk, colk], cast(v1))
    plgpu.store(kv_ref.at[b, zero + 1, hk, r + colk], cast(v2))


@_common.register(OP, "pallas")
def rope_qkv_pallas(qkv, bias, cos, sin, *, num_heads, num_kv_heads, head_dim, q_dtype,
                    kv_dtype, interpret=None):
    """The Triton kernel (one launch, one program per request). As :func:`rope_qkv_reference`;
    ``head_dim // 2`` must be a power of two."""
    _check(qkv, bias, cos, sin, num_heads, num_kv_heads, head_dim)
    B, W = qkv.shape
    Hq, H, D = num_heads, num_kv_heads, head_dim
    if (D // 2) & (D // 2 - 1):
        raise ValueError(f"head_dim // 2 = {D // 2} must be a power of two")
    has_bias = bias is not None
    if bias is None:
        bias = jnp.zeros((1,), jnp.float32)  # unused
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((B, Hq, D), q_dtype),
                 jax.ShapeDtypeStruct((B, 2, H, D), kv_dtype),
                 jax.ShapeDtypeStruct((B, H, D), jnp.float32),
                 jax.ShapeDtypeStruct((B, H, D), jnp.float32)]
    operands = (qkv, bias, cos.astype(jnp.float32), sin.astype(jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, Hq=Hq, H=H, D=D, has_bias=has_bias),
        grid=(B,),
        in_specs=[full(x) for x in operands],
        out_specs=[full(s) for s in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="rope_qkv",
    )(*operands)


def rope_qkv(qkv, bias, cos, sin, *, num_heads, num_kv_heads, head_dim, q_dtype, kv_dtype,
             implementation=None):
    """One decode token's fused projection -> (q [B, Hq, D] q_dtype, kv [B, 2, H, D] kv_dtype,
    qp [B, H, D] f32, qn [B, H, D] f32); see the module docstring. qkv [B, (Hq + 2H) * D] (the
    projection's output, any float dtype), bias [(Hq + 2H) * D] or None, cos / sin [B, D // 2]
    f32 (``models.llama.rope_angles`` of each request's position)."""
    fn = _common.resolve(OP, implementation)
    return fn(qkv, bias, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads,
              head_dim=head_dim, q_dtype=jnp.dtype(q_dtype), kv_dtype=jnp.dtype(kv_dtype))
