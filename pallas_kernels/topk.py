"""Top-k page selection in one Pallas kernel (``select_top_pages(method="pallas")``).

Same contract as ``dense_select.select_top_pages`` (see the ``dense_select`` module
docstring): per row of ``scores`` the ``k`` best pages, int32, ascending, ``-1`` padding last,
sinks and the last valid page always in, nothing at or past ``ceil(seq_len / page_size)``.

**Selection rule** (exact, written down so that it can be tested): a row's values are
``+inf`` for forced pages (sinks, last valid page), the score for the other valid pages (NaN
counts as ``-inf``; ``-0.0`` as ``+0.0``), and invalid pages / padding columns are never
candidates. Let ``T`` be the k-th largest value over the valid pages (or "none" when there
are fewer than ``k``). The kernel selects every valid page with value ``> T`` and then, among
the pages with value ``== T``, the ones with the **lowest indices** until it has ``k``
(a stable sort by descending value, ties by ascending index, then the first ``k``).

**Kernel** (Triton backend; ``interpret=True`` off the GPU): one program per row (grid
``B * H``). Values are mapped to the order-preserving int32 image of their float32 bits
(``key = bits ^ ((bits >> 31) & 0x7fffffff)``; invalid = INT32_MIN), so ``T`` is found exactly
by a radix search on keys: ``32 / radix_bits`` passes, each counting ``key >= t`` for
``2**radix_bits`` thresholds at once. To keep those passes small for long rows (two stages,
``chunk = c > 1``): the row (``N`` padded to a power of two with masked loads) is viewed as
``[N / c, c]`` chunks; the k-th largest chunk max ``M`` is found first; the chunks with max
``> M`` plus the lowest-index chunks with max ``== M``, ``k`` chunks in all, contain every
value ``> M`` and ``k`` values ``>= M``, so the k-th largest of their ``k * c`` entries
(re-loaded by index from the L2-resident scores) is exactly ``T``. The final pass over the whole row selects
``key > T`` plus the first ``k - count(key > T)`` ties (one packed forward ``cumsum`` gives
both counts) and scatters the selected column indices to their ranks; the rest of the
output row is set to -1. No sort is needed: the ranks are already ascending column order.
**Chunk-maxima path** (``chunk_max=``, top-k method "pallas_cmax"; Quest's scores kernel
writes the maxima): stage 1 reads the ``N / c`` maxima instead of the row, chooses the same
``k`` chunks, and both the k-th largest and the final selection / compaction run on the
``k * c`` candidates only (the whole row is never read; proof in
``select_top_pages_pallas``). Register use (row-reading path): the row's keys stay live (``N / (32 * num_warps)`` int32 per thread, 32 at
N = 16384 with 16 warps); the largest transient arrays are ``[N / c, 2**radix_bits]`` and
``[k, N / c]`` (16384 elements at N = 16384, k = 32, c = 16).
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
from ._common import INVALID

OP = "select_top_pages"
_INT_MIN = -(2**31)
_KEY_POS_INF = 0x7F800000  # _float_key(+inf)


def _keys(x, cols, n_valid, *, num_sink_pages: int, n_cols: int):
    """Order-preserving int32 keys of the masked values (selection rule in the module doc).

    x: float scores (any shape), cols: int32 column indices (same shape), n_valid: int32
    scalar or broadcastable. Forced -> key(+inf); invalid / padding -> INT32_MIN."""
    valid = (cols < n_valid) & (cols < n_cols)
    forced = valid & ((cols < num_sink_pages) | (cols == n_valid - 1))
    return jnp.where(valid, _float_key(jnp.where(forced, jnp.inf, x)), jnp.int32(_INT_MIN))


def _float_key(x):
    """Order-preserving int32 image of float ``x`` (NaN as -inf, -0.0 as +0.0)."""
    x = x.astype(jnp.float32)
    x = jnp.where(x == x, x, -jnp.inf)   # NaN -> -inf
    x = jnp.where(x == 0, 0.0, x)        # -0.0 -> +0.0
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ (lax.shift_right_arithmetic(bits, jnp.int32(31)) & jnp.int32(0x7FFFFFFF))


def _total(x):
    """Sum of every element of int32 ``x``, one axis at a time: the Triton lowering's own
    multi-axis reduce fails under an abstract mesh (the GPU lowering test), and like it we put
    a double negation between reduces (a layout conversion Triton needs, triton#1776)."""
    for i in range(x.ndim):
        x = jnp.sum(x, axis=0)
        if x.ndim:
            x = -(-x)
    return x


def _kth_largest(keys, k: int, radix_bits: int):
    """Exact k-th largest of the int32 ``keys`` (any shape), INT32_MIN when there are fewer
    than ``k``: the largest ``t`` with ``count(keys >= t) >= k``, built ``radix_bits`` bits at a
    time from the top on the unsigned image ``key ^ INT32_MIN``."""
    nd = 1 << radix_bits
    d = lax.broadcasted_iota(jnp.int32, (nd,), 0)
    t_shape = (1,) * keys.ndim + (nd,)
    prefix = jnp.int32(0)  # unsigned bit pattern of T found so far
    for shift in range(32 - radix_bits, -1, -radix_bits):
        t = (prefix | lax.shift_left(d, jnp.int32(shift))) ^ jnp.int32(_INT_MIN)
        cnt = (keys[..., None] >= t.reshape(t_shape)).astype(jnp.int32)
        for _ in range(keys.ndim):
            cnt = -(-jnp.sum(cnt, axis=0))  # one axis at a time, see _total
        digit = jnp.maximum(jnp.sum((cnt >= k).astype(jnp.int32)) - 1, 0)
        prefix = prefix | lax.shift_left(digit, jnp.int32(shift))
    return prefix ^ jnp.int32(_INT_MIN)


def _cumsum_row_major(x):
    """Inclusive prefix sum of int32 ``x`` [R, C] in row-major order (forward scans only)."""
    inner = lax.cumsum(x, axis=1)
    if x.shape[0] == 1:
        return inner
    tot = jnp.sum(x, axis=1)
    return inner + (lax.cumsum(tot, axis=0) - tot)[:, None]


def _take_first(keys, t, k: int):
    """Select ``keys > t`` plus the lowest-index (row-major) ties ``== t`` up to ``k`` in all
    (ties at INT32_MIN, i.e. invalid, are never taken). ``count(keys > t) < k`` must hold.

    keys: int32 [n] or [R, C]. Returns (selected bool, rank int32): ``rank`` is the inclusive
    number of selected entries up to each position (so a selected entry goes to ``rank - 1``).
    """
    gt = keys > t
    tie = (keys == t) & (t != jnp.int32(_INT_MIN))
    need = k - _total(gt.astype(jnp.int32))
    s = keys.size.bit_length()  # tie counts < 2**s; gt counts < k, so (k << s) must fit
    assert (k << s) < 2**31, (k, keys.shape)
    packed = lax.shift_left(gt.astype(jnp.int32), jnp.int32(s)) | tie.astype(jnp.int32)
    cum = _cumsum_row_major(packed if keys.ndim == 2 else packed[None])
    cum = cum if keys.ndim == 2 else cum.reshape(keys.shape)
    n_gt = lax.shift_right_logical(cum, jnp.int32(s))
    n_tie = cum & jnp.int32((1 << s) - 1)
    return gt | (tie & (n_tie <= need)), n_gt + jnp.minimum(n_tie, need)


def _choose_chunks(ckeys, k: int, radix_bits: int):
    """Ids [next_pow2(k)] of the ``k`` chunks with the largest keys ``ckeys`` [nc] (ties: lowest
    id), ascending; ``nc`` marks an unused slot (fewer than ``k`` chunks with a valid page)."""
    nc = ckeys.shape[0]
    m = _kth_largest(ckeys, k, radix_bits)
    _, crank = _take_first(ckeys, m, k)  # inclusive count of chosen chunks
    j = lax.broadcasted_iota(jnp.int32, (_common.next_pow2(k), nc), 0)
    return jnp.sum((crank[None, :] <= j).astype(jnp.int32), axis=1)


def _load_chunks(scores_ref, row, cid, nc, chunk, n_load, n_valid, key_kw):
    """(column ids, keys) [len(cid), chunk] of the chunks ``cid`` (unused slots: INT32_MIN)."""
    ccols = cid[:, None] * chunk + lax.broadcasted_iota(jnp.int32, (cid.shape[0], chunk), 1)
    ok = (cid < nc)[:, None] & (ccols < n_load)
    cx = plgpu.load(scores_ref.at[row, ccols], mask=ok, other=-jnp.inf)
    return ccols, jnp.where(ok, _keys(cx, ccols, n_valid, **key_kw), jnp.int32(_INT_MIN))


def _write_selection(out_ref, row, keys, cols, t, k: int):
    """Select from ``keys`` (row-major = ascending ``cols``) with threshold ``t`` and write the
    selected ``cols`` compacted in order, then -1, to ``out_ref[row, :k]``."""
    sel, rank = _take_first(keys, t, k)
    n_sel = _total(sel.astype(jnp.int32))
    j = lax.broadcasted_iota(jnp.int32, (_common.next_pow2(k),), 0)
    plgpu.store(out_ref.at[row, j], jnp.full(j.shape, INVALID, jnp.int32),
                mask=(j >= n_sel) & (j < k))
    # Unselected entries aim past the row (dropped in interpret mode, masked on the GPU).
    plgpu.store(out_ref.at[row, jnp.where(sel, rank - 1, k)], cols, mask=sel)


def _topk_kernel(lens_ref, scores_ref, out_ref, *, heads, n_cols, num_pages, k, page_size,
                 num_sink_pages, chunk, n_pad, radix_bits):
    row = pl.program_id(0)
    n_valid = _common.num_valid_pages(lens_ref[row // heads], page_size, num_pages)
    n_load = jnp.minimum(n_valid, n_cols)  # columns worth reading (the rest is never read)
    nc = n_pad // chunk
    cols = (lax.broadcasted_iota(jnp.int32, (nc, chunk), 0) * chunk
            + lax.broadcasted_iota(jnp.int32, (nc, chunk), 1))
    key_kw = dict(num_sink_pages=num_sink_pages, n_cols=n_cols)
    x = plgpu.load(scores_ref.at[row, cols], mask=cols < n_load, other=-jnp.inf)
    keys = _keys(x, cols, n_valid, **key_kw)  # [nc, chunk]
    if chunk == 1:
        t = _kth_largest(keys, k, radix_bits)
    else:
        # Stage 1: the k chunks holding the top-k (chunk maxima, ties by lowest chunk index).
        cid = _choose_chunks(jnp.max(keys, axis=1), k, radix_bits)  # nc >= 2 * kp >= k
        # Stage 2: exact k-th largest of those k * chunk entries (re-read by index).
        _, ckeys = _load_chunks(scores_ref, row, cid, nc, chunk, n_load, n_valid, key_kw)
        t = _kth_largest(ckeys, k, radix_bits)
    _write_selection(out_ref, row, keys, cols, t, k)


def _topk_cmax_kernel(lens_ref, scores_ref, cmax_ref, out_ref, *, heads, n_cols, n_chunks,
                      num_pages, k, page_size, num_sink_pages, chunk, nc_pad, radix_bits):
    """Top-k from chunk maxima: reads ``n_chunks`` maxima and ``k * chunk`` scores per row."""
    row = pl.program_id(0)
    n_valid = _common.num_valid_pages(lens_ref[row // heads], page_size, num_pages)
    n_load = jnp.minimum(n_valid, n_cols)
    c = lax.broadcasted_iota(jnp.int32, (nc_pad,), 0)
    start = c * chunk
    has_valid = start < n_load  # implies c < n_chunks
    last = n_valid - 1
    forced = has_valid & ((start < num_sink_pages)
                          | ((start <= last) & (last < start + chunk) & (last < n_load)))
    cm = plgpu.load(cmax_ref.at[row, c], mask=has_valid, other=-jnp.inf)
    ckey = jnp.where(forced, jnp.int32(_KEY_POS_INF),
                     jnp.where(has_valid, _float_key(cm), jnp.int32(_INT_MIN)))
    cid = _choose_chunks(ckey, k, radix_bits)
    key_kw = dict(num_sink_pages=num_sink_pages, n_cols=n_cols)
    ccols, ckeys = _load_chunks(scores_ref, row, cid, nc_pad, chunk, n_load, n_valid, key_kw)
    _write_selection(out_ref, row, ckeys, ccols, _kth_largest(ckeys, k, radix_bits), k)


def _pieces_kernel(lens_ref, scores_ref, out_ref, *, heads, pieces, n_cols, num_pages, k,
                   page_size, num_sink_pages, ns0, ns, chunk, n_pad, radix_bits):
    """One program per strided piece of a row (``select_top_pieces_pallas``): program ``i``
    takes piece ``i % pieces`` of scores row ``i // pieces``, its local column ``j`` being the
    row's page ``g = i % pieces + pieces * j``. The row's mask is applied here: ``+inf`` for
    its forced pages, ``-inf`` for pages past the sequence, NaN and the row's padding (the
    pages of ``ns0`` local columns can be valid; a piece padded to ``ns >= k`` columns holds
    ``-inf`` past them); every local column ``< ns`` is a candidate (its key that of the
    masked value), so each piece selects exactly ``k``; the selected pages are written, ``-1``
    where the value is ``-inf``."""
    i = pl.program_id(0)
    row, s = i // pieces, i % pieces
    n_valid = _common.num_valid_pages(lens_ref[row // heads], page_size, num_pages)

    def load(local):
        g = s + pieces * local
        x = plgpu.load(scores_ref.at[row, g], mask=(local < ns) & (g < n_cols), other=-jnp.inf)
        valid = (g < n_valid) & (local < ns0)
        forced = valid & ((g < num_sink_pages) | (g == n_valid - 1))
        v = jnp.where(forced, jnp.inf, jnp.where(valid & (x == x), x.astype(jnp.float32),
                                                 -jnp.inf))
        keys = jnp.where(local < ns, _float_key(v), jnp.int32(_INT_MIN))
        return keys, jnp.where(v == -jnp.inf, jnp.int32(INVALID), g)

    nc = n_pad // chunk
    local = (lax.broadcasted_iota(jnp.int32, (nc, chunk), 0) * chunk
             + lax.broadcasted_iota(jnp.int32, (nc, chunk), 1))
    keys, pages = load(local)
    if chunk == 1:
        t = _kth_largest(keys, k, radix_bits)
    else:
        cid = _choose_chunks(jnp.max(keys, axis=1), k, radix_bits)
        ccols = cid[:, None] * chunk + lax.broadcasted_iota(jnp.int32, (cid.shape[0], chunk), 1)
        ckeys, _ = load(ccols)  # an unused slot (cid == nc) lies past ns: INT32_MIN keys
        t = _kth_largest(ckeys, k, radix_bits)
    _write_selection(out_ref, i, keys, pages, t, k)


def _default_chunk(n_pad: int, k: int) -> int:
    """Largest power of two <= sqrt(n_pad / next_pow2(k)) (1 = single stage)."""
    c = math.isqrt(max(1, n_pad // _common.next_pow2(k)))
    return 1 << (c.bit_length() - 1)


# Two-stage transients [next_pow2(k), N_pad / chunk] above this many elements: the full-row
# kernel takes the single stage (chunk 1) instead. H200, 16 rows of 2048 pages: k = 128
# two-stage 22.9 us, single 12.2 us; k = 256 49.6 against 11.7 us; Quest's k = 32 ([32, 256])
# stays two-stage (benchmarks/probes/first_stage_topk.py, docs/decisions.md).
TWO_STAGE_MAX_ELEMENTS = 2**15


def _full_row_defaults(n_pad: int, k: int, chunk, radix_bits):
    """The full-row kernel's ``chunk`` and ``radix_bits`` where the caller leaves them None:
    ``_default_chunk``, or the single stage when the two-stage transients would exceed
    ``TWO_STAGE_MAX_ELEMENTS``; 2-bit radix passes for a single stage over 2048 columns or
    more (8 rows of 8192 pages, k = 512: 25.2 us against 232.7 us with 4-bit passes, whose
    [N, 16] counts spill), else 4."""
    if chunk is None:
        chunk = _default_chunk(n_pad, k)
        if chunk > 1 and _common.next_pow2(k) * (n_pad // chunk) > TWO_STAGE_MAX_ELEMENTS:
            chunk = 1
    if radix_bits is None:
        radix_bits = 2 if chunk == 1 and n_pad >= 2048 else 4
    return chunk, radix_bits


def _default_warps(n_pad: int) -> int:
    return 4 if n_pad <= 1024 else 8 if n_pad <= 4096 else 16


# Elements of one Triton tensor: the verifier refuses larger blocks.
TRITON_MAX_ELEMENTS = 2**20


def fits(n: int, k: int) -> bool:
    """Whether the chunk-maxima top-k compiles for rows of ``n`` columns and ``k`` picks: its
    stage 1 holds a [next_pow2(k), n_pad / chunk] block, which Triton caps at
    ``TRITON_MAX_ELEMENTS`` (k = 1024 of 8192 pages exceeds it). The full-row kernel takes
    the single stage for such rows (``fits_full_row``)."""
    n_pad = _common.next_pow2(max(n, 1))
    return _common.next_pow2(k) * (n_pad // _default_chunk(n_pad, k)) <= TRITON_MAX_ELEMENTS


def fits_full_row(n: int, k: int) -> bool:
    """Whether the full-row kernel with its default chunking compiles for rows of ``n``
    columns and ``k`` picks (its largest block under ``TRITON_MAX_ELEMENTS``)."""
    n_pad = _common.next_pow2(max(n, 1))
    chunk, radix_bits = _full_row_defaults(n_pad, k, None, None)
    if chunk == 1:
        return n_pad << radix_bits <= TRITON_MAX_ELEMENTS
    return _common.next_pow2(k) * (n_pad // chunk) <= TRITON_MAX_ELEMENTS


def default_cmax_chunk(n: int, k: int) -> int:
    """Chunk for the chunk-maxima path: largest power of two <= sqrt(next_pow2(n) / next_pow2(k))
    (balances the ``N / chunk`` maxima and the ``k * chunk`` candidates a row reads; >= 1)."""
    return _default_chunk(_common.next_pow2(max(n, 1)), k)


def chunk_max(scores, seq_lens, *, num_pages: int, page_size: int, chunk: int):
    """Chunk maxima in XLA, as ``select_top_pages_pallas(chunk_max=)`` takes them.

    scores [B, (H,) N] float; seq_lens [B]. Returns f32 [B, (H,) ceil(N / chunk)]: the max of
    each chunk of ``chunk`` columns over its pages ``< ceil(seq_len / page_size)`` (and
    ``< num_pages``), NaN taken as -inf; -inf for a chunk without such a page."""
    lead = scores.shape[:-1]
    nv = _common.num_valid_pages(jnp.asarray(seq_lens, jnp.int32), page_size, num_pages)
    nv = nv.reshape((lead[0],) + (1,) * len(lead))
    cols = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    return pad_and_chunk_max(jnp.where(cols < nv, scores.astype(jnp.float32), -jnp.inf),
                             chunk)[1]


def pad_and_chunk_max(x, chunk: int):
    """x [..., N] f32 -> (x padded with -inf to a multiple of ``chunk``, its chunk maxima
    [..., N_pad // chunk] with NaN taken as -inf)."""
    n = x.shape[-1]
    n_pad = -(-n // chunk) * chunk
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_pad - n)], constant_values=-jnp.inf)
    xm = jnp.where(x == x, x, -jnp.inf)
    return x, xm.reshape(x.shape[:-1] + (n_pad // chunk, chunk)).max(axis=-1)


@_common.register(OP, "pallas")
def select_top_pages_pallas(scores, seq_lens, *, num_pages: int, k: int, page_size: int,
                            num_sink_pages: int, chunk: int | None = None,
                            radix_bits: int | None = None,
                            num_warps: int | None = None, interpret: bool | None = None,
                            chunk_max=None):
    """Top-``k`` pages per row with one Pallas kernel (selection rule: module docstring).

    scores: [B, N] or [B, H, N] float (any float dtype; column ``p`` = page ``p``, columns
    ``>= num_pages`` and pages past the sequence are never read). seq_lens: [B] int.
    Returns int32 [B, k] or [B, H, k]. Tuning (static): ``chunk`` (power of two; 1 = single
    stage; default ~sqrt(N / k), or 1 for large k: ``_full_row_defaults``), ``radix_bits``
    (1, 2 or 4; default 2 for a single stage over 2048 columns or more, else 4), ``num_warps``
    (default 4 / 8 / 16 for N <= 1024 / <= 4096 / larger; with ``chunk_max`` by
    ``k * N / chunk``).

    chunk_max: optional f32 [B, (H,) ceil(N / chunk)], ``chunk_max[..., c]`` = max of the
    scores of the chunk's pages inside the sequence, NaN as -inf (any value where the chunk
    has no such page): ``chunk`` then defaults to ``N / chunk_max.shape[-1]`` rounded up to a
    power of two. The kernel then reads only the maxima and the ``k`` chosen chunks (see
    ``_topk_cmax_kernel``), with the same result, bit for bit: chunk keys are the maxima's keys,
    INT32_MIN for a chunk without a valid page, key(+inf) for one holding a forced page, i.e.
    the max of its entries' keys. Let M be the k-th largest chunk key and T the k-th largest
    entry key. The k chosen chunks (keys > M, then the lowest ids with key == M) each hold an
    entry >= M, so T >= M. An entry > T is > M, so its chunk is chosen. If T > M every tie
    (== T) is in a chosen chunk. If T == M: with c_gt chunks > M, each holding an entry > T,
    ``need = k - count(> T) <= k - c_gt``; the k - c_gt chosen chunks with key M each hold a
    tie, and every unchosen chunk with key M has a higher id, so the ``need`` lowest-index ties
    lie in chosen chunks. Hence the candidates hold every entry > T and the ties the rule takes,
    T is their k-th largest, and as they are in ascending column order (chosen ids ascending,
    columns ascending inside), taking ``> T`` then the first ties gives the rule's selection.
    """
    if k < num_sink_pages + 1:
        raise ValueError(f"k={k} must be >= num_sink_pages + 1 = {num_sink_pages + 1}")
    if chunk_max is None:
        chunk, radix_bits = _full_row_defaults(_common.next_pow2(max(scores.shape[-1], 1)), k,
                                               chunk, radix_bits)
    elif radix_bits is None:
        radix_bits = 4
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = math.prod(lead)
    lens = jnp.asarray(seq_lens, jnp.int32).reshape(lead[0])
    params = dict(heads=rows // lead[0], n_cols=n, num_pages=num_pages, k=k,
                  page_size=page_size, num_sink_pages=num_sink_pages, radix_bits=radix_bits)
    call = functools.partial(
        pl.pallas_call, out_shape=jax.ShapeDtypeStruct((rows, k), jnp.int32), grid=(rows,),
        out_specs=pl.BlockSpec((rows, k), lambda i: (0, 0)),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="select_top_pages")
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    flat = scores.reshape(rows, n)
    if chunk_max is not None:
        ncm = chunk_max.shape[-1]
        if chunk is None:
            chunk = _common.next_pow2(-(-n // max(ncm, 1)))
        if (chunk_max.shape[:-1] != lead or chunk < 1 or chunk & (chunk - 1)
                or ncm != -(-n // chunk)):
            raise ValueError(f"chunk_max {chunk_max.shape} must be {lead} + (ceil({n} / chunk),)"
                             f" with chunk a power of two, got chunk={chunk}")
        nc_pad = _common.next_pow2(ncm)
        kernel = functools.partial(_topk_cmax_kernel, n_chunks=ncm, chunk=chunk, nc_pad=nc_pad,
                                   **params)
        cm = chunk_max.reshape(rows, ncm).astype(jnp.float32)
        out = call(kernel, in_specs=[full(lens), full(flat), full(cm)],
                   compiler_params=plgpu.CompilerParams(
                       num_warps=num_warps or _default_warps(nc_pad * _common.next_pow2(k) // 8),
                       num_stages=1))(lens, flat, cm)
        return out.reshape(lead + (k,))
    n_pad = _common.next_pow2(max(n, 1))
    if chunk & (chunk - 1) or chunk < 1 or (chunk > 1 and n_pad // chunk < 2 * k):
        raise ValueError(f"chunk={chunk} must be a power of two with N_pad / chunk >= 2k")
    kernel = functools.partial(_topk_kernel, chunk=chunk, n_pad=n_pad, **params)
    out = call(kernel, in_specs=[full(lens), full(flat)],
               compiler_params=plgpu.CompilerParams(
                   num_warps=num_warps or _default_warps(n_pad), num_stages=1))(lens, flat)
    return out.reshape(lead + (k,))


def select_top_pieces_pallas(scores, seq_lens, *, num_pages: int, k: int, page_size: int,
                             num_sink_pages: int, pieces: int, num_warps: int | None = None,
                             interpret: bool | None = None):
    """``dense_select.select_top_pages(pieces=)``'s candidate set in one kernel: the top
    ``k / pieces`` of each strided piece of a row (page ``p`` in piece ``p % pieces``), one
    program per piece reading its pages straight from the row and masking them as the row's
    selection rule does (``_pieces_kernel``; no masked, transposed copy of the scores before
    it and no select after it). The same pages in the same places as
    :func:`select_top_pieces_reference`: per piece its selection ascending, ``-1`` for a
    pick whose masked value is ``-inf``.

    scores [B, H, N] float; seq_lens [B] int. Returns int32 [B, H, k]."""
    B, H, n = scores.shape
    S = pieces
    if k % S:
        raise ValueError(f"pieces={S} must divide k={k}")
    kp = k // S
    ns0 = -(-n // S)
    ns = max(ns0, kp)  # a piece's columns (padded to its share with -inf)
    n_pad = _common.next_pow2(ns)
    chunk, radix_bits = _full_row_defaults(n_pad, kp, None, None)
    kernel = functools.partial(_pieces_kernel, heads=H, pieces=S, n_cols=n,
                               num_pages=num_pages, k=kp, page_size=page_size,
                               num_sink_pages=num_sink_pages, ns0=ns0, ns=ns, chunk=chunk,
                               n_pad=n_pad,
                               radix_bits=radix_bits)
    rows = B * H * S
    lens = jnp.asarray(seq_lens, jnp.int32).reshape(B)
    flat = scores.reshape(B * H, n)
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, kp), jnp.int32), grid=(rows,),
        in_specs=[full(lens), full(flat)], out_specs=pl.BlockSpec((rows, kp), lambda i: (0, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or _default_warps(n_pad),
                                             num_stages=1),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="select_top_pieces")(lens, flat)
    return out.reshape(B, H, k)


def strided_pieces(scores: jax.Array, seq_lens: jax.Array, *, num_pages: int, page_size: int,
                   num_sink_pages: int, pieces: int, min_cols: int = 0) -> jax.Array:
    """[B, H, N] scores masked as the selection rule masks them (forced pages ``+inf``, pages
    past the sequence, padding and columns ``>= num_pages`` ``-inf``, NaN ``-inf``), viewed as
    ``pieces`` strided pieces per row: f32 [B, H, pieces, max(ceil(N / pieces), min_cols)],
    piece ``p`` holding pages ``p, p + pieces, p + 2 * pieces, ...`` (``-inf`` past the row
    and in the columns ``min_cols`` adds: a piece shorter than its share of the picks)."""
    B, H, n = scores.shape
    S = pieces
    ns = -(-n // S)
    n_valid = _common.num_valid_pages(jnp.asarray(seq_lens, jnp.int32), page_size,
                                      num_pages)[:, None, None]
    pages = lax.broadcasted_iota(jnp.int32, (B, H, ns * S), 2)
    x = jnp.pad(scores.astype(jnp.float32), ((0, 0), (0, 0), (0, ns * S - n)),
                constant_values=-jnp.inf)
    valid = pages < n_valid
    forced = valid & ((pages < num_sink_pages) | (pages == n_valid - 1))
    x = jnp.where(forced, jnp.inf, jnp.where(valid & (x == x), x, -jnp.inf))
    x = x.reshape(B, H, ns, S).swapaxes(2, 3)
    if ns < min_cols:
        x = jnp.pad(x, ((0, 0),) * 3 + ((0, min_cols - ns),), constant_values=-jnp.inf)
    return x


def select_top_pieces_reference(scores, seq_lens, *, num_pages: int, k: int, page_size: int,
                                num_sink_pages: int, pieces: int):
    """Pure-jnp reference of ``select_top_pieces_pallas``: each piece of
    :func:`strided_pieces` (padded with ``-inf`` to ``k / pieces`` columns), the first
    ``k / pieces`` by descending value with ties to the lower column (a stable sort), in
    column order, each the row's page or ``-1`` where its masked value is ``-inf``. Returns
    int32 [B, H, k]."""
    B, H, _ = scores.shape
    S, kp = pieces, k // pieces
    v = strided_pieces(scores, seq_lens, num_pages=num_pages, page_size=page_size,
                       num_sink_pages=num_sink_pages, pieces=S, min_cols=kp)    # [B, H, S, ns]
    keys = _float_key(v)
    cols = lax.broadcasted_iota(jnp.int32, keys.shape, 3)
    _, top = lax.sort((~keys, cols), dimension=3, num_keys=1, is_stable=True)
    top = jnp.sort(top[..., :kp], axis=-1)                                       # column order
    val = jnp.take_along_axis(v, top, axis=3)
    page = top * S + jnp.arange(S, dtype=jnp.int32)[:, None]
    return jnp.where(val == -jnp.inf, INVALID, page).reshape(B, H, k)


@_common.register(OP, "xla")
def select_top_pages_reference(scores, seq_lens, *, num_pages: int, k: int, page_size: int,
                               num_sink_pages: int):
    """Pure-jnp reference of the selection rule (stable sort; slow for long rows).

    Shapes and result as ``select_top_pages_pallas``."""
    if k < num_sink_pages + 1:
        raise ValueError(f"k={k} must be >= num_sink_pages + 1 = {num_sink_pages + 1}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    nv = _common.num_valid_pages(jnp.asarray(seq_lens, jnp.int32), page_size, num_pages)
    nv = nv.reshape((lead[0],) + (1,) * len(lead))
    cols = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    keys = _keys(scores, cols, nv, num_sink_pages=num_sink_pages, n_cols=n)
    if n < k:
        pad = [(0, 0)] * (len(lead)) + [(0, k - n)]
        keys = jnp.pad(keys, pad, constant_values=_INT_MIN)
        cols = jnp.pad(cols, pad, constant_values=INVALID)
    # Stable sort by descending key (ascending ~key): equal keys keep ascending column order.
    _, top_keys, order = lax.sort((~keys, keys, cols), dimension=keys.ndim - 1, num_keys=1,
                                  is_stable=True)
    top = jnp.where(top_keys[..., :k] == _INT_MIN, jnp.int32(2**31 - 1), order[..., :k])
    top = jnp.sort(top, axis=-1)
    return jnp.where(top == 2**31 - 1, INVALID, top)
