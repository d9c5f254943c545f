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

Three implementations of op ``candidate_mass``:

* ``"xla"``: the reference (gather the candidates' keys, one einsum, the softmax);
* ``"blocked"``: the reference's masses a chunk of candidates at a time, up to the last
  candidate in use (the default off the GPU: ``candidate_mass_blocked``);
* ``"pallas"``: one program per (request, KV head, ``block_c`` candidates) reads the
  candidates' [ps, D] key rows as one gathered tile, scores it on the tensor cores and writes each page's
  max logit ``m`` and ``l = sum_t exp(s_t - m)`` per query head; the masses follow in XLA
  from those [B, H, C, G] statistics (``mass_from_page_stats``). int8 and bfloat16 keys are
  exact in bfloat16, and the query enters as two bfloat16 halves (``q = hi + lo``), so the
  logits carry about 16 bits of the query's mantissa; other key dtypes take the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from ._common import prefer_on_cpu, register

OP = "candidate_mass"


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


@register(OP, "xla")
def candidate_mass_reference(q, keys, scales, layer, cand, positions, *, in_order: bool = False):
    """The reference: see the module docstring. ``in_order`` (static): the caller promises
    ``cand[b, h, c]`` is ``c`` or -1 (every page a candidate, in page order, as the two-stage
    selectors hand over when the candidates cover the whole row); the keys are then read as
    they lie instead of gathered (the same result)."""
    _check(q, keys, scales, cand, positions)
    _, B, H, Np, ps, D = keys.shape
    G = q.shape[1] // H
    lk = lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)        # [B, H, Np, ps, D]
    ls = lax.dynamic_index_in_dim(scales, layer, 0, keepdims=False)      # [B, H, Np, ps]
    C = cand.shape[-1]
    if in_order:
        if C > Np:
            raise ValueError(f"in_order needs at most Np = {Np} candidates, got {C}")
        idx = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), cand.shape)
        k, sc = lk[:, :, :C], ls[:, :, :C]
    else:
        idx = jnp.clip(cand, 0, Np - 1)                                  # [B, H, C]
        k = jnp.take_along_axis(lk, idx[..., None, None], axis=2)        # [B, H, C, ps, D]
        sc = jnp.take_along_axis(ls, idx[..., None], axis=2)             # [B, H, C, ps]
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


BLOCKED_CHUNK = 64  # candidates per chunk of the blocked formulation (CPU)


@register(OP, "blocked")
def candidate_mass_blocked(q, keys, scales, layer, cand, positions, *, in_order: bool = False,
                           chunk: int = BLOCKED_CHUNK):
    """The reference's masses ``chunk`` candidates at a time (the XLA:CPU default): a
    ``fori_loop`` over the chunks up to the last candidate that is not -1 reads (or, unless
    ``in_order``, gathers) the chunk's keys from the layer, scores them and writes each
    candidate's per-query-head statistics ``m`` (max logit) and ``l`` (sum of ``exp(s - m)``);
    the masses follow from those (``mass_from_page_stats``). With the candidates in page
    order (``in_order``: every page a candidate) a context in a longer ``max_context`` bucket
    reads only its own pages, and no float32 copy of all candidates' keys is made."""
    _check(q, keys, scales, cand, positions)
    _, B, H, Np, ps, D = keys.shape
    G = q.shape[1] // H
    C = cand.shape[-1]
    if in_order and C > Np:
        raise ValueError(f"in_order needs at most Np = {Np} candidates, got {C}")
    if C == 0:
        return jnp.zeros(cand.shape, jnp.float32)
    P = max(1, min(int(chunk), C))
    qg = q.reshape(B, H, G, D).astype(jnp.float32) * D ** -0.5
    layer = jnp.asarray(layer, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    tok = jnp.arange(ps, dtype=jnp.int32)
    bi = jnp.arange(B, dtype=jnp.int32)[:, None, None]
    hi = jnp.arange(H, dtype=jnp.int32)[None, :, None]
    used = jnp.max(jnp.where(cand >= 0, jnp.arange(C, dtype=jnp.int32) + 1, 0))

    def body(i, carry):
        m_all, l_all = carry
        start = jnp.minimum(i * P, C - P)  # the last chunk may overlap the one before: same values
        c = lax.dynamic_slice_in_dim(cand, start, P, axis=2)                 # [B, H, P]
        if in_order:
            page = start + jnp.arange(P, dtype=jnp.int32)
            k = lax.dynamic_slice(keys, (layer, zero, zero, start, zero, zero),
                                  (1, B, H, P, ps, D))[0]                    # [B, H, P, ps, D]
            sc = lax.dynamic_slice(scales, (layer, zero, zero, start, zero),
                                   (1, B, H, P, ps))[0]                      # [B, H, P, ps]
            page = jnp.broadcast_to(page, c.shape)
        else:
            page = jnp.clip(c, 0, Np - 1)
            k = keys[layer, bi, hi, page]                                    # [B, H, P, ps, D]
            sc = scales[layer, bi, hi, page]                                 # [B, H, P, ps]
        # token-major product ([P * ps, D] x [D, G] per request and KV head), then the
        # reductions over contiguous tokens: each about 2x faster on XLA:CPU than the other
        # layout
        s = jnp.einsum("bhtd,bhgd->bhtg", k.astype(jnp.float32).reshape(B, H, P * ps, D), qg)
        s = jnp.swapaxes(s, 2, 3).reshape(B, H, G, P, ps) * sc[:, :, None]
        valid = (c[..., None] >= 0) & (page[..., None] * ps + tok <= positions[:, None, None, None])
        s = jnp.where(valid[:, :, None], s, -jnp.inf)                        # [B, H, G, P, ps]
        m = jnp.max(s, axis=-1)                                              # [B, H, G, P]
        l = jnp.sum(jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), axis=-1)
        m_all = lax.dynamic_update_slice_in_dim(m_all, m, start, axis=3)
        l_all = lax.dynamic_update_slice_in_dim(l_all, l, start, axis=3)
        return m_all, l_all

    init = (jnp.full((B, H, G, C), -jnp.inf, jnp.float32), jnp.zeros((B, H, G, C), jnp.float32))
    m, l = lax.fori_loop(0, (used + P - 1) // P, body, init)
    return mass_from_page_stats(jnp.moveaxis(m, 2, 3), jnp.moveaxis(l, 2, 3), cand, G)


def mass_from_page_stats(m, l, cand, G: int):
    """Candidate masses [B, H, C] from per-page statistics ``m``, ``l`` [B, H, C, G_pad]
    (rows ``>= G`` and candidates without a valid token: ``m = -inf``, ``l = 0``)."""
    m, l = m[..., :G], l[..., :G]
    top = jnp.max(m, axis=2, keepdims=True)                              # [B, H, 1, G]
    w = l * jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0))
    den = jnp.sum(w, axis=2, keepdims=True)
    mass = jnp.sum(w / jnp.where(den > 0, den, 1.0), axis=-1)
    return jnp.where(cand >= 0, mass, -jnp.inf)


def _split_query(q, scale: float):
    """The scaled query [..., D] as two bfloat16 halves ``hi + lo`` (f32 arithmetic)."""
    qf = q.astype(jnp.float32) * scale
    hi = qf.astype(jnp.bfloat16)
    return hi, (qf - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _kernel(layer_ref, pos_ref, cand_ref, q_ref, keys_ref, scales_ref, m_ref, l_ref, *, ps,
            block_c, C, G, G_pad):
    """One program: ``block_c`` candidates (``_page_stats``). It gathers its KV head's G query
    rows from the query [B, G * H, D] as it is (padded to G_pad with zeros), scales them and
    splits them into bfloat16 halves itself (``_split_query``; the same values as that
    function in XLA to rounding: ``q * scale - hi`` may be contracted into a fused
    multiply-add here), one fusion less per layer than forming them before the kernel."""
    b, h = pl.program_id(0), pl.program_id(1)
    D = q_ref.shape[-1]
    g = lax.broadcasted_iota(jnp.int32, (G_pad, D), 0)
    d = lax.broadcasted_iota(jnp.int32, (G_pad, D), 1)
    q = plgpu.load(q_ref.at[jnp.broadcast_to(b, (G_pad, D)), h * G + jnp.minimum(g, G - 1), d],
                   mask=g < G, other=0)
    hi, lo = _split_query(q, D ** -0.5)
    _page_stats(layer_ref, pos_ref, cand_ref, hi, lo, keys_ref, scales_ref, m_ref, l_ref,
                ps=ps, block_c=block_c, C=C)


def _page_stats(layer_ref, pos_ref, cand_ref, q_hi, q_lo, keys_ref, scales_ref, m_ref, l_ref,
                *, ps, block_c, C):
    """One program: ``block_c`` candidates as one [block_c * ps, D] tile, gathered in one load
    (every index a full int array: interpret mode cannot mix gathers and slices). The per-page
    statistics take the [G_pad, T] logits as [G_pad, block_c, ps]: one reduction over the
    page's tokens each (a masked pass over the whole tile per page is 2.7% slower a step at
    Qwen-like B=8, docs/decisions.md)."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    D = q_hi.shape[-1]
    T = block_c * ps
    layer = layer_ref[0]
    pos = pos_ref[b]
    tok = lax.broadcasted_iota(jnp.int32, (T,), 0)
    tok_page, tok_off = lax.div(tok, ps), lax.rem(tok, ps)
    c = j * block_c + tok_page                                           # [T] candidate index
    p = cand_ref[b, h, jnp.minimum(c, C - 1)]                            # [T] its page
    ok = (c < C) & (p >= 0) & (p * ps + tok_off <= pos)
    p = jnp.where(ok, p, 0)
    mask = jnp.broadcast_to(ok[:, None], (T, D))
    k = plgpu.load(keys_ref.at[layer, b, h, jnp.broadcast_to(p[:, None], (T, D)),
                               jnp.broadcast_to(tok_off[:, None], (T, D)),
                               lax.broadcasted_iota(jnp.int32, (T, D), 1)],
                   mask=mask, other=0).astype(jnp.bfloat16)              # [T, D]
    sc = plgpu.load(scales_ref.at[layer, b, h, p, tok_off], mask=ok, other=0.0)  # [T]
    s = plgpu.dot(q_hi, k, trans_b=True) + plgpu.dot(q_lo, k, trans_b=True)
    s = jnp.where(ok[None, :], s * sc[None, :], -jnp.inf)                # [G_pad, T]
    s3 = s.reshape(s.shape[0], block_c, ps)                              # [G_pad, block_c, ps]
    m = jnp.max(s3, axis=2)                                              # [G_pad, block_c]
    m0 = jnp.where(m == -jnp.inf, 0.0, m)
    l = jnp.sum(jnp.exp(s3 - m0[:, :, None]), axis=2)                    # 0 where masked
    m_ref[...] = jnp.where(l > 0, m, -jnp.inf).T
    l_ref[...] = l.T


def kernel_takes(keys) -> bool:
    """Whether the Pallas kernel takes this key copy [L, B, H, Np, ps, D]: int8 or bfloat16
    keys, ``ps`` a power of two and ``D`` a power of two of at least 16 (the tensor cores'
    smallest block; a program's tile holds at least 16 tokens, ``min_block_c``)."""
    ps, D = keys.shape[-2:]
    return (keys.dtype in (jnp.int8, jnp.bfloat16) and D >= 16
            and not ps & (ps - 1) and not D & (D - 1))


def min_block_c(ps: int) -> int:
    """The fewest candidates a program takes with ``ps``-token pages: its tile of
    ``block_c * ps`` tokens is the dot's column block, at least 16 (the tensor cores'
    smallest); candidates past ``C`` in the last program are masked."""
    return max(1, 16 // ps)


def page_stats_pallas(q, keys, scales, layer, cand, positions, *, block_c: int | None = None,
                      num_warps: int = 4, interpret: bool | None = None):
    """The kernel's per-page statistics ``(m, l)``, each [B, H, Cs, G_pad] float32 with
    ``Cs = ceil(C / block_c) * block_c`` and ``G_pad = max(16, next_pow2(G))`` (module
    docstring; rows ``>= C``, columns ``>= G`` and candidates without a valid token carry
    ``m = -inf``, ``l = 0``, except the padded query heads' columns, which hold the zero
    query's statistics and are never data). Keys the kernel does not take
    (``kernel_takes``) are an error here. Each program splits its query rows into the
    bfloat16 halves itself (``_kernel``)."""
    _check(q, keys, scales, cand, positions)
    _, B, H, Np, ps, D = keys.shape
    if not kernel_takes(keys):
        raise ValueError(f"the candidate_mass kernel takes int8 / bfloat16 keys with a page size "
                         f"a power of two and a head dim a power of two >= 16, got "
                         f"{keys.dtype} {keys.shape}")
    G = q.shape[1] // H
    G_pad = max(16, _common.next_pow2(G))  # the dot's row block
    C = cand.shape[2]
    if block_c is None:
        block_c = max(1, 128 // ps)
    block_c = max(min_block_c(ps), min(block_c, _common.next_pow2(C)))
    if block_c & (block_c - 1):
        raise ValueError(f"block_c {block_c} must be a power of two (the tile's tokens)")
    n_prog = pl.cdiv(C, block_c)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    kernel = functools.partial(_kernel, ps=ps, block_c=block_c, C=C, G=G, G_pad=G_pad)
    stat = jax.ShapeDtypeStruct((B, H, n_prog * block_c, G_pad), jnp.float32)
    stat_spec = pl.BlockSpec((None, None, block_c, G_pad), lambda b, h, j: (b, h, j, 0))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)
    cand = jnp.asarray(cand, jnp.int32)
    return pl.pallas_call(
        kernel,
        out_shape=(stat, stat),
        grid=(B, H, n_prog),
        in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), full(positions), full(cand), full(q),
                  full(keys), full(scales)],
        out_specs=(stat_spec, stat_spec),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="candidate_mass",
    )(layer_arr, positions, cand, q, keys, scales)


@register(OP, "pallas")
def candidate_mass_pallas(q, keys, scales, layer, cand, positions, *, block_c: int | None = None,
                          num_warps: int = 4, interpret: bool | None = None):
    """The Pallas kernel (module docstring, ``page_stats_pallas``) and the masses from its
    statistics; ``block_c`` candidates per program (default: a tile of 128 tokens, at least
    one page: the fastest at both 128k decode shapes on the H200, docs/decisions.md). Keys
    the kernel does not take (``kernel_takes``) take the reference."""
    _check(q, keys, scales, cand, positions)
    if not kernel_takes(keys):
        return candidate_mass_reference(q, keys, scales, layer, cand, positions)
    m, l = page_stats_pallas(q, keys, scales, layer, cand, positions, block_c=block_c,
                             num_warps=num_warps, interpret=interpret)
    C = cand.shape[2]
    return mass_from_page_stats(m[:, :, :C], l[:, :, :C], cand, q.shape[1] // keys.shape[2])


prefer_on_cpu(OP, "blocked")


def candidate_mass(q, keys, scales, layer, cand, positions, *, implementation=None,
                   in_order: bool = False):
    """Attention mass on the candidate pages (module docstring); ``implementation`` picks
    the kernel, the reference or the blocked formulation (``_common.resolve``; off the GPU
    the blocked one by default). ``in_order``: as in ``candidate_mass_reference`` (the
    kernel gathers either way)."""
    fn = _common.resolve(OP, implementation)
    if fn in (candidate_mass_reference, candidate_mass_blocked):
        return fn(q, keys, scales, layer, cand, positions, in_order=in_order)
    return fn(q, keys, scales, layer, cand, positions)
