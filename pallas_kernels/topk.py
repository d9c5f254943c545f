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
Register use: the row's keys stay live (``N / (32 * num_warps)`` int32 per thread, 32 at
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

from pallas_kernels import _common

OP = "select_top_pages"
INVALID = -1
_INT_MIN = -(2**31)


def _n_valid(seq_len, page_size: int, num_pages: int):
    """Pages holding a token: ``min(ceil(max(seq_len, 0) / page_size), num_pages)``."""
    seq_len = jnp.maximum(seq_len, 0)
    return jnp.minimum((seq_len + page_size - 1) // page_size, num_pages)


def _keys(x, cols, n_valid, *, num_sink_pages: int, n_cols: int):
    """Order-preserving int32 keys of the masked values (selection rule in the module doc).

    x: float scores (any shape), cols: int32 column indices (same shape), n_valid: int32
    scalar or broadcastable. Forced -> key(+inf); invalid / padding -> INT32_MIN."""
    x = x.astype(jnp.float32)
    valid = (cols < n_valid) & (cols < n_cols)
    forced = valid & ((cols < num_sink_pages) | (cols == n_valid - 1))
    x = jnp.where(x == x, x, -jnp.inf)   # NaN -> -inf
    x = jnp.where(x == 0, 0.0, x)        # -0.0 -> +0.0
    x = jnp.where(forced, jnp.inf, x)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ (lax.shift_right_arithmetic(bits, jnp.int32(31)) & jnp.int32(0x7FFFFFFF))
    return jnp.where(valid, key, jnp.int32(_INT_MIN))


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


def _topk_kernel(lens_ref, scores_ref, out_ref, *, heads, n_cols, num_pages, k, page_size,
                 num_sink_pages, chunk, n_pad, radix_bits):
    row = pl.program_id(0)
    n_valid = _n_valid(lens_ref[row // heads], page_size, num_pages)
    n_load = jnp.minimum(n_valid, n_cols)  # columns worth reading (the rest is never read)
    kp = _common.next_pow2(k)
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
        cmax = jnp.max(keys, axis=1)  # [nc], nc >= 2 * kp >= k
        m = _kth_largest(cmax, k, radix_bits)
        _, crank = _take_first(cmax, m, k)  # inclusive count of chosen chunks
        j = lax.broadcasted_iota(jnp.int32, (kp, nc), 0)
        cid = jnp.sum((crank[None, :] <= j).astype(jnp.int32), axis=1)  # [kp]; nc = none
        # Stage 2: exact k-th largest of those k * chunk entries (re-read by index).
        ccols = cid[:, None] * chunk + lax.broadcasted_iota(jnp.int32, (kp, chunk), 1)
        ok = (cid < nc)[:, None] & (ccols < n_load)
        cx = plgpu.load(scores_ref.at[row, ccols], mask=ok, other=-jnp.inf)
        ckeys = jnp.where(ok, _keys(cx, ccols, n_valid, **key_kw), jnp.int32(_INT_MIN))
        t = _kth_largest(ckeys, k, radix_bits)
    sel, rank = _take_first(keys, t, k)
    n_sel = _total(sel.astype(jnp.int32))
    j = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    plgpu.store(out_ref.at[row, j], jnp.full((kp,), INVALID, jnp.int32),
                mask=(j >= n_sel) & (j < k))
    # Unselected entries aim past the row (dropped in interpret mode, masked on the GPU).
    plgpu.store(out_ref.at[row, jnp.where(sel, rank - 1, k)], cols, mask=sel)


def _default_chunk(n_pad: int, k: int) -> int:
    """Largest power of two <= sqrt(n_pad / next_pow2(k)) (1 = single stage)."""
    c = math.isqrt(max(1, n_pad // _common.next_pow2(k)))
    return 1 << (c.bit_length() - 1)


def _default_warps(n_pad: int) -> int:
    return 4 if n_pad <= 1024 else 8 if n_pad <= 4096 else 16


@_common.register(OP, "pallas")
def select_top_pages_pallas(scores, seq_lens, *, num_pages: int, k: int, page_size: int,
                            num_sink_pages: int, chunk: int | None = None, radix_bits: int = 4,
                            num_warps: int | None = None, interpret: bool | None = None):
    """Top-``k`` pages per row with one Pallas kernel (selection rule: module docstring).

    scores: [B, N] or [B, H, N] float (any float dtype; column ``p`` = page ``p``, columns
    ``>= num_pages`` and pages past the sequence are never read). seq_lens: [B] int.
    Returns int32 [B, k] or [B, H, k]. Tuning (static): ``chunk`` (power of two; 1 = single
    stage; default ~sqrt(N / k)), ``radix_bits`` (1, 2 or 4), ``num_warps`` (default 4 / 8 / 16
    for N <= 1024 / <= 4096 / larger).
    """
    if k < num_sink_pages + 1:
        raise ValueError(f"k={k} must be >= num_sink_pages + 1 = {num_sink_pages + 1}")
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = math.prod(lead)
    n_pad = _common.next_pow2(max(n, 1))
    if chunk is None:
        chunk = _default_chunk(n_pad, k)
    if chunk & (chunk - 1) or chunk < 1 or (chunk > 1 and n_pad // chunk < 2 * k):
        raise ValueError(f"chunk={chunk} must be a power of two with N_pad / chunk >= 2k")
    kernel = functools.partial(
        _topk_kernel, heads=rows // lead[0], n_cols=n, num_pages=num_pages, k=k,
        page_size=page_size, num_sink_pages=num_sink_pages, chunk=chunk, n_pad=n_pad,
        radix_bits=radix_bits)
    flat = scores.reshape(rows, n)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, k), jnp.int32),
        grid=(rows,),
        in_specs=[pl.BlockSpec((lead[0],), lambda i: (0,)),
                  pl.BlockSpec((rows, n), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, k), lambda i: (0, 0)),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or _default_warps(n_pad), num_stages=1),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="select_top_pages",
    )(jnp.asarray(seq_lens, jnp.int32).reshape(lead[0]), flat)
    return out.reshape(lead + (k,))


@_common.register(OP, "xla")
def select_top_pages_reference(scores, seq_lens, *, num_pages: int, k: int, page_size: int,
                               num_sink_pages: int):
    """Pure-jnp reference of the selection rule (stable sort; slow for long rows).

    Shapes and result as ``select_top_pages_pallas``."""
    if k < num_sink_pages + 1:
        raise ValueError(f"k={k} must be >= num_sink_pages + 1 = {num_sink_pages + 1}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    nv = _n_valid(jnp.asarray(seq_lens, jnp.int32), page_size, num_pages)
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
