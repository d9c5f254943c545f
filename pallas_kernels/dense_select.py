"""Page selection plumbing shared by all selectors, and the dense (select-everything) baseline.

Selector output convention (every selector in this package):

* int32 within-sequence page indices, shape ``[B, H, k]`` (``[B, k]`` for the indexer, whose
  selection is shared by all KV heads);
* each row sorted **ascending**, the ``-1`` padding (``INVALID``) last;
* no duplicates, never a page ``>= ceil(seq_len / page_size)``;
* the ``num_sink_pages`` first pages and the current (last) page ``(seq_len - 1) // page_size``
  are always included (so ``k >= num_sink_pages + 1`` is required); a sequence with ``<= k``
  pages gets all of them; ``seq_len == 0`` (an inactive request) gives an all ``-1`` row.

``seq_lens[b]`` counts the tokens of request ``b`` including the current one (whose key is
already in the page summaries); it must be ``<= num_pages * page_size`` (larger values are
clamped to ``num_pages`` pages).

``dense_select`` needs no kernel: it reads no memory, it is an iota and a compare that XLA
fuses into its consumer. ``select_top_pages`` (masking, top-k, ascending sort) is the shared
second half of the scored selectors (Quest, indexer), whose Pallas kernels do the scoring.
Its ``method="pallas"`` is one Pallas kernel for all of it (``jaxkv.kernels.topk``; ties go
to the lowest page index); ``method="pallas_cmax"`` is the same kernel fed with chunk maxima
(computed here in XLA; ``quest.quest_select`` takes them from its scores kernel), which
never reads the whole row; the other methods are XLA top-k variants. ``"auto"`` is
``"pallas"`` on the GPU for rows of up to ``PALLAS_TOPK_MAX_COLUMNS`` pages and ``"chunked"``
for longer rows and off the GPU (interpret mode is slow), unless ``JAXKV_IMPL`` says
otherwise. The kernel runs one program per row, which leaves most SMs idle on long rows:
on the H200 it is faster than "chunked" up to 4k pages and slower at 16k (k = 32, 8 rows;
docs/decisions.md).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import _common, topk
from ._common import INVALID

# XLA's fast GPU top-k kernel (custom call "__gpu$TopK") handles k <= 16 on [rows, n] inputs
# with n >= 1024; a larger k falls back to sorting every row. "rounds" stays on the fast
# kernel by taking 16 at a time and masking what was taken; "chunked" shrinks the sorts.
_FAST_TOPK_MAX_K = 16
TOPK_METHODS = ("auto", "sort", "rounds", "chunked", "radix", "pallas", "pallas_cmax")
# "radix": bit widths of the key's digits, most significant first (``_topk_radix``).
RADIX_DIGITS = (11, 11, 10)
PALLAS_TOPK_MAX_COLUMNS = 4096
# Default of ``cmax_min_pages`` (``resolve_topk_method``; the engine's ``Tuning``): from this
# many pages the chunk-maxima top-k beats the full-row kernel on the H200 (docs/decisions.md).
CMAX_MIN_PAGES = 2048


def resolve_topk_method(num_pages: int, implementation, method: str,
                        cmax_min_pages: int | None = CMAX_MIN_PAGES, k: int | None = None) -> str:
    """The top-k method a scored selector runs for rows of ``num_pages`` pages: "auto" becomes
    "pallas_cmax" (its scores kernel writes chunk maxima; the top-k kernel reads only those
    and the chosen chunks) when the implementation is "pallas", ``num_pages >=
    cmax_min_pages`` (None: never) and the kernel compiles for ``k`` picks (``topk.fits``);
    otherwise ``method`` as given (``select_top_pages`` resolves the remaining "auto")."""
    if (method == "auto" and cmax_min_pages is not None
            and _common.implementation_name(implementation) == "pallas"
            and num_pages >= cmax_min_pages and (k is None or topk.fits(num_pages, k))):
        return "pallas_cmax"
    return method


def takes_topk_kernel(num_pages: int, k: int, implementation) -> bool:
    """Whether ``select_top_pages``' "auto" runs the full-row Pallas top-k kernel for rows of
    ``num_pages`` pages and ``k`` picks (else an XLA top-k)."""
    return (_common.implementation_name(implementation) == "pallas"
            and num_pages <= PALLAS_TOPK_MAX_COLUMNS and topk.fits_full_row(num_pages, k))


def num_valid_pages(seq_lens: jax.Array, page_size: int, num_pages: int) -> jax.Array:
    """Pages holding at least one token: ``min(ceil(seq_lens / page_size), num_pages)``.

    seq_lens: [B] int (negative counts as 0). Returns [B] int32.
    """
    return _common.num_valid_pages(jnp.asarray(seq_lens).astype(jnp.int32), page_size,
                                   num_pages)


@functools.partial(jax.jit, static_argnames=("num_pages", "num_kv_heads", "page_size"))
def dense_select(seq_lens: jax.Array, *, num_pages: int, num_kv_heads: int,
                 page_size: int) -> jax.Array:
    """Every valid page (the dense baseline).

    seq_lens: [B] int32 tokens per request. Returns [B, num_kv_heads, num_pages] int32:
    entry ``p`` is ``p`` if ``p < ceil(seq_lens[b] / page_size)`` else ``-1`` (so rows are
    ascending with the -1s last, the same for every head).
    """
    n_valid = num_valid_pages(seq_lens, page_size, num_pages)
    pages = lax.broadcasted_iota(jnp.int32, (n_valid.shape[0], num_kv_heads, num_pages), 2)
    return jnp.where(pages < n_valid[:, None, None], pages, INVALID)


def _topk_chunked(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact two-stage top-k of ``x`` [R, N]: top-k chunks by chunk max, then top-k of their
    entries. Every entry above the k-th largest chunk max T lies in a chosen chunk, and the
    chosen chunks hold >= k entries >= T, so the top-k values are exact (ties broken
    arbitrarily). Both stages are small (N / c and k * c entries, c ~ sqrt(N / k))."""
    r, n = x.shape
    c = _common.next_pow2(max(1, math.isqrt(max(1, n // k))))
    nc = -(-n // c)
    if c == 1 or nc <= k:
        return lax.top_k(x, k)
    xc = jnp.pad(x, ((0, 0), (0, nc * c - n)), constant_values=-jnp.inf).reshape(r, nc, c)
    _, cid = lax.top_k(xc.max(axis=-1), k)  # [R, k] distinct chunks
    cand = jnp.take_along_axis(xc, cid[:, :, None], axis=1).reshape(r, k * c)
    v, j = lax.top_k(cand, k)
    return v, jnp.take_along_axis(cid, j // c, axis=1) * c + j % c


def _radix_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of f32 ``x`` in the total order of ``lax.top_k``'s comparator (-NaN < -inf
    < ... < -0.0 < +0.0 < ... < +inf < +NaN): the bits of a negative number flipped, the sign
    bit of any other flipped."""
    s = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type(s ^ ((s >> 31) | jnp.int32(-2**31)), jnp.uint32)


def _topk_radix(x: jax.Array, k: int, digits: tuple[int, ...] = RADIX_DIGITS,
                histogram: str = "scatter") -> tuple[jax.Array, jax.Array]:
    """Exact top-k of ``x`` [R, N] f32 (1 <= k <= N) by radix select, with no sort: (values,
    indices) [R, k], the same index set as ``lax.top_k(x, k)`` for every input (ties at the
    k-th value go to the lowest columns; -0.0 ranks below +0.0 and NaN by its sign above +inf
    or below -inf, as in ``lax.top_k``'s comparator). Built for few rows of many columns on
    the GPU, where XLA's top-k for k > 16 sorts whole rows: this is a few wide elementwise,
    histogram and scan ops of static shapes.

    The values map to order-preserving uint32 keys (``_radix_keys``). One pass per digit of
    ``digits`` (bit widths, most significant first, summing to 32) counts, per row, the keys
    that share the digits found so far (the prefix) and have each value of the next digit or
    more; the k-th largest key's digit is the largest one with at least ``need`` such keys
    (``need``: how many of the keys with this prefix the top k still lacks). ``histogram``:
    "scatter" counts each digit value with one scatter-add and takes a suffix sum over the
    bins; "compare" sums ``digit >= j`` for every bin ``j`` in one fused reduction (no
    atomics; ``2**bits * N`` compares a row). After the passes the prefix is the k-th largest
    key T: the picks are the keys above T and the first ``need`` keys equal to T by column,
    placed by one cumulative count (the keys above T first, then the ties, each in column
    order, so -inf picks come last) and one scatter of their columns.
    """
    if not 1 <= k <= x.shape[1]:
        raise ValueError(f"k={k} must be in [1, {x.shape[1]}]")
    return _radix_select(x, k, k, digits, histogram)


def _radix_select(x: jax.Array, k, width: int, digits: tuple[int, ...],
                  histogram: str) -> tuple[jax.Array, jax.Array]:
    """``_topk_radix`` into ``width`` static output columns, ``k`` an int or a traced int32
    scalar (1 <= k <= width <= N): (values, indices) [R, width], the picks in the first k
    columns, column 0 in the others."""
    r, n = x.shape
    if sum(digits) != 32 or min(digits) < 1:
        raise ValueError(f"digits {digits} must be positive and sum to 32")
    if histogram not in ("scatter", "compare"):
        raise ValueError(f"unknown histogram {histogram!r}; choose 'scatter' or 'compare'")
    key = _radix_keys(x)
    rows = lax.broadcasted_iota(jnp.int32, (r, n), 0)
    prefix = jnp.zeros((r, 1), jnp.uint32)    # the k-th largest key's digits found so far
    # picks still to make among the keys with that prefix
    need = jnp.broadcast_to(jnp.asarray(k, jnp.int32), (r, 1))
    shift = 32
    for bits in digits:  # static
        nbins = 1 << bits
        match = None if shift == 32 else (key >> shift) == (prefix >> shift)
        shift -= bits
        digit = ((key >> shift) & (nbins - 1)).astype(jnp.int32)
        if histogram == "scatter":
            # non-matching keys go to an out-of-range bin, which the scatter drops
            bin_ = digit if match is None else jnp.where(match, digit, nbins)
            hist = jnp.zeros((r, nbins), jnp.int32).at[rows, bin_].add(1, mode="drop")
            ge = lax.cumsum(hist, axis=1, reverse=True)    # [R, nbins]: keys >= each digit
        else:
            j = lax.broadcasted_iota(jnp.int32, (1, nbins, 1), 1)
            hit = digit[:, None, :] >= j
            if match is not None:
                hit = hit & match[:, None, :]
            ge = jnp.sum(hit, axis=-1, dtype=jnp.int32)
        ok = ge >= need   # ge descends along the bins and ge[:, 0] >= need: ok is a prefix
        d = jnp.sum(ok, axis=1, keepdims=True, dtype=jnp.int32) - 1
        need = need - jnp.max(jnp.where(ok, 0, ge), axis=1, keepdims=True)  # minus keys > d
        prefix = prefix | (d.astype(jnp.uint32) << shift)
    gt = key > prefix
    eq = key == prefix
    # one scan counts both: keys above T in the low half-word, ties in the high one
    if n < 1 << 16:
        both = lax.cumsum(gt.astype(jnp.uint32) | (eq.astype(jnp.uint32) << 16), axis=1)
        n_gt, n_eq = (both & 0xFFFF).astype(jnp.int32), (both >> 16).astype(jnp.int32)
    else:
        both = lax.cumsum(jnp.stack([gt, eq]).astype(jnp.int32), axis=2)
        n_gt, n_eq = both[0], both[1]
    take = gt | (eq & (n_eq <= need))
    cols = lax.broadcasted_iota(jnp.int32, (r, n), 1)
    slot = jnp.where(gt, n_gt - 1, (k - need) + n_eq - 1)
    slot = jnp.where(take, slot, width + cols)  # distinct and out of range: dropped
    idx = jnp.zeros((r, width), jnp.int32).at[rows, slot].set(cols, mode="drop",
                                                              unique_indices=True)
    return jnp.take_along_axis(x, idx, axis=1, mode="promise_in_bounds"), idx


def _topk_indices(x: jax.Array, k: int, method: str) -> tuple[jax.Array, jax.Array]:
    """Top-k along the last axis of ``x`` [R, N] f32 (N >= k): (values, indices) [R, k].

    "sort": one ``lax.top_k``. "rounds": ``lax.top_k`` 16 at a time, masking taken entries to
    -inf between rounds (exact; an entry taken twice can only be -inf and becomes -1 later).
    "chunked": ``_topk_chunked``. "radix": ``_topk_radix`` (the same set as "sort", not in
    descending order). "auto": chunked (the fastest XLA method for k = 32 on the H200 at
    512-16384 columns; docs/decisions.md). Every method takes one ``lax.top_k`` for
    k <= 16 (XLA's fast GPU kernel).
    """
    if method == "auto":
        method = "chunked"
    if method not in TOPK_METHODS or method.startswith("pallas"):
        raise ValueError(f"unknown top-k method {method!r}; choose one of {TOPK_METHODS}")
    if method == "sort" or k <= _FAST_TOPK_MAX_K:
        return lax.top_k(x, k)
    if method == "chunked":
        return _topk_chunked(x, k)
    if method == "radix":
        return _topk_radix(x, k)
    vals, idxs = [], []
    cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    left = k
    while left > 0:  # static: ceil(k / 16) rounds
        kk = min(_FAST_TOPK_MAX_K, left)
        v, i = lax.top_k(x, kk)
        vals.append(v)
        idxs.append(i)
        left -= kk
        if left > 0:
            taken = jnp.any(cols[:, :, None] == i[:, None, :], axis=-1)
            x = jnp.where(taken, -jnp.inf, x)
    return jnp.concatenate(vals, axis=-1), jnp.concatenate(idxs, axis=-1)


def check_pieces(k: int, pieces: int, num_sink_pages: int) -> None:
    """Raise unless ``k`` top pages split over ``pieces`` pieces: ``pieces`` divides ``k`` and
    a piece's share holds its forced pages (the sinks it strides over and the current page)."""
    if pieces < 1 or k % pieces:
        raise ValueError(f"pieces={pieces} must divide k={k}")
    if k // pieces < -(-num_sink_pages // pieces) + 1:
        raise ValueError(f"k / pieces = {k // pieces} picks per piece cannot hold a piece's "
                         f"{-(-num_sink_pages // pieces)} sink page(s) and the current page: "
                         "use fewer pieces")


def _select_pieces(scores, seq_lens, *, num_pages, k, page_size, num_sink_pages, pieces,
                   method, implementation):
    """``select_top_pages(pieces=)``: the top ``k / pieces`` of each strided piece
    (``topk.strided_pieces``), unordered, ``-1`` where a piece runs out of pages of the sequence.
    "pallas" (or "auto" where the kernel takes a piece): ``topk.select_top_pieces_pallas``,
    one program per piece reading its pages from the row and masking them itself (a step
    faster than a masked, transposed copy of the scores before the full-row kernel and a
    select after it: docs/decisions.md). Otherwise XLA's ``lax.top_k`` over that copy."""
    B, H, n = scores.shape
    S, kp = pieces, k // pieces
    if method == "auto":
        ns = max(-(-n // S), kp)  # a piece's columns, padded to its share
        method = "pallas" if takes_topk_kernel(ns, kp, implementation) else "sort"
    if method == "pallas":
        return topk.select_top_pieces_pallas(scores, seq_lens, num_pages=num_pages, k=k,
                                             page_size=page_size, num_sink_pages=num_sink_pages,
                                             pieces=S)
    v = topk.strided_pieces(scores, seq_lens, num_pages=num_pages, page_size=page_size,
                            num_sink_pages=num_sink_pages, pieces=S, min_cols=kp)  # [B, H, S, ns]
    ns = v.shape[-1]
    if method in ("sort", "chunked", "rounds", "radix"):
        vals, local = _topk_indices(v.reshape(-1, ns), kp, method)
        vals, local = vals.reshape(B, H, S, kp), local.reshape(B, H, S, kp)
    else:
        raise ValueError(f"top-k method {method!r} does not take pieces: use 'auto', 'pallas' "
                         "or an XLA method")
    ids = local.astype(jnp.int32) * S + jnp.arange(S, dtype=jnp.int32)[:, None]
    return jnp.where((local >= 0) & (vals != -jnp.inf), ids, INVALID).reshape(B, H, k)


@functools.partial(jax.jit, static_argnames=("num_pages", "k", "page_size", "num_sink_pages",
                                             "method", "implementation", "ordered", "pieces"))
def select_top_pages(scores: jax.Array, seq_lens: jax.Array, *, num_pages: int, k: int,
                     page_size: int, num_sink_pages: int, method: str = "auto",
                     implementation: str | None = None, ordered: bool = True,
                     pieces: int = 1) -> jax.Array:
    """Top-``k`` pages per row of ``scores`` under the selector convention (module docstring).

    scores: [B, N] or [B, H, N] float, column ``p`` = page ``p``; columns ``>= num_pages``
    (padding) and pages ``>= ceil(seq_lens / page_size)`` are ignored whatever they hold
    (NaN included). seq_lens: [B] int32. Returns int32 [B, k] or [B, H, k].
    method: "pallas" (one kernel, ``topk.select_top_pages_pallas``), "pallas_cmax" (chunk
    maxima in XLA, ``topk.chunk_max``, then the kernel's chunk-maxima path; Quest's
    ``quest_select`` gets them from its scores kernel instead), "sort", "rounds", "chunked",
    "radix" (XLA top-k; see ``_topk_indices``) or "auto" (module docstring). With
    ``pieces > 1``, "pallas" is ``topk.select_top_pieces_pallas``.
    implementation: "pallas" | "xla" | None: whether "auto" may use the kernel.
    ordered: False lets the XLA methods skip the ascending sort: the same pages, in the
    top-k's order with the ``-1`` padding last (a candidate list that is re-ranked anyway).
    pieces: > 1 takes a candidate set instead of the row's top k: the top ``k / pieces`` of
    each of ``pieces`` strided pieces of a row (page ``p`` in piece ``p % pieces``), one
    kernel program per piece instead of per row; ``ordered=False`` only, ``-1`` anywhere in a
    row; ``scores`` [B, H, N]. The forced pages stay in and a sequence of at most ``k`` pages
    still gets all of them; otherwise it differs from the row's top k where a piece holds more
    than its share of it (the two-stage selectors' first stage, whose second stage re-ranks:
    ``CacheConfig.candidate_pieces``).
    """
    if k < num_sink_pages + 1:
        raise ValueError(f"k={k} must be >= num_sink_pages + 1 = {num_sink_pages + 1}")
    if method not in TOPK_METHODS:
        raise ValueError(f"unknown top-k method {method!r}; choose one of {TOPK_METHODS}")
    if pieces != 1:
        check_pieces(k, pieces, num_sink_pages)
        if ordered or scores.ndim != 3:
            raise ValueError("pieces > 1 gives an unordered candidate set of [B, H, N] scores: "
                             "pass ordered=False and per-head scores")
        return _select_pieces(scores, seq_lens, num_pages=num_pages, k=k, page_size=page_size,
                              num_sink_pages=num_sink_pages, pieces=pieces, method=method,
                              implementation=implementation)
    if method == "auto" and takes_topk_kernel(scores.shape[-1], k, implementation):
        method = "pallas"
    if method == "pallas":
        return topk.select_top_pages_pallas(scores, seq_lens, num_pages=num_pages, k=k,
                                            page_size=page_size, num_sink_pages=num_sink_pages)
    if method == "pallas_cmax":
        chunk = topk.default_cmax_chunk(scores.shape[-1], k)
        cmax = topk.chunk_max(scores, seq_lens, num_pages=num_pages, page_size=page_size,
                              chunk=chunk)
        return topk.select_top_pages_pallas(scores, seq_lens, num_pages=num_pages, k=k,
                                            page_size=page_size, num_sink_pages=num_sink_pages,
                                            chunk=chunk, chunk_max=cmax)
    lead = scores.shape[:-1]
    n = scores.shape[-1]
    bshape = (lead[0],) + (1,) * (len(lead) - 1) + (1,)
    seq_lens = jnp.asarray(seq_lens).astype(jnp.int32)
    n_valid = num_valid_pages(seq_lens, page_size, num_pages).reshape(bshape)
    pages = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    valid = pages < n_valid
    forced = valid & ((pages < num_sink_pages) | (pages == n_valid - 1))
    x = jnp.where(forced, jnp.inf, jnp.where(valid, scores.astype(jnp.float32), -jnp.inf))
    if n < k:  # top_k needs k <= N: pad with never-selected columns
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - n)], constant_values=-jnp.inf)
    rows = x.reshape(-1, x.shape[-1])
    vals, idx = _topk_indices(rows, k, method)
    big = jnp.int32(2**31 - 1)
    if not ordered:  # the -inf picks (-1) come last: top_k's values descend, and radix
        # places its ties with the k-th value (-inf if any pick is) after the rest
        return jnp.where(vals == -jnp.inf, INVALID, idx.astype(jnp.int32)).reshape(lead + (k,))
    key = jnp.where(vals == -jnp.inf, big, idx.astype(jnp.int32))
    key = jnp.sort(key, axis=-1)
    return jnp.where(key == big, INVALID, key).reshape(lead + (k,))
