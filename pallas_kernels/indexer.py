"""DSA-style lightning indexer at page granularity.

Per token the model computes an index key ``k_I`` [dI] (``LayerNorm(W_k x)``). Pages keep the
SUM of their tokens' index keys, ``page_keys: [L, B, Np, dI]`` f32; the pooled key of page
``p`` is the mean, ``page_keys[p] / c_p`` with ``c_p = clip(seq_len - p * ps, 0, ps)`` tokens.
For query index heads ``j`` (``q_idx [B, H_I, dI]``, ``weights [B, H_I]``)

    score[b, p] = sum_j weights[b, j] * relu(q_idx[b, j] . mean_key[b, p]) / sqrt(dI)

and the top-``k`` pages are shared by all KV heads (result ``[B, k]``). Since ``c_p > 0``,
``relu(q . S / c) = relu(q . S) / c``: the kernel does one [H_I, dI] x [dI, pages] matmul on the
raw sums and divides afterwards.

Public: ``indexer_select``, ``indexer_update`` (decode write), ``indexer_summarize`` (prefill).
Selection order and padding: see the ``dense_select`` module docstring.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from .dense_select import num_valid_pages, select_top_pages

OP = "indexer_scores"
_MIN_DOT = 16  # Triton dot operands need every dimension >= 16


def _check(q_idx, weights, page_keys):
    if page_keys.ndim != 4:
        raise ValueError(f"page_keys must be [L, B, Np, dI], got {page_keys.shape}")
    _, b, _, di = page_keys.shape
    if q_idx.shape[0] != b or q_idx.shape[2] != di or weights.shape != q_idx.shape[:2]:
        raise ValueError(f"q_idx [B, H_I, dI] / weights [B, H_I] do not match page_keys "
                         f"{page_keys.shape}: {q_idx.shape}, {weights.shape}")


def _page_counts(seq_lens, page_size, pages):
    """Tokens in each page: clip(seq_len - p * ps, 0, ps). seq_lens [B, 1]; pages [.., N]."""
    return jnp.clip(seq_lens - pages * page_size, 0, page_size)


@_common.register(OP, "xla")
def indexer_scores_reference(q_idx, weights, page_keys, layer, seq_lens, *, page_size):
    """Reference page scores. q_idx [B, H_I, dI]; weights [B, H_I]; page_keys [L, B, Np, dI]
    f32 sums; layer int32 scalar; seq_lens [B]. Returns [B, Np] f32, -inf past the sequence."""
    _check(q_idx, weights, page_keys)
    _, b, np_, di = page_keys.shape
    sums = lax.dynamic_index_in_dim(page_keys, layer, 0, keepdims=False).astype(jnp.float32)
    lens = jnp.asarray(seq_lens, jnp.int32)[:, None]
    pages = lax.broadcasted_iota(jnp.int32, (b, np_), 1)
    cnt = _page_counts(lens, page_size, pages)
    mean = sums / jnp.maximum(cnt, 1).astype(jnp.float32)[..., None]
    dots = jnp.einsum("bjd,bpd->bjp", q_idx.astype(jnp.float32), mean,
                      precision=lax.Precision.HIGHEST)
    s = jnp.einsum("bj,bjp->bp", weights.astype(jnp.float32), jnp.maximum(dots, 0.0),
                   precision=lax.Precision.HIGHEST) / math.sqrt(di)
    valid = pages < num_valid_pages(seq_lens, page_size, np_)[:, None]
    return jnp.where(valid, s, -jnp.inf)


def _indexer_kernel(layer_ref, lens_ref, q_ref, w_ref, keys_ref, out_ref, *, page_size,
                    num_pages, block_pages, d_idx, precision):
    b = pl.program_id(0)
    p0 = pl.program_id(1) * block_pages
    layer = layer_ref[0]
    seq_len = jnp.maximum(lens_ref[b], 0)
    n_valid = _common.num_valid_pages(seq_len, page_size, num_pages)
    pages = p0 + lax.broadcasted_iota(jnp.int32, (block_pages,), 0)
    valid = pages < n_valid
    mask = jnp.broadcast_to(valid[:, None], (block_pages, d_idx))
    # Masked load: pages past the sequence (or past Np) are never read, whatever they hold.
    keys = plgpu.load(keys_ref.at[layer, b, pl.ds(p0, block_pages), :], mask=mask, other=0.0)
    dots = lax.dot_general(q_ref[...], keys.astype(jnp.float32), (((1,), (1,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)  # [H_I, BP]
    s = jnp.sum(jnp.maximum(dots, 0.0) * w_ref[...][:, None], axis=0)  # [BP]
    cnt = jnp.clip(seq_len - pages * page_size, 1, page_size).astype(jnp.float32)
    s = s / (cnt * math.sqrt(d_idx))
    out_ref[...] = jnp.where(valid, s, -jnp.inf)


def indexer_scores_pallas(q_idx, weights, page_keys, layer, seq_lens, *, page_size,
                          block_pages=64, num_warps=4, precision=None, interpret=None):
    """Page scores with the Pallas kernel. Shapes as ``indexer_scores_reference`` except the
    result is [B, Np_pad] f32 (Np rounded up to a multiple of ``block_pages``; padding is
    -inf). dI must be a power of two >= 16; H_I is zero-padded to a power of two >= 16.
    ``precision`` (matmul): default TF32x3 on the GPU (about fp32), HIGHEST in interpret mode."""
    _check(q_idx, weights, page_keys)
    _, b, np_, di = page_keys.shape
    if di & (di - 1) or di < _MIN_DOT:
        raise ValueError(f"index dim {di} must be a power of two >= {_MIN_DOT}")
    interpret = _common.interpret_mode() if interpret is None else interpret
    if precision is None:
        precision = (lax.Precision.HIGHEST if interpret
                     else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    block_pages = max(_MIN_DOT, min(block_pages, _common.next_pow2(np_)))
    n_blocks = pl.cdiv(np_, block_pages)
    hi = q_idx.shape[1]
    hp = max(_MIN_DOT, _common.next_pow2(hi))
    q = jnp.pad(q_idx.astype(jnp.float32), ((0, 0), (0, hp - hi), (0, 0)))
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, hp - hi)))
    kernel = functools.partial(_indexer_kernel, page_size=page_size, num_pages=np_,
                               block_pages=block_pages, d_idx=di, precision=precision)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, n_blocks * block_pages), jnp.float32),
        grid=(b, n_blocks),
        in_specs=[
            pl.BlockSpec((1,), lambda *_: (0,)),
            pl.BlockSpec((b,), lambda *_: (0,)),
            pl.BlockSpec((None, hp, di), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, hp), lambda i, j: (i, 0)),
            pl.BlockSpec(page_keys.shape, lambda *_: (0, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_pages), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret,
        name="indexer_scores",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(seq_lens, jnp.int32), q, w,
      page_keys)


_common.register(OP, "pallas")(indexer_scores_pallas)


@functools.partial(jax.jit, static_argnames=("k", "page_size", "num_sink_pages",
                                             "implementation", "topk_method"))
def indexer_select(q_idx, weights, page_keys, layer, seq_lens, *, k, page_size,
                   num_sink_pages, implementation=None, topk_method="auto"):
    """Indexer top-``k`` pages, shared by all KV heads.

    q_idx: [B, H_I, dI]; weights: [B, H_I]; page_keys: [L, B, Np, dI] f32 (whole, all layers);
    layer: int32 scalar; seq_lens: [B] int32 (tokens incl. the current one).
    Returns [B, k] int32 page indices, ascending, -1 padded last; sinks and the last page
    always included (see ``dense_select`` module docstring).
    """
    np_ = page_keys.shape[2]
    scores = _common.resolve(OP, implementation)(
        q_idx, weights, page_keys, jnp.asarray(layer, jnp.int32), seq_lens,
        page_size=page_size)
    return select_top_pages(scores, seq_lens, num_pages=np_, k=k, page_size=page_size,
                            num_sink_pages=num_sink_pages, method=topk_method,
                            implementation=implementation)


def indexer_update(page_keys, layer, k_idx_new, positions, *, page_size):
    """Add one decode token's index key to its page sum.

    page_keys: [L, B, Np, dI] f32; layer: int32 scalar; k_idx_new: [B, dI]; positions: [B]
    int32. Offset 0 (a page's first token) resets the sum to ``k_idx_new``; ``positions < 0``
    (inactive request) or pages ``>= Np`` change nothing. Returns page_keys (in place when
    donated).
    """
    np_ = page_keys.shape[2]
    b = positions.shape[0]
    positions = positions.astype(jnp.int32)
    page = jnp.where(positions >= 0, positions // page_size, np_)
    page = jnp.where(page < np_, page, np_)  # np_ = out of range: dropped by the scatter
    first = (positions % page_size == 0)[:, None]
    rows = jnp.arange(b)
    layer = jnp.asarray(layer, jnp.int32)
    kn = k_idx_new.astype(page_keys.dtype)
    old = page_keys[layer, rows, jnp.minimum(page, np_ - 1)]
    new = jnp.where(first, kn, old + kn)
    return page_keys.at[layer, rows, page].set(new, mode="drop")


def indexer_summarize(k_idx, page_size, valid_len):
    """Page sums of index keys for prefill.

    k_idx: [B, T, dI], T a multiple of ``page_size``; valid_len: [B] int32 (tokens
    ``>= valid_len[b]`` are ignored). Returns [B, T // page_size, dI] f32 (zeros for pages
    with no valid token).
    """
    b, t, di = k_idx.shape
    if t % page_size:
        raise ValueError(f"T={t} must be a multiple of page_size={page_size}")
    valid = (jnp.arange(t)[None, :] < jnp.asarray(valid_len)[:, None])[..., None]
    k = jnp.where(valid, k_idx.astype(jnp.float32), 0.0)
    return k.reshape(b, t // page_size, page_size, di).sum(axis=2)
