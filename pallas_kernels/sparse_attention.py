"""Sparse paged decode attention: each request's query heads attend to a selected set of pages
of the device page pool (GQA), with split-K partial results merged by log-sum-exp.

Layouts follow docs/DESIGN.md: the pool is ``[N_rows, R]`` with ``R = 2 * H * ps * D`` and is
viewed as ``[N_rows, 2 (K, V), H, ps, D]``; ``block_rows`` hold global pool rows. A
quantized (fp8 / int8) pool (``kv_quant``) has the scale bytes ``[2, H, ps]`` after that
payload (``R = 2 * H * ps * (D + 1)``): the kernel loads the quantized tiles and their
per-token scales and dequantizes in registers (K's scales multiply the scores, V's the
probabilities before ``p @ v``), so no wider copy of the pool exists. The pool's dtype may differ from q's: the products run in
``kv_quant.compute_dtype``.

Semantics shared by the kernel ("pallas") and the reference ("xla"):

* entry ``i`` of ``(b, h)`` is valid iff ``page_index[b, h, i] >= 0`` and its K/V has a source:
  pool row ``block_rows[b, h, i] >= 0``, else (when a host tier is passed) host row
  ``host_rows[b, h, i] >= 0`` of the ``pinned_host`` array, read by the kernel in place over PCIe
  (zero-copy: a page missing from the pool is attended without first being copied to the
  device); its tokens are positions ``page_index * ps + t`` (``t < ps``) and only those
  ``< seq_lens[b]`` take part (the partly filled last page);
* invalid entries and masked tokens are never read into the result (NaN there is harmless);
* duplicates: every listed entry is attended as listed, so a page listed twice counts twice
  (selectors never emit duplicates except ``-1``; callers should not rely on this);
* a (request, head) with no valid token returns ``out = 0`` and ``lse = -inf``.

Kernel (Triton backend): grid ``(B, H, num_splits)``; a program takes the ``G = Hq // H`` query
heads of one KV head as a ``[G_pad, D]`` block (``G_pad = max(16, next_pow2(G))``, zero rows) and
runs an online softmax (f32) over its share of the K entries, ``pages_per_iter`` pages per step
loaded as ``[pages_per_iter * ps, D]`` K and V tiles straight from the pool rows (masked loads:
invalid pages and tokens are not fetched). Small pages are grouped so a tile holds >= 16 tokens
(the ``tl.dot`` minimum), so no multiply+sum fallback is needed. Each split writes a normalised
partial ``[G, D]`` and its log-sum-exp. A second Pallas kernel (one program per (b, kv head,
block of D)) merges the splits and writes ``[B, Hq, D]`` in q's dtype: one launch where an XLA
merge takes three (exp, weighted sum, convert).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import kv_quant
from ._common import (interpret_mode, next_pow2, online_softmax_step, prefer_on_cpu, register,
                      resolve)

OP = "sparse_paged_attention"
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Default split heuristic: aim for about this many programs (a few per SM on an H200's 132 SMs).
TARGET_PROGRAMS = 512
MIN_CHUNKS_PER_SPLIT = 1  # one chunk per split: the fastest split count at B=1 (docs/decisions.md)
_MERGE_SPLITS_PER_ITER = 32  # splits loaded per step of the merge kernel's loop
_MERGE_DIM_BLOCK = 32        # head-dim elements per merge program
_MERGE_TILE_ELEMS = 8192     # largest [splits, group rows, dims] tile loaded at once


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Static knobs of the Triton kernel (``None`` = default).

    pages_per_iter: pages loaded per inner-loop step (power of two; raised so that the tile holds
      at least 16 tokens, the minimum ``tl.dot`` size). num_warps / num_stages: Triton options.
    """

    pages_per_iter: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def _check(q, pool, block_rows, page_index, seq_lens, page_size, num_kv_heads, host=None,
           host_rows=None):
    B, Hq, D = q.shape
    if (host is None) != (host_rows is None):
        raise ValueError("pass host and host_rows together (or neither)")
    if host is not None:
        if host.ndim != 2 or host.shape[1] != pool.shape[1] or host.dtype != pool.dtype:
            raise ValueError(f"host {host.shape} {host.dtype} must be [N_host, {pool.shape[1]}] "
                             f"{pool.dtype}, the pool's row layout")
        if host_rows.shape != block_rows.shape:
            raise ValueError(f"host_rows {host_rows.shape} != block_rows {block_rows.shape}")
    H = num_kv_heads
    if Hq % H:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {H}")
    R = kv_quant.row_elems(pool.dtype, H, page_size, D)
    if pool.ndim != 2 or pool.shape[1] != R:
        raise ValueError(f"pool shape {pool.shape} != [N, 2*H*ps*D{' + scales' if kv_quant.is_quantized(pool.dtype) else ''} = {R}]")
    if block_rows.shape != page_index.shape or block_rows.shape[:2] != (B, H):
        raise ValueError(f"block_rows {block_rows.shape} / page_index {page_index.shape} != [B, H, K]")
    if not (jnp.issubdtype(pool.dtype, jnp.floating) or kv_quant.is_quantized(pool.dtype)) \
            or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"pool dtype {pool.dtype} must be a float type or int8, and q dtype "
                         f"{q.dtype} a float type")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens shape {seq_lens.shape} != ({B},)")
    for name, v in (("page_size", page_size), ("head_dim", D)):
        if v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two")
    if D < 16:
        raise ValueError(f"head_dim={D} must be >= 16 (tl.dot minimum)")


def default_num_splits(batch: int, num_kv_heads: int, num_entries: int, pages_per_iter: int = 1) -> int:
    """Splits per (b, h): about TARGET_PROGRAMS programs, each with >= MIN_CHUNKS_PER_SPLIT chunks."""
    chunks = -(-num_entries // pages_per_iter)
    want = -(-TARGET_PROGRAMS // (batch * num_kv_heads))
    return max(1, min(want, chunks // MIN_CHUNKS_PER_SPLIT))


def _empty(q):
    """Result of an empty selection: ``(zeros like q, -inf [B, Hq] f32)``."""
    return jnp.zeros_like(q), jnp.full(q.shape[:2], -jnp.inf, jnp.float32)


def _merge_lse(out, lse, axis):
    """Exact merge of normalised partial results along ``axis`` (f32 in, f32 out)."""
    m = jnp.max(lse, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # 0 for empty parts (lse = -inf)
    denom = jnp.sum(w, axis=axis)
    safe = jnp.where(denom > 0, denom, 1.0)
    o = jnp.sum(w[..., None] * out, axis=axis) / safe[..., None]
    lse_out = jnp.where(denom > 0, jnp.squeeze(m, axis) + jnp.log(safe), -jnp.inf)
    return o, lse_out


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Exact merge of two attention results over disjoint key sets.

    out_*: ``[..., D]`` (any float dtype), lse_*: ``[...]`` f32 (natural log; ``-inf`` = empty).
    Returns ``(out [..., D] in out_a.dtype, lse [...] f32)``; both empty -> ``(0, -inf)``.
    """
    out = jnp.stack([out_a.astype(jnp.float32), out_b.astype(jnp.float32)], axis=0)
    lse = jnp.stack([lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)], axis=0)
    o, l = _merge_lse(out, lse, axis=0)
    return o.astype(out_a.dtype), l


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, S, SC, G, G8, DB):
    """Program (b, h, j): merge the S partials of (b, h) for head dims [j*DB, (j+1)*DB).

    o_ref [B, H, S, G_pad, D] f32 and lse_ref [B, H, S, G_pad] f32 (natural log, -inf = empty
    split; rows >= G unused); writes out_ref[b, h*G + g, j*DB:(j+1)*DB] (q's dtype) and, from
    the j == 0 programs, lse_out_ref[b, h*G + g] f32. The G8 = next_pow2(G) lanes of a block
    read and write row min(g, G - 1): the extra lanes repeat the last row's values exactly,
    so their stores are duplicates of the same value (no mask needed, none lands on another
    head's rows).
    """
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s_i = lax.broadcasted_iota(jnp.int32, (SC, G8), 0)
    g_i = jnp.minimum(lax.broadcasted_iota(jnp.int32, (SC, G8), 1), G - 1)
    n_iter = -(-S // SC)

    def lse_chunk(c):
        s_c = c * SC + s_i
        return pltriton.load(lse_ref.at[b, h, jnp.minimum(s_c, S - 1), g_i], mask=s_c < S,
                             other=-jnp.inf)  # [SC, G8]

    m = lax.fori_loop(0, n_iter, lambda c, m: jnp.maximum(m, jnp.max(lse_chunk(c), axis=0)),
                      jnp.full((G8,), -jnp.inf, jnp.float32))
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    s3 = lax.broadcasted_iota(jnp.int32, (SC, G8, DB), 0)
    g3 = jnp.minimum(lax.broadcasted_iota(jnp.int32, (SC, G8, DB), 1), G - 1)
    d3 = j * DB + lax.broadcasted_iota(jnp.int32, (SC, G8, DB), 2)

    def body(c, carry):
        den, acc = carry
        w = jnp.exp(lse_chunk(c) - m_use[None, :])  # [SC, G8]; 0 for empty or padded splits
        s_c = c * SC + s3
        o = pltriton.load(o_ref.at[b, h, jnp.minimum(s_c, S - 1), g3, d3], mask=s_c < S,
                          other=0.0)  # [SC, G8, DB]
        return den + jnp.sum(w, axis=0), acc + jnp.sum(w[:, :, None] * o, axis=0)

    den, acc = lax.fori_loop(0, n_iter, body, (jnp.zeros((G8,), jnp.float32),
                                               jnp.zeros((G8, DB), jnp.float32)))
    safe = jnp.where(den > 0, den, 1.0)
    out = acc / safe[:, None]
    g2 = jnp.minimum(lax.broadcasted_iota(jnp.int32, (G8, DB), 0), G - 1)
    d2 = j * DB + lax.broadcasted_iota(jnp.int32, (G8, DB), 1)
    pltriton.store(out_ref.at[b, h * G + g2, d2], out.astype(out_ref.dtype))

    @pl.when(j == 0)
    def _():
        g1 = jnp.minimum(lax.broadcasted_iota(jnp.int32, (G8,), 0), G - 1)
        pltriton.store(lse_out_ref.at[b, h * G + g1], jnp.where(den > 0, m_use + jnp.log(safe),
                                                                 -jnp.inf))


def merge_splits_pallas(o_part, lse_part, *, num_q_heads, out_dtype, interpret=None):
    """Merge split-K partial attention results with one Pallas launch.

    o_part [B, H, S, G_pad, D] f32 (normalised partials; rows >= G = Hq // H unused, may hold
    garbage), lse_part [B, H, S, G_pad] f32 (natural log, -inf = empty split).
    Returns (out [B, Hq, D] out_dtype, lse [B, Hq] f32), as ``_merge_lse`` over the S axis.
    """
    B, H, S, G_pad, D = o_part.shape
    G = num_q_heads // H
    G8 = next_pow2(G)
    DB = min(D, _MERGE_DIM_BLOCK)
    if D % DB:
        raise ValueError(f"head_dim {D} must be a multiple of {DB} or smaller")
    # splits per loop step: all of them up to 32, fewer for large groups (a [SC, G8, DB] f32
    # tile of at most _MERGE_TILE_ELEMS elements stays in registers)
    SC = max(1, min(_MERGE_SPLITS_PER_ITER, next_pow2(S), _MERGE_TILE_ELEMS // (G8 * DB)))
    kernel = functools.partial(_merge_kernel, S=S, SC=SC, G=G, G8=G8, DB=DB)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(B, H, D // DB),
        in_specs=[full(o_part), full(lse_part)],
        out_specs=[pl.BlockSpec((B, num_q_heads, D), lambda *_: (0, 0, 0)),
                   pl.BlockSpec((B, num_q_heads), lambda *_: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, num_q_heads, D), out_dtype),
                   jax.ShapeDtypeStruct((B, num_q_heads), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=4),
        interpret=interpret_mode() if interpret is None else interpret,
        name="merge_attention_splits",
    )(o_part, lse_part)


def _gather_rows(arr, rows):
    """arr[rows] as a device array [N, R]; a host-memory ``arr`` (the pinned host tier) is read
    one row at a time with a device_put (XLA computes on device memory only)."""
    if jax.typeof(arr).memory_space != jax.memory.Space.Host:
        return arr[rows]

    def body(m, out):
        row = jax.device_put(lax.dynamic_slice_in_dim(arr, rows[m], 1, 0), jax.memory.Space.Device)
        return lax.dynamic_update_slice_in_dim(out, row, m, 0)

    return lax.fori_loop(0, rows.shape[0], body, jnp.zeros((rows.shape[0], arr.shape[1]), arr.dtype))


# --------------------------------------------------------------------------------------------
# Reference (pure jnp): gather + masked softmax in f32.
# --------------------------------------------------------------------------------------------
@register(OP, "xla")
@functools.partial(jax.jit, static_argnames=("page_size", "num_kv_heads", "sm_scale", "num_splits",
                                             "tuning", "merge"))
def sparse_paged_attention_xla(q, pool, block_rows, page_index, seq_lens, *, page_size, num_kv_heads,
                               sm_scale=None, num_splits=None, tuning=None, host=None, host_rows=None,
                               merge=None):
    """Reference. Shapes as in :func:`sparse_paged_attention`; ``num_splits``/``tuning``/``merge``
    ignored.
    With a host tier it gathers from ``host`` like from the pool (fine on the CPU; on a GPU only
    the kernel can read pinned host memory)."""
    del num_splits, tuning, merge
    _check(q, pool, block_rows, page_index, seq_lens, page_size, num_kv_heads, host, host_rows)
    if block_rows.shape[-1] == 0:
        return _empty(q)
    B, Hq, D = q.shape
    H, ps = num_kv_heads, page_size
    G, K = Hq // H, block_rows.shape[-1]
    scale = (1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
    in_pool = block_rows >= 0
    heads = jnp.arange(H, dtype=jnp.int32)[None, :, None]
    kv = _as_f32(*_heads(pool, jnp.where(in_pool, block_rows, 0), heads, H, ps, D))  # [B, H, K, 2, ps, D]
    if host is not None:
        in_host = ~in_pool & (host_rows >= 0)
        rows_h = _gather_rows(host, jnp.where(in_host, host_rows, 0).reshape(-1))
        hh = jnp.arange(H)
        # entry (b, h, i) uses head h of its row: [H, B, K, 2, ps, D] -> [B, H, K, 2, ps, D]
        kv_h = kv_quant.unpack_rows(rows_h.reshape(B, H, K, -1), H, ps, D)
        kv_h = jnp.moveaxis(kv_h[:, hh, :, :, hh], 0, 1)
        kv = jnp.where(in_host[..., None, None, None], kv_h, kv)
        in_pool = in_pool | in_host
    valid = in_pool & (page_index >= 0)  # [B, H, K]
    pos = page_index[..., None] * ps + jnp.arange(ps, dtype=jnp.int32)  # [B, H, K, ps]
    ok = valid[..., None] & (pos < seq_lens[:, None, None, None])
    kv = jnp.where(ok[:, :, :, None, :, None], kv, 0.0)
    k = kv[:, :, :, 0].reshape(B, H, K * ps, D)
    v = kv[:, :, :, 1].reshape(B, H, K * ps, D)
    qf = q.astype(jnp.float32).reshape(B, H, G, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", qf, k, precision=lax.Precision.HIGHEST) * scale
    s = jnp.where(ok.reshape(B, H, 1, K * ps), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=lax.Precision.HIGHEST)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.reshape(B, Hq, D).astype(q.dtype), lse.reshape(B, Hq)


# --------------------------------------------------------------------------------------------
# Blocked formulation in pure jnp (the default off the GPU): reads only the entries up to the
# last valid one, a chunk at a time, with an online softmax.
# --------------------------------------------------------------------------------------------
BLOCKED_CHUNK = 32  # selection entries (pages) per chunk of the blocked formulation (CPU)


def _heads(a, r, h, H, ps, D):
    """K/V of head ``h`` of rows ``r`` of the page array ``a`` [N, R] (r, h broadcast
    together): (payload [..., 2, ps, D] in a's dtype, scale bytes [..., 2, ps] uint8 of a quantized
    array, else None)."""
    n = 2 * H * ps * D
    b = kv_quant.bits(a) if kv_quant.bytes_movable(a) else a   # fp8: gathers move bytes
    payload = (b if b.shape[1] == n else b[:, :n]).reshape(a.shape[0], 2, H, ps, D)[r, :, h]
    payload = kv_quant.from_bits(payload, a.dtype)
    if not kv_quant.is_quantized(a.dtype):
        return payload, None
    return payload, kv_quant.exps_of(b[:, n:].reshape(a.shape[0], 2, H, ps)[r, :, h])


def _as_f32(payload, e):
    """:func:`_heads`' result as float32 (dequantized)."""
    return payload.astype(jnp.float32) if e is None else kv_quant.dequantize(payload, e)


def _gather_heads(arr, rows, num_kv_heads, page_size, head_dim):
    """K/V of head h of row ``rows[b, h, i]`` of ``arr`` [N, R] (rows [B, H, C]) as a device
    array [B, H, C, 2, ps, D] float32 (dequantized). A host-memory ``arr`` (the pinned host
    tier) is gathered on the host (``compute_on("device_host")``: one gather of the entries'
    own heads, where a copy per row would cost a loop iteration each) and the result moved to
    device memory in the array's dtype."""
    H, ps, D = num_kv_heads, page_size, head_dim
    heads = jnp.arange(H, dtype=jnp.int32)[None, :, None]

    def gather(a, r, h):
        payload, e = _heads(a, r, h, H, ps, D)
        return (payload,) if e is None else (payload, e)

    if jax.typeof(arr).memory_space != jax.memory.Space.Host:
        return _as_f32(*_heads(arr, rows, heads, H, ps, D))
    from jax.experimental.compute_on import compute_on

    host = jax.memory.Space.Host
    n_out = 2 if kv_quant.is_quantized(arr.dtype) else 1
    out = compute_on(gather, compute_type="device_host", out_memory_spaces=(host,) * n_out)(
        arr, jax.device_put(rows, host), jax.device_put(heads, host))
    out = [jax.device_put(o, jax.memory.Space.Device) for o in out]
    return _as_f32(out[0], out[1] if n_out == 2 else None)


@register(OP, "blocked")
@functools.partial(jax.jit, static_argnames=("page_size", "num_kv_heads", "sm_scale", "num_splits",
                                             "tuning", "merge"))
def sparse_paged_attention_blocked(q, pool, block_rows, page_index, seq_lens, *, page_size,
                                   num_kv_heads, sm_scale=None, num_splits=None, tuning=None,
                                   host=None, host_rows=None, merge=None):
    """The reference's math a chunk of ``BLOCKED_CHUNK`` entries at a time: a ``fori_loop``
    over the chunks up to the last valid entry of any (request, head) gathers each chunk's K/V
    (from the pool, or from ``host`` like the reference) and folds it into an online softmax
    (float32). A dense selection over a long context bucket reads only the pages in use, and
    no [B, H, K, 2, ps, D] copy of the whole selection is made. The chunk is
    ``tuning.pages_per_iter`` when given (any int >= 1); ``num_splits``, the rest of
    ``tuning`` and ``merge`` are ignored."""
    del num_splits, merge
    _check(q, pool, block_rows, page_index, seq_lens, page_size, num_kv_heads, host, host_rows)
    if block_rows.shape[-1] == 0:
        return _empty(q)
    B, Hq, D = q.shape
    H, ps = num_kv_heads, page_size
    G, K = Hq // H, block_rows.shape[-1]
    C = BLOCKED_CHUNK if tuning is None or tuning.pages_per_iter is None else tuning.pages_per_iter
    C = int(C)
    if C < 1:
        raise ValueError(f"pages_per_iter={C} must be >= 1")
    C = min(C, K)
    n = -(-K // C)
    scale = (1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, n * C - K)), constant_values=-1)  # noqa: E731
    block_rows, page_index = pad(block_rows), pad(page_index)
    has_src = block_rows >= 0
    if host is not None:
        host_rows = pad(host_rows)
        has_src = has_src | (host_rows >= 0)
    valid = has_src & (page_index >= 0)                                       # [B, H, nC]
    last = jnp.max(jnp.where(valid, jnp.arange(n * C, dtype=jnp.int32) + 1, 0))
    heads = jnp.arange(H, dtype=jnp.int32)[None, :, None]
    qf = q.astype(jnp.float32).reshape(B, H, G, D) * scale
    tok = jnp.arange(ps, dtype=jnp.int32)

    def chunk(c, carry):
        m, l, acc = carry
        # the [N, 2, H, ps, D] view is taken here, inside the loop: a view of the caller's pool
        # outside it makes XLA apply the caller's in-place write to both views (two buffers)
        # and copy the whole pool every call
        take = lambda a: lax.dynamic_slice_in_dim(a, c * C, C, axis=2)  # noqa: E731
        rows, pidx = take(block_rows), take(page_index)
        in_pool = rows >= 0
        kv = _as_f32(*_heads(pool, jnp.where(in_pool, rows, 0), heads, H, ps, D))
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]                                  # [B, H, C, ps, D]
        if host is not None:
            hrows = take(host_rows)
            in_host = ~in_pool & (hrows >= 0)
            kv_h = _gather_heads(host, jnp.where(in_host, hrows, 0), H, ps, D)  # [B, H, C, 2, ps, D]
            k = jnp.where(in_host[..., None, None], kv_h[:, :, :, 0], k)
            v = jnp.where(in_host[..., None, None], kv_h[:, :, :, 1], v)
            in_pool = in_pool | in_host
        ok = ((in_pool & (pidx >= 0))[..., None]
              & (pidx[..., None] * ps + tok < seq_lens[:, None, None, None]))   # [B, H, C, ps]
        k = k.reshape(B, H, C * ps, D)
        v = jnp.where(ok[..., None], v, 0.0).reshape(B, H, C * ps, D)
        s = jnp.einsum("bhgd,bhtd->bhgt", qf, k, precision=lax.Precision.HIGHEST)
        s = jnp.where(ok.reshape(B, H, 1, C * ps), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # nothing valid yet
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[..., None])
        pv = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=lax.Precision.HIGHEST)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    init = (jnp.full((B, H, G), -jnp.inf, jnp.float32), jnp.zeros((B, H, G), jnp.float32),
            jnp.zeros((B, H, G, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, (last + C - 1) // C, chunk, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.reshape(B, Hq, D).astype(q.dtype), lse.reshape(B, Hq)


prefer_on_cpu(OP, "blocked")


# --------------------------------------------------------------------------------------------
# Triton kernel: one program per (b, kv head, split), looping over its pages.
# --------------------------------------------------------------------------------------------
def _kernel(len_ref, q_ref, rows_ref, pidx_ref, pool_ref, *refs, ps, ppi, n_iter, k_per, G, G_pad,
            scale2, precision, has_host, quantized, kv_dtype, H, cdt):
    """``quantized``: the pool (and host) refs are quantized rows [N, R] (payload, then scale
    bytes; ``kv_quant``, whose scale codes depend on ``kv_dtype``), else [N, 2, H, ps, D]
    views. ``cdt``: the products' dtype."""
    if has_host:
        hrows_ref, host_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    Hq, D = q_ref.shape[1:]
    K = rows_ref.shape[2]
    T = ppi * ps
    # The group's G query heads as a [G_pad, D] block (rows >= G are zero).
    g = lax.broadcasted_iota(jnp.int32, (G_pad, D), 0)
    q = pltriton.load(q_ref.at[b, jnp.minimum(h * G + g, Hq - 1), lax.broadcasted_iota(jnp.int32, (G_pad, D), 1)],
                      mask=g < G, other=0).astype(cdt)
    seq_len = len_ref[b]
    tok = lax.broadcasted_iota(jnp.int32, (T,), 0)
    tok_page, tok_off = lax.div(tok, ps), lax.rem(tok, ps)
    off2 = jnp.broadcast_to(tok_off[:, None], (T, D))
    dim2 = lax.broadcasted_iota(jnp.int32, (T, D), 1)

    def body(i, carry):
        m, l, acc = carry
        sel = split * k_per + i * ppi + tok_page  # [T] entry index of each token
        sel_c = jnp.minimum(sel, K - 1)
        rows = rows_ref[b, h, sel_c]
        pidx = pidx_ref[b, h, sel_c]
        ok = (sel < K) & (pidx >= 0) & (pidx * ps + tok_off < seq_len)  # [T]
        in_pool = ok & (rows >= 0)

        def load_from(ref, r, sel_mask):
            """(k, v) [T, D] in cdt and, quantized, their per-token scales [T] f32 (0 where
            masked)."""
            # Every index is a full [T, D] int array (interpret mode cannot mix gathers and slices).
            r1 = jnp.where(sel_mask, r, 0)
            r2 = jnp.broadcast_to(r1[:, None], (T, D))
            mask = jnp.broadcast_to(sel_mask[:, None], (T, D))
            if not quantized:
                return (pltriton.load(ref.at[r2, 0, h, off2, dim2], mask=mask, other=0).astype(cdt),
                        pltriton.load(ref.at[r2, 1, h, off2, dim2], mask=mask, other=0).astype(cdt))
            tiles, scales = [], []
            for kv in (0, 1):  # payload [2, H, ps, D], then the scale bytes [2, H, ps]
                # (fp8 loads take no ``other``: masked lanes are zeroed after the conversion)
                col = ((kv * H + h) * ps + off2) * D + dim2
                t = pltriton.load(ref.at[r2, col], mask=mask).astype(cdt)
                tiles.append(jnp.where(mask, t, jnp.zeros((), cdt)))
                e = pltriton.load(ref.at[r1, 2 * H * ps * D + (kv * H + h) * ps + tok_off],
                                  mask=sel_mask)
                e = lax.bitcast_convert_type(e, jnp.uint8).astype(jnp.int32)
                sc = kv_quant.scale_of(e, kv_dtype)
                scales.append(jnp.where(sel_mask, sc, 0.0))
            return tuple(tiles) + tuple(scales)

        if has_host:  # entries missing from the pool: read the pinned host rows in place
            hrows = hrows_ref[b, h, sel_c]
            in_host = ok & (rows < 0) & (hrows >= 0)
            any_host = jnp.max(in_host.astype(jnp.int32)) > 0
            # Most tiles have no missed page, so the host loads sit in a branch of their own
            # (compiled in line and masked, they slow every tile: docs/decisions.md).
            if ppi == 1:  # a tile is one page: from the pool or from the host tier, never both
                tile = lax.cond(any_host, lambda: load_from(host_ref, hrows, in_host),
                                lambda: load_from(pool_ref, rows, in_pool))
            else:
                def add_host(t):  # masked-out lanes load 0 (scale 0): pool + host = the tile
                    return tuple(a + b for a, b in zip(t, load_from(host_ref, hrows, in_host)))

                tile = lax.cond(any_host, add_host, lambda t: t,
                                load_from(pool_ref, rows, in_pool))
            ok = in_pool | in_host
        else:
            tile = load_from(pool_ref, rows, in_pool)
            ok = in_pool
        k, v = tile[:2]
        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale2  # [G_pad, T] f32, log2 units
        if quantized:
            s = s * tile[2][None, :]
        s = jnp.where(ok[None, :], s, -jnp.inf)
        return online_softmax_step(m, l, acc, s, v, precision, tile[3] if quantized else None)

    init = (jnp.full((G_pad,), -jnp.inf, jnp.float32), jnp.zeros((G_pad,), jnp.float32),
            jnp.zeros((G_pad, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, n_iter, body, init)
    nonempty = l > 0
    l_safe = jnp.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    lse = jnp.where(nonempty, (m + jnp.log2(l_safe)) * _LN2, -jnp.inf)
    pltriton.store(o_ref, out, mask=g < G)
    pltriton.store(lse_ref, lse, mask=lax.broadcasted_iota(jnp.int32, (G_pad,), 0) < G)


@register(OP, "pallas")
@functools.partial(jax.jit, static_argnames=("page_size", "num_kv_heads", "sm_scale", "num_splits",
                                             "tuning"))
def sparse_paged_attention_pallas(q, pool, block_rows, page_index, seq_lens, *, page_size, num_kv_heads,
                                  sm_scale=None, num_splits=None, tuning=None, host=None,
                                  host_rows=None):
    """Pallas (Triton) kernel. Shapes as in :func:`sparse_paged_attention`."""
    return _pallas_impl(q, pool, block_rows, page_index, seq_lens, page_size=page_size,
                        num_kv_heads=num_kv_heads, sm_scale=sm_scale, num_splits=num_splits,
                        tuning=tuning, interpret=interpret_mode(), host=host, host_rows=host_rows)


def _pallas_impl(q, pool, block_rows, page_index, seq_lens, *, page_size, num_kv_heads, sm_scale,
                 num_splits, tuning, interpret, host=None, host_rows=None):
    _check(q, pool, block_rows, page_index, seq_lens, page_size, num_kv_heads, host, host_rows)
    if block_rows.shape[-1] == 0:
        return _empty(q)
    tuning = tuning or AttentionTuning()
    B, Hq, D = q.shape
    H, ps = num_kv_heads, page_size
    G, K = Hq // H, block_rows.shape[-1]
    G_pad = max(16, next_pow2(G))
    ppi = max(tuning.pages_per_iter or 1, -(-16 // ps))
    ppi = next_pow2(ppi)
    S = num_splits or default_num_splits(B, H, K, ppi)
    S = max(1, min(S, -(-K // ppi)))
    k_per = -(-K // (S * ppi)) * ppi  # entries per split, a multiple of ppi
    S = -(-K // k_per)  # drop splits that would be empty
    quantized = kv_quant.is_quantized(pool.dtype)
    view = (lambda a: a) if quantized else (lambda a: a.reshape(a.shape[0], 2, H, ps, D))  # noqa: E731
    pool5 = view(pool)
    scale = (1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
    cdt = kv_quant.compute_dtype(q.dtype, pool.dtype)
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    kernel = functools.partial(_kernel, ps=ps, ppi=ppi, n_iter=k_per // ppi, k_per=k_per, G=G, G_pad=G_pad,
                               scale2=scale * _LOG2E, precision=precision, has_host=host is not None,
                               quantized=quantized, kv_dtype=pool.dtype, H=H, cdt=cdt)
    in_specs = [
        pl.BlockSpec((B,), lambda b, h, s: (0,)),
        pl.BlockSpec((B, Hq, D), lambda b, h, s: (0, 0, 0)),
        pl.BlockSpec((B, H, K), lambda b, h, s: (0, 0, 0)),
        pl.BlockSpec((B, H, K), lambda b, h, s: (0, 0, 0)),
        pl.BlockSpec(pool5.shape, lambda b, h, s: (0,) * pool5.ndim),
    ]
    operands = [seq_lens.astype(jnp.int32), q, block_rows.astype(jnp.int32),
                page_index.astype(jnp.int32), pool5]
    if host is not None:
        host5 = view(host)
        in_specs += [pl.BlockSpec((B, H, K), lambda b, h, s: (0, 0, 0)),
                     pl.BlockSpec(host5.shape, lambda b, h, s: (0,) * host5.ndim)]
        operands += [host_rows.astype(jnp.int32), host5]
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(B, H, S),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, G_pad, D), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, G_pad), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, S, G_pad, D), jnp.float32),
            jax.ShapeDtypeStruct((B, H, S, G_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="sparse_paged_attention",
    )(*operands)
    if S > 1:
        return merge_splits_pallas(o_part, lse_part, num_q_heads=Hq, out_dtype=q.dtype,
                                   interpret=interpret)
    o_part, lse_part = o_part[:, :, :, :G], lse_part[:, :, :, :G]
    out, lse = o_part[:, :, 0], lse_part[:, :, 0]
    return out.reshape(B, Hq, D).astype(q.dtype), lse.reshape(B, Hq)


def sparse_paged_attention(q, pool, block_rows, page_index, seq_lens, *, page_size, num_kv_heads,
                           sm_scale=None, num_splits=None, tuning=None, implementation=None,
                           host=None, host_rows=None):
    """Decode attention of ``q`` over selected pool pages (see the module docstring for semantics).

    q: ``[B, Hq, D]`` bf16/f32 (query head j uses KV head ``j // (Hq // H)``); pool: ``[N_rows, R]``
    any float dtype (products in ``kv_quant.compute_dtype``), ``R = kv_quant.row_elems`` (``2 *
    H * ps * D``, quantized: then the scales); block_rows, page_index: ``[B, H, K]`` int32 (global pool row
    and within-sequence page number of each entry, -1 = none); seq_lens: ``[B]`` int32.
    Static: page_size, num_kv_heads (H), sm_scale (default ``D**-0.5``), num_splits (partial results
    per (b, h), default :func:`default_num_splits`), tuning (:class:`AttentionTuning`).
    Optional host tier: ``host`` ``[N_host, R]`` (the ``pinned_host`` array, same row layout and
    dtype as the pool) and ``host_rows`` ``[B, H, K]`` int32: an entry whose ``block_rows`` is -1
    is read from host row ``host_rows`` (-1 = none) in place.
    Returns ``(out [B, Hq, D] q.dtype, lse [B, Hq] f32)``; empty selection -> ``(0, -inf)``.
    """
    fn = resolve(OP, implementation)
    extra = {} if host is None else dict(host=host, host_rows=host_rows)
    return fn(q, pool, block_rows, page_index, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads,
              sm_scale=sm_scale, num_splits=num_splits, tuning=tuning, **extra)
