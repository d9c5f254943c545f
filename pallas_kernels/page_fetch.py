"""Host -> device page fetch: copy listed rows of the host tier into device pool rows.

``fetch_pages(host_kv, pool, src_rows, dst_rows)`` moves row ``src_rows[m]`` of ``host_kv``
into row ``dst_rows[m]`` of ``pool`` for every entry, in one kernel launch.

The Pallas kernel (Triton backend) reads ``host_kv`` zero-copy: the pinned_host array is a
plain operand with a full-shape BlockSpec, so the compiled HLO hands the host buffer to the
kernel and each program loads its rows over PCIe. The pool is updated in place
(``input_output_aliases``); callers donate it (inside ``jit``: ``donate_argnums``; an eager
call donates it automatically, so use the returned array).

Work decomposition (all static, see :class:`FetchTuning`): a row of ``R`` elements is cut
into chunks of ``B`` elements (a power of two dividing ``R``: Triton blocks must be powers
of two, ``R`` need not be). Program ``(i, j)`` owns entries ``[i*E, (i+1)*E)`` and chunk
columns ``[j*K, (j+1)*K)``; for each of its ``K`` columns it issues the ``E`` loads first
and then the ``E`` stores, so ``E*B`` elements are in flight per program. ``E=1, B=R, K=1``
is the naive one-page-per-program kernel. Entries with a ``-1`` (or out-of-range) source or
destination are masked: no memory traffic.

Contract: valid destination rows must be distinct (otherwise which source wins is
unspecified); source rows may repeat.

The ``"xla"`` reference is pure jnp: a ``fori_loop`` of ``dynamic_slice`` +
``jax.device_put(..., Space.Device)`` per entry when the source is in host memory (the
only XLA form that reads a pinned_host array without copying all of it; slow on GPU, a
correctness fallback), a vectorized gather/scatter when it is a device array. ``"compact"``
(the CPU default) is the same copies over the valid entries only, moved to the front first:
a decode step lists every layer's selections and most of them need no copy.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from . import kv_quant

OP = "fetch_pages"

# Defaults of the tunables. The benchmark (benchmarks/bench_fetch.py) sweeps variants on
# the H200 and prints the best per target point: update these constants from its output.
DEFAULT_CHUNK_BYTES = 16 * 1024      # bytes per entry per load
DEFAULT_MIN_CHUNK_BYTES = 4 * 1024   # smallest default chunk (small launches split rows)
DEFAULT_PROGRAM_BYTES = 16 * 1024    # aim for this many bytes in flight per program ...
DEFAULT_MIN_PROGRAMS = 264           # ... but keep at least this many programs (2 x 132 SMs)
DEFAULT_MAX_ENTRIES = 8
_MAX_PROGRAM_BYTES = 64 * 1024       # default register budget: E * B * itemsize per program
MAX_CHUNK_BYTES = 128 * 1024         # hard caps (registers): B * itemsize ...
MAX_PROGRAM_BYTES = 128 * 1024       # ... and E * B * itemsize


@dataclasses.dataclass(frozen=True)
class FetchTuning:
    """Static work decomposition of the copy kernel (resolved for one row length).

    pages_per_program: E, entries per program (power of two).
    chunk_elems: B, elements per entry per load (power of two dividing the row length).
    chunks_per_program: K, chunk columns a program walks sequentially (divides R // B).
    num_warps: Triton warps per program.
    num_stages: Triton pipelining stages (None: the backend's default).
    """

    pages_per_program: int
    chunk_elems: int
    chunks_per_program: int
    num_warps: int
    num_stages: int | None = None


def resolve_tuning(num_entries: int, row_elems: int, itemsize: int, *,
                   pages_per_program: int | None = None,
                   chunk_elems: int | None = None,
                   chunks_per_program: int | None = None,
                   num_warps: int | None = None,
                   num_stages: int | None = None) -> FetchTuning:
    """Fill unset tunables with defaults and snap set ones to legal values.

    ``chunk_elems`` is rounded down to a power of two dividing ``row_elems`` (``0`` = the
    largest such, i.e. the whole row when it is a power of two) and capped at
    ``MAX_CHUNK_BYTES``; ``chunks_per_program`` to a divisor of the chunk count (``0`` = all
    chunks of the row, one program per row); ``pages_per_program`` to a power of two with
    ``E * B * itemsize <= MAX_PROGRAM_BYTES``. ``naive_tuning`` gives the baseline layout.
    """
    R, M = int(row_elems), max(int(num_entries), 1)
    if chunk_elems is None:
        # Default: DEFAULT_CHUNK_BYTES, halved (down to DEFAULT_MIN_CHUNK_BYTES) while the
        # launch would have fewer than DEFAULT_MIN_PROGRAMS programs (spread over the SMs).
        B = _common.largest_pow2_divisor(R, max(1, DEFAULT_CHUNK_BYTES // itemsize))
        while (M * (R // B) < DEFAULT_MIN_PROGRAMS and B % 2 == 0
               and B * itemsize > DEFAULT_MIN_CHUNK_BYTES):
            B //= 2
    else:
        B = _common.largest_pow2_divisor(R, chunk_elems if chunk_elems > 0 else R)
    B = min(B, max(1, MAX_CHUNK_BYTES // itemsize))  # both powers of two
    n_chunks = R // B
    if chunks_per_program is None:
        chunks_per_program = 1
    K = n_chunks if chunks_per_program <= 0 else max(
        k for k in range(1, min(int(chunks_per_program), n_chunks) + 1) if n_chunks % k == 0)
    if pages_per_program is None:
        load_bytes = B * itemsize
        e = max(1, DEFAULT_PROGRAM_BYTES // load_bytes)
        e = min(e, DEFAULT_MAX_ENTRIES, max(1, (M * (n_chunks // K)) // DEFAULT_MIN_PROGRAMS))
        e = min(e, max(1, _MAX_PROGRAM_BYTES // load_bytes))
        pages_per_program = e
    E = 1 << (max(1, int(pages_per_program)).bit_length() - 1)
    E = min(E, _common.next_pow2(M), max(1, MAX_PROGRAM_BYTES // (B * itemsize)))
    if num_warps is None:
        num_warps = 8 if E * B * itemsize >= 16 * 1024 else 4
    return FetchTuning(E, B, K, int(num_warps), num_stages)


def naive_tuning() -> dict:
    """Tunables of the naive baseline: one row per program, as few loads as possible
    (loads of up to ``MAX_CHUNK_BYTES``), 4 warps."""
    return dict(pages_per_program=1, chunk_elems=0, chunks_per_program=0, num_warps=4)


def _pad_entries(src_rows, dst_rows, E):
    """Pad both row lists with -1 to a multiple of E entries; returns (src, dst, programs)."""
    M = src_rows.shape[0]
    n_eb = max(1, -(-M // E))
    pad = n_eb * E - M
    src_rows = jnp.asarray(src_rows, jnp.int32)
    dst_rows = jnp.asarray(dst_rows, jnp.int32)
    if pad:
        src_rows = jnp.pad(src_rows, (0, pad), constant_values=-1)
        dst_rows = jnp.pad(dst_rows, (0, pad), constant_values=-1)
    return src_rows, dst_rows, n_eb


def _copy_program(src_rows_ref, dst_rows_ref, src_ref, dst_ref, Ns, Nd, tuning: FetchTuning):
    """Body of program (i, j): its E entries x its K chunk columns, loads before stores."""
    E, B, K = tuning.pages_per_program, tuning.chunk_elems, tuning.chunks_per_program
    i = pl.program_id(0)
    j = pl.program_id(1)
    entries = []
    for e in range(E):
        s = src_rows_ref[i * E + e]
        d = dst_rows_ref[i * E + e]
        ok = (s >= 0) & (s < Ns) & (d >= 0) & (d < Nd)
        entries.append((jnp.where(ok, s, 0), jnp.where(ok, d, 0), jnp.full((B,), ok)))

    def column(k):
        col = (j * K + k) * B
        vals = [plgpu.load(src_ref.at[s, pl.ds(col, B)], mask=m) for s, _, m in entries]
        for (_, d, m), v in zip(entries, vals):
            plgpu.store(dst_ref.at[d, pl.ds(col, B)], v, mask=m)

    if K == 1:
        column(0)
    else:
        def body(k, carry):
            column(k)
            return carry
        jax.lax.fori_loop(0, K, body, 0)


def _launch(kernel, operands, out, n_eb, tuning: FetchTuning, alias: int, name: str):
    R = out.shape[1]
    n_cb = R // (tuning.chunk_elems * tuning.chunks_per_program)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid=(n_eb, n_cb),
        in_specs=[full(x.shape) for x in operands],
        out_specs=full(out.shape),
        input_output_aliases={alias: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        interpret=_common.interpret_mode(),
        name=name,
    )(*operands)


def _copy_rows_pallas(src, dst, src_rows, dst_rows, tuning: FetchTuning):
    """dst[dst_rows[m]] = src[src_rows[m]] in one Pallas launch; dst aliased to the output.

    src [Ns, R], dst [Nd, R] same dtype; src_rows, dst_rows [M] int32.
    """
    Ns, Nd = src.shape[0], dst.shape[0]
    src_rows, dst_rows, n_eb = _pad_entries(src_rows, dst_rows, tuning.pages_per_program)

    def kernel(src_rows_ref, dst_rows_ref, src_ref, dst_in_ref, dst_ref):
        del dst_in_ref  # aliased with dst_ref
        _copy_program(src_rows_ref, dst_rows_ref, src_ref, dst_ref, Ns, Nd, tuning)

    return _launch(kernel, (src_rows, dst_rows, src, dst), dst, n_eb, tuning, 3, "copy_rows")


def copy_rows_pallas(src, dst, src_rows, dst_rows, **tuning):
    """Pallas row copy for any pair of arrays (shared by fetch_pages and write_pages).

    src [Ns, R], dst [Nd, R] (same dtype; either may be pinned_host); src_rows,
    dst_rows [M] int32 (-1 = skip). Returns dst with the rows written (aliased).
    """
    _check(src, dst, src_rows, dst_rows)
    if src_rows.shape[0] == 0:  # no entry: nothing to copy (a grid of 0 programs cannot lower)
        return dst
    t = resolve_tuning(src_rows.shape[0], src.shape[1], jnp.dtype(src.dtype).itemsize, **tuning)
    return _copy_rows_pallas(src, dst, src_rows, dst_rows, t)


def _is_host(x) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def copy_rows_reference(src, dst, src_rows, dst_rows):
    """Pure-jnp row copy: dst[dst_rows[m]] = src[src_rows[m]] for valid entries.

    Works when src and/or dst live in host memory (per-entry loop with device_put);
    vectorized gather/scatter when both are device arrays.
    """
    _check(src, dst, src_rows, dst_rows)
    if src_rows.shape[0] == 0:  # no entry (the loop body below cannot index an empty list)
        return dst
    Ns, Nd = src.shape[0], dst.shape[0]
    src_rows = jnp.asarray(src_rows, jnp.int32)
    dst_rows = jnp.asarray(dst_rows, jnp.int32)
    ok = (src_rows >= 0) & (src_rows < Ns) & (dst_rows >= 0) & (dst_rows < Nd)
    s = jnp.where(ok, src_rows, 0)
    src_host, dst_host = _is_host(src), _is_host(dst)
    dtype = dst.dtype
    if kv_quant.bytes_movable(src) and kv_quant.bytes_movable(dst):   # fp8: move bytes
        src, dst = kv_quant.bits(src), kv_quant.bits(dst)
    if not (src_host or dst_host):
        return kv_quant.from_bits(dst.at[jnp.where(ok, dst_rows, Nd)].set(src[s], mode="drop"),
                                  dtype)

    def body(m, dst):
        d = jnp.where(ok[m], dst_rows[m], 0)
        row = jax.lax.dynamic_slice_in_dim(src, s[m], 1, 0)
        old = jax.lax.dynamic_slice_in_dim(dst, d, 1, 0)
        if src_host:
            row = jax.device_put(row, jax.memory.Space.Device)
        if dst_host:
            old = jax.device_put(old, jax.memory.Space.Device)
        new = jnp.where(ok[m], row, old)
        if dst_host:
            new = jax.device_put(new, jax.memory.Space.Host)
        return jax.lax.dynamic_update_slice_in_dim(dst, new, d, 0)

    return kv_quant.from_bits(jax.lax.fori_loop(0, src_rows.shape[0], body, dst), dtype)


def _check(src, dst, src_rows, dst_rows):
    if src.ndim != 2 or dst.ndim != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(f"rows must match: src {src.shape}, dst {dst.shape}")
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: src {src.dtype}, dst {dst.dtype}")
    if src_rows.shape != dst_rows.shape or src_rows.ndim != 1:
        raise ValueError(f"src_rows {src_rows.shape} and dst_rows {dst_rows.shape} must be [M]")


@_common.register(OP, "pallas")
def fetch_pages_pallas(host_kv, pool, src_rows, dst_rows, **tuning):
    """Pallas implementation of :func:`fetch_pages`."""
    return copy_rows_pallas(host_kv, pool, src_rows, dst_rows, **tuning)


@_common.register(OP, "xla")
def fetch_pages_reference(host_kv, pool, src_rows, dst_rows, **tuning):
    """Pure-jnp reference of :func:`fetch_pages` (tunables are accepted and ignored)."""
    del tuning
    return copy_rows_reference(host_kv, pool, src_rows, dst_rows)


@_common.register(OP, "compact")
def fetch_pages_compact(host_kv, pool, src_rows, dst_rows, **tuning):
    """The reference's copies with a loop over the valid entries only (a stable sort moves them
    to the front; the loop's trip count is their number). A device ``host_kv`` takes the
    reference's vectorized form."""
    del tuning
    if not _is_host(host_kv):
        return copy_rows_reference(host_kv, pool, src_rows, dst_rows)
    _check(host_kv, pool, src_rows, dst_rows)
    if src_rows.shape[0] == 0:  # no entry (the loop body below cannot index an empty list)
        return pool
    Ns, Nd = host_kv.shape[0], pool.shape[0]
    src_rows = jnp.asarray(src_rows, jnp.int32)
    dst_rows = jnp.asarray(dst_rows, jnp.int32)
    ok = (src_rows >= 0) & (src_rows < Ns) & (dst_rows >= 0) & (dst_rows < Nd)
    order = jnp.argsort(~ok, stable=True)
    src_c, dst_c = src_rows[order], dst_rows[order]

    def body(m, pool):
        row = jax.lax.dynamic_slice_in_dim(host_kv, src_c[m], 1, 0)
        row = jax.device_put(row, jax.memory.Space.Device)
        return jax.lax.dynamic_update_slice_in_dim(pool, row, dst_c[m], 0)

    return jax.lax.fori_loop(0, jnp.sum(ok), body, pool)


_common.prefer_on_cpu(OP, "compact")


def is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


@functools.lru_cache(maxsize=64)
def _eager_jit(fn, donate: int, out_sharding, host_typed: bool, tuning_items):
    def run(*args):
        out = fn(*args, **dict(tuning_items))
        # A pallas_call output is typed as device memory; give it back the input's type.
        return jax.device_put(out, jax.memory.Space.Host) if host_typed else out
    return jax.jit(run, donate_argnums=(donate,), out_shardings=out_sharding)


def call_in_place(fn, args, donate: int, **tuning):
    """Run ``fn(*args, **tuning)``; outside a trace, jit it donating ``args[donate]`` and
    keeping the output's sharding/memory kind (pinned_host outputs need out_shardings) and
    its type's memory space (``jax.typeof(x).memory_space``)."""
    target = args[donate]
    if any(is_traced(a) for a in args) or not isinstance(target, jax.Array):
        return fn(*args, **tuning)
    f = _eager_jit(fn, donate, target.sharding, _is_host(target),
                   tuple(sorted(tuning.items())))
    return f(*args)


def fetch_pages(host_kv, pool, src_rows, dst_rows, *, implementation=None, **tuning):
    """Copy host rows into device pool rows: ``pool[dst_rows[m]] = host_kv[src_rows[m]]``.

    Args:
      host_kv: [N_host, R] (pinned_host in practice; any memory kind works), any dtype.
      pool: [N_pool, R] device array, same dtype; donated, updated in place.
      src_rows: [M] int32 global host rows; ``-1`` (or out of range) = move nothing.
      dst_rows: [M] int32 global pool rows; ``-1`` = move nothing. Valid ones distinct.
      implementation: "pallas" | "xla" | None (see ``_common.resolve``).
      **tuning: keyword-only tunables of the Pallas kernel (see :func:`resolve_tuning`):
        ``pages_per_program``, ``chunk_elems``, ``chunks_per_program``, ``num_warps``,
        ``num_stages``. Ignored by the reference.
    Returns:
      pool [N_pool, R] with the listed rows replaced.
    """
    fn = _common.resolve(OP, implementation)
    return call_in_place(fn, (host_kv, pool, src_rows, dst_rows), 1, **tuning)


# ----------------------------------------------------------------------------------------
# move_rows: copy rows within ONE array (device pool: scratch rows -> LRU slots), in place
# ----------------------------------------------------------------------------------------
OP_MOVE = "move_rows"


def _move_rows_pallas(arr, src_rows, dst_rows, tuning: FetchTuning):
    """arr[dst_rows[m]] = arr[src_rows[m]] in one launch, ``arr`` aliased to the output.

    Valid source rows and destination rows must be disjoint sets (no entry reads a row that
    another entry writes), which makes the in-place copy race-free.
    """
    N = arr.shape[0]
    src_rows, dst_rows, n_eb = _pad_entries(src_rows, dst_rows, tuning.pages_per_program)

    def kernel(src_rows_ref, dst_rows_ref, arr_in_ref, arr_ref):
        del arr_in_ref  # aliased with arr_ref
        _copy_program(src_rows_ref, dst_rows_ref, arr_ref, arr_ref, N, N, tuning)

    return _launch(kernel, (src_rows, dst_rows, arr), arr, n_eb, tuning, 2, "move_rows")


@_common.register(OP_MOVE, "pallas")
def move_rows_pallas(arr, src_rows, dst_rows, **tuning):
    """Pallas implementation of :func:`move_rows`."""
    _check(arr, arr, src_rows, dst_rows)
    t = resolve_tuning(src_rows.shape[0], arr.shape[1], jnp.dtype(arr.dtype).itemsize, **tuning)
    return _move_rows_pallas(arr, src_rows, dst_rows, t)


@_common.register(OP_MOVE, "xla")
def move_rows_reference(arr, src_rows, dst_rows, **tuning):
    """Pure-jnp reference of :func:`move_rows` (device arrays)."""
    del tuning
    N = arr.shape[0]
    ok = (src_rows >= 0) & (src_rows < N) & (dst_rows >= 0) & (dst_rows < N)
    b = kv_quant.bits(arr)                              # fp8: the scatter moves bytes
    return kv_quant.from_bits(b.at[jnp.where(ok, dst_rows, N)].set(b[jnp.where(ok, src_rows, 0)],
                                                                   mode="drop"), arr.dtype)


def move_rows(arr, src_rows, dst_rows, *, implementation=None, **tuning):
    """Copy rows within one device array in place: ``arr[dst_rows[m]] = arr[src_rows[m]]``.

    arr [N, R] (donated); src_rows, dst_rows [M] int32, -1 = skip. Valid sources and valid
    destinations must be disjoint, and valid destinations distinct. One launch.
    """
    fn = _common.resolve(OP_MOVE, implementation)
    return call_in_place(fn, (arr, src_rows, dst_rows), 0, **tuning)


# ----------------------------------------------------------------------------------------
# fetch_layer_pages: per-layer fetch lists, work proportional to the entries actually listed
# ----------------------------------------------------------------------------------------
OP_LAYERS = "fetch_layer_pages"
_LAYER_MIN_PROGRAMS = 256  # default programs-per-layer G: L * G * chunk columns >= this


def _layer_global(src, dst, l, src_stride, dst_stride):
    """Per-layer page / slot ids -> (ok, global host row, global pool row)."""
    ok = (src >= 0) & (src < src_stride) & (dst >= 0) & (dst < dst_stride)
    return ok, jnp.where(ok, l * src_stride + src, 0), jnp.where(ok, l * dst_stride + dst, 0)


def _fetch_layers_kernel(src_ref, dst_ref, host_ref, pool_in_ref, pool_ref, *, R, chunk, n_main,
                         tail, programs_per_layer, src_stride, dst_stride):
    """Program (l, g, j): chunk column j < n_main of layer l's entries g, g + G, ...; column
    j == n_main (when ``tail``, static (offset, size) pieces past the last whole chunk)
    copies those pieces."""
    del pool_in_ref  # aliased with pool_ref
    l, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G = programs_per_layer
    i_r = jax.lax.broadcasted_iota(jnp.int32, (_common.next_pow2(R),), 0)
    d_all = plgpu.load(dst_ref.at[l, i_r], mask=i_r < R, other=-1)
    n = jnp.max(jnp.where(d_all >= 0, i_r + 1, 0))  # one past the last listed entry
    trips = jnp.maximum(n - g + G - 1, 0) // G

    def copy(pieces):
        def body(t, carry):
            m = g + t * G
            ok, s, d = _layer_global(src_ref[l, m], dst_ref[l, m], l, src_stride, dst_stride)
            for start, size in pieces:
                mask = jnp.full((size,), ok)
                cols = pl.ds(start, size)
                plgpu.store(pool_ref.at[d, cols], plgpu.load(host_ref.at[s, cols], mask=mask),
                            mask=mask)
            return carry

        jax.lax.fori_loop(0, trips, body, 0)

    if not tail:
        copy([(j * chunk, chunk)])
        return

    @pl.when(j < n_main)
    def _():
        copy([(j * chunk, chunk)])

    @pl.when(j == n_main)
    def _():
        copy(tail)


def row_chunks(row: int, cap: int, min_elems: int) -> tuple[int, int, tuple]:
    """How a row of ``row`` elements is copied in loads of at most ``cap`` elements (powers of
    two): (chunk B, whole chunks n, tail pieces ((offset, size), ...)). B is the largest power
    of two dividing the row when that is at least ``min_elems`` (no tail); otherwise (a row
    such as a quantized page row, payload + scales, whose largest power-of-two divisor is small)
    the largest power of two <= min(row, cap), with the rest of the row in power-of-two
    pieces (its binary digits)."""
    B = _common.largest_pow2_divisor(row, cap)
    if B >= min(min_elems, cap) or B == row:
        return B, row // B, ()
    B = 1 << (min(row, cap).bit_length() - 1)
    n, rest, off, tail = row // B, row % B, (row // B) * B, []
    for bit in reversed(range(rest.bit_length())):
        if rest >> bit & 1:
            tail.append((off, 1 << bit))
            off += 1 << bit
    return B, n, tuple(tail)


def _check_layers(host_kv, pool, fetch_src, fetch_dst, src_stride, dst_stride):
    if fetch_src.shape != fetch_dst.shape or fetch_src.ndim != 2:
        raise ValueError(f"fetch_src {fetch_src.shape} and fetch_dst {fetch_dst.shape} must "
                         "both be [L, R]")
    _check(host_kv, pool, fetch_src.reshape(-1), fetch_dst.reshape(-1))
    L = fetch_src.shape[0]
    if L * src_stride > host_kv.shape[0] or L * dst_stride > pool.shape[0]:
        raise ValueError(f"{L} layers x strides ({src_stride}, {dst_stride}) exceed the rows of "
                         f"host_kv {host_kv.shape} / pool {pool.shape}")


@_common.register(OP_LAYERS, "pallas")
def fetch_layer_pages_pallas(host_kv, pool, fetch_src, fetch_dst, *, src_stride: int,
                             dst_stride: int, chunk_elems: int | None = None,
                             programs_per_layer: int | None = None, num_warps: int = 4):
    """Pallas implementation of :func:`fetch_layer_pages`. Grid ``(L, G, R_row / B)``:
    program ``(l, g, j)`` copies chunk ``j`` (``B`` elements) of layer ``l``'s entries
    ``g, g + G, ...`` below one past the layer's last listed entry (a loop whose trip count
    it reads from the list), so an empty list costs one small launch. A row whose length has
    only a small power-of-two divisor (quantized rows: payload + scales) is copied in large chunks
    plus one more column for the rest (:func:`row_chunks`)."""
    _check_layers(host_kv, pool, fetch_src, fetch_dst, src_stride, dst_stride)
    L, R = fetch_src.shape
    row, itemsize = host_kv.shape[1], jnp.dtype(host_kv.dtype).itemsize
    B, n_main, tail = row_chunks(
        row, min(chunk_elems or DEFAULT_CHUNK_BYTES // itemsize, MAX_CHUNK_BYTES // itemsize),
        DEFAULT_MIN_CHUNK_BYTES // itemsize)
    n_cb = n_main + (1 if tail else 0)
    if programs_per_layer is None:
        programs_per_layer = min(_common.next_pow2(max(1, -(-_LAYER_MIN_PROGRAMS // (L * n_cb)))),
                                 _common.next_pow2(R))
    kernel = functools.partial(_fetch_layers_kernel, R=R, chunk=B, n_main=n_main, tail=tail,
                               programs_per_layer=programs_per_layer,
                               src_stride=src_stride, dst_stride=dst_stride)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    operands = (fetch_src.astype(jnp.int32), fetch_dst.astype(jnp.int32), host_kv, pool)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(L, programs_per_layer, n_cb),
        in_specs=[full(x.shape) for x in operands],
        out_specs=full(pool.shape),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode(),
        name="fetch_layer_pages",
    )(*operands)


@_common.register(OP_LAYERS, "xla")
def fetch_layer_pages_reference(host_kv, pool, fetch_src, fetch_dst, *, src_stride: int,
                                dst_stride: int, **tuning):
    """Pure-jnp reference of :func:`fetch_layer_pages` (tunables are ignored)."""
    del tuning
    _check_layers(host_kv, pool, fetch_src, fetch_dst, src_stride, dst_stride)
    lcol = jnp.arange(fetch_src.shape[0], dtype=jnp.int32)[:, None]
    ok, s, d = _layer_global(fetch_src, fetch_dst, lcol, src_stride, dst_stride)
    return copy_rows_reference(host_kv, pool, jnp.where(ok, s, -1).reshape(-1),
                               jnp.where(ok, d, -1).reshape(-1))


def fetch_layer_pages(host_kv, pool, fetch_src, fetch_dst, *, src_stride: int,
                      dst_stride: int, implementation=None, **tuning):
    """Per-layer fetch: ``pool[l * dst_stride + fetch_dst[l, m]] =
    host_kv[l * src_stride + fetch_src[l, m]]`` for every listed entry, in one launch.

    For lists that are mostly empty (an LRU ensure's fetch entries: a decode step misses a
    few pages of the ``R`` it requests): the Pallas kernel's work is proportional to the
    entries up to each layer's last listed one, so list them first (``jaxkv.lru.ensure``
    does: its entries are compacted at the front of each row). A zero-miss step costs one
    launch of ``L * G * (row / chunk)`` programs that read their layer's list and exit.

    Args:
      host_kv: [N_host, R_row] (pinned_host in practice), any dtype.
      pool: [N_pool, R_row] device array, same dtype; donated, updated in place.
      fetch_src: [L, R] int32 per-layer host page ids (``-1`` or ``>= src_stride`` = none).
      fetch_dst: [L, R] int32 per-layer pool slots (``-1`` or ``>= dst_stride`` = none);
        valid ones distinct within a layer.
      src_stride, dst_stride: static rows per layer in ``host_kv`` / ``pool``.
      **tuning: ``chunk_elems`` (elements per load, a power of two; ``row_chunks``),
        ``programs_per_layer`` (G), ``num_warps``. Ignored by the reference.
    Returns:
      pool with the listed rows replaced.
    """
    fn = _common.resolve(OP_LAYERS, implementation)
    return call_in_place(fn, (host_kv, pool, fetch_src, fetch_dst), 1, src_stride=src_stride,
                         dst_stride=dst_stride, **tuning)
