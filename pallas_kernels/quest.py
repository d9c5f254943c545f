"""Quest page selection: per-page elementwise key max/min summaries and an upper-bound score.

Summaries ``kmax, kmin: [L, B, Np, H, D]`` (KV dtype) hold the elementwise max / min of the
post-RoPE keys of each page, per layer, request and KV head. For the query heads ``g`` of group
``h`` (query head ``i`` belongs to KV head ``i // G``, ``G = Hq // H``)

    U[b, h, p] = sum_g sum_d max(q[b, g, d] * kmax[p, h, d], q[b, g, d] * kmin[p, h, d])

an upper bound of ``sum_g q_g . k_t`` over the tokens ``t`` of page ``p``. Because
``kmax >= kmin``, ``max(q * M, q * m) = relu(q) * M + min(q, 0) * m``, so the group sum is
linear: ``U = Qp . M + Qn . m`` with ``Qp = sum_g relu(q_g)``, ``Qn = sum_g min(q_g, 0)``.
The Pallas kernel uses that form (one pass over the summaries, fp32 accumulation); the
reference computes the literal formula.

Public: ``quest_select`` (scores + top-k), ``quest_update`` (decode write), ``quest_summarize``
(prefill). Selection order and padding: see ``dense_select`` module docstring.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common
from pallas_kernels.dense_select import num_valid_pages, select_top_pages

OP = "quest_scores"
# No per-op default: the backend's (Pallas on the GPU). At B=1 with 8 KV heads (G=4) XLA's
# fusion of the literal formula was faster on the H200 (bench_select 2026-11-29, scores alone:
# 16k pages 15.7 vs 24.1 us); in the decode step at Qwen-like B=8 (G=6) it made the step
# 0.7 ms slower (benchmarks/results/bench_decode_qwen_128k_b8_s3.json): it multiplies per
# query head, the kernel once per group.
# Elements of each summary array one program reads (block_pages * block_heads * D).
_BLOCK_ELEMS = 8192


def _check(q, kmax, kmin):
    if kmax.shape != kmin.shape or kmax.ndim != 5:
        raise ValueError(f"kmax/kmin must both be [L, B, Np, H, D], got {kmax.shape}, {kmin.shape}")
    _, b, _, h, d = kmax.shape
    if q.ndim != 3 or q.shape[0] != b or q.shape[2] != d or q.shape[1] % h:
        raise ValueError(f"q must be [B, G*H, D] for kmax {kmax.shape}, got {q.shape}")


def _group_q(q: jax.Array, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """q [B, Hq, D] -> (Qp, Qn) [B, H, D] f32: group sums of relu(q) and min(q, 0)."""
    b, hq, d = q.shape
    qg = q.astype(jnp.float32).reshape(b, num_kv_heads, hq // num_kv_heads, d)
    return jnp.maximum(qg, 0.0).sum(axis=2), jnp.minimum(qg, 0.0).sum(axis=2)


@_common.register(OP, "xla")
def quest_scores_reference(q, kmax, kmin, layer, seq_lens, *, page_size):
    """Literal Quest scores. q [B, Hq, D]; kmax/kmin [L, B, Np, H, D]; layer int32 scalar;
    seq_lens [B]. Returns [B, H, Np] f32, -inf on pages ``>= ceil(seq_lens / page_size)``."""
    _check(q, kmax, kmin)
    _, b, np_, h, d = kmax.shape
    qg = q.astype(jnp.float32).reshape(b, h, -1, d)  # [B, H, G, D]
    mx = lax.dynamic_index_in_dim(kmax, layer, 0, keepdims=False).astype(jnp.float32)
    mn = lax.dynamic_index_in_dim(kmin, layer, 0, keepdims=False).astype(jnp.float32)
    prod = jnp.maximum(qg[:, None] * mx[:, :, :, None], qg[:, None] * mn[:, :, :, None])
    s = prod.sum(axis=(3, 4)).transpose(0, 2, 1)  # [B, H, Np]
    n_valid = num_valid_pages(seq_lens, page_size, np_)
    pages = lax.broadcasted_iota(jnp.int32, s.shape, 2)
    return jnp.where(pages < n_valid[:, None, None], s, -jnp.inf)


def _quest_kernel(layer_ref, lens_ref, qp_ref, qn_ref, kmax_ref, kmin_ref, out_ref, *,
                  page_size, num_pages, block_pages, block_heads, head_dim):
    b = pl.program_id(0)
    h0 = pl.program_id(1) * block_heads
    p0 = pl.program_id(2) * block_pages
    layer = layer_ref[0]
    seq_len = jnp.maximum(lens_ref[b], 0)
    n_valid = jnp.minimum((seq_len + page_size - 1) // page_size, num_pages)
    pages = p0 + lax.broadcasted_iota(jnp.int32, (block_pages,), 0)
    valid = pages < n_valid
    shape = (block_pages, block_heads, head_dim)
    mask = jnp.broadcast_to(valid[:, None, None], shape)
    idx = (layer, b, pl.ds(p0, block_pages), pl.ds(h0, block_heads), slice(None))
    # Masked loads: pages past the sequence (or past Np) are never read, whatever they hold.
    mx = plgpu.load(kmax_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    mn = plgpu.load(kmin_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    s = jnp.sum(mx * qp_ref[...][None] + mn * qn_ref[...][None], axis=-1)  # [BP, Hb]
    s = jnp.where(valid[:, None], s, -jnp.inf)
    out_ref[...] = s.T


def quest_scores_pallas(q, kmax, kmin, layer, seq_lens, *, page_size, block_pages=None,
                        num_warps=4, interpret=None):
    """Quest scores with the Pallas kernel. Shapes as ``quest_scores_reference`` except the
    result is [B, H, Np_pad] f32 (Np rounded up to a multiple of ``block_pages``; padding
    columns are -inf). D must be a power of two."""
    _check(q, kmax, kmin)
    _, b, np_, h, d = kmax.shape
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two")
    bh = _common.largest_pow2_divisor(h, h)
    if block_pages is None:
        block_pages = max(1, _BLOCK_ELEMS // (bh * d))
    block_pages = min(block_pages, _common.next_pow2(np_))
    n_blocks = pl.cdiv(np_, block_pages)
    qp, qn = _group_q(q, h)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_quest_kernel, page_size=page_size, num_pages=np_,
                               block_pages=block_pages, block_heads=bh, head_dim=d)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, h, n_blocks * block_pages), jnp.float32),
        grid=(b, h // bh, n_blocks),
        in_specs=[
            pl.BlockSpec((1,), lambda *_: (0,)),
            pl.BlockSpec((b,), lambda *_: (0,)),
            pl.BlockSpec((None, bh, d), lambda i, j, k: (i, j, 0)),
            pl.BlockSpec((None, bh, d), lambda i, j, k: (i, j, 0)),
            full(kmax),
            full(kmin),
        ],
        out_specs=pl.BlockSpec((None, bh, block_pages), lambda i, j, k: (i, j, k)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="quest_scores",
    )(layer_arr, jnp.asarray(seq_lens, jnp.int32), qp, qn, kmax, kmin)


_common.register(OP, "pallas")(quest_scores_pallas)


@functools.partial(jax.jit, static_argnames=("k", "page_size", "num_sink_pages",
                                             "implementation", "topk_method"))
def quest_select(q, kmax, kmin, layer, seq_lens, *, k, page_size, num_sink_pages,
                 implementation=None, topk_method="auto"):
    """Quest top-``k`` pages per KV head.

    q: [B, Hq, D] (post-RoPE query); kmax, kmin: [L, B, Np, H, D] (whole, all layers);
    layer: int32 scalar; seq_lens: [B] int32 (tokens incl. the current one).
    Returns [B, H, k] int32 page indices, ascending, -1 padded last; sinks and the last page
    always included (see ``dense_select`` module docstring).
    """
    np_ = kmax.shape[2]
    scores = _common.resolve(OP, implementation)(
        q, kmax, kmin, jnp.asarray(layer, jnp.int32), seq_lens, page_size=page_size)
    return select_top_pages(scores, seq_lens, num_pages=np_, k=k, page_size=page_size,
                            num_sink_pages=num_sink_pages, method=topk_method,
                            implementation=implementation)


def quest_update(kmax, kmin, layer, k_new, positions, *, page_size):
    """Fold one decode token's keys into the summaries of its page.

    kmax, kmin: [L, B, Np, H, D]; layer: int32 scalar; k_new: [B, H, D] (post-RoPE);
    positions: [B] int32 token position (page ``pos // page_size``). Offset 0 (a page's first
    token) resets the page summary to ``k_new``; other offsets take the elementwise max / min.
    ``positions < 0`` (inactive request) or pages ``>= Np`` change nothing. Returns
    (kmax, kmin), same shapes and dtypes (in place when donated).
    """
    np_ = kmax.shape[2]
    b = positions.shape[0]
    positions = positions.astype(jnp.int32)
    page = jnp.where(positions >= 0, positions // page_size, np_)
    page = jnp.where(page < np_, page, np_)  # np_ = out of range: dropped by the scatter
    first = (positions % page_size == 0)[:, None, None]
    rows = jnp.arange(b)
    layer = jnp.asarray(layer, jnp.int32)
    pc = jnp.minimum(page, np_ - 1)
    kn = k_new.astype(kmax.dtype)
    new_max = jnp.where(first, kn, jnp.maximum(kmax[layer, rows, pc], kn))
    new_min = jnp.where(first, kn, jnp.minimum(kmin[layer, rows, pc], kn))
    kmax = kmax.at[layer, rows, page].set(new_max, mode="drop")
    kmin = kmin.at[layer, rows, page].set(new_min, mode="drop")
    return kmax, kmin


def quest_summarize(k, page_size, valid_len):
    """Page summaries for prefill.

    k: [B, T, H, D] post-RoPE keys, T a multiple of ``page_size``; valid_len: [B] int32
    (tokens ``>= valid_len[b]`` are ignored). Returns (kmax, kmin) [B, T // page_size, H, D]
    in k's dtype. A page with no valid token holds -inf / +inf; scorers never read such pages
    (they are past the sequence).
    """
    b, t, h, d = k.shape
    if t % page_size:
        raise ValueError(f"T={t} must be a multiple of page_size={page_size}")
    valid = jnp.arange(t)[None, :] < jnp.asarray(valid_len)[:, None]
    valid = valid.reshape(b, t // page_size, page_size, 1, 1)
    kp = k.reshape(b, t // page_size, page_size, h, d)
    kmax = jnp.where(valid, kp, -jnp.inf).max(axis=2).astype(k.dtype)
    kmin = jnp.where(valid, kp, jnp.inf).min(axis=2).astype(k.dtype)
    return kmax, kmin
