"""Writes into a page array (the pinned_host tier or the device pool), in place.

* ``write_tokens(dst, rows, offsets, kv, page_size=)``: one token's K and V per entry into
  row ``rows[m]`` at token offset ``offsets[m]`` (row layout ``[2, H, page_size, D]``; a
  quantized (fp8 / int8) ``dst`` gets the token quantized and its scale bytes in the row's
  tail, ``kv_quant``).
* ``write_tokens_pair(host, host_rows, pool, pool_rows, offsets, kv, page_size=)``: the same
  tokens into the host tier and the device pool (write-through).
* ``write_pages(dst, rows, pages)``: whole rows (prefill).

Both alias ``dst`` to the output (``input_output_aliases``); callers donate it. ``-1`` (or
out-of-range) rows / offsets write nothing. Entries must not write the same element twice:
for ``write_tokens`` the valid ``(row, offset)`` pairs must be distinct, for
``write_pages`` the valid rows must be distinct (otherwise which entry wins is unspecified).

Write-through to the host tier (``dst`` in pinned_host memory), see docs/DESIGN.md and
/work/shared/NOTES.md:

* At a ``jit`` boundary: donate ``dst`` and give the output ``out_shardings`` with
  ``memory_kind="pinned_host"`` (without it XLA refuses to alias a host input to a device
  output). Eager calls of these functions do both automatically.
* Inside a traced function whose result must stay a host array, in particular a
  ``lax.fori_loop`` / ``while_loop`` / ``scan`` carry that holds the host tier: wrap the
  result in :func:`keep_on_host`. A ``pallas_call`` output is typed as device memory even
  when it aliases a host input; ``keep_on_host`` re-annotates it (no copy is emitted) so the
  carry keeps its memory kind. The device pool needs nothing.
* The carry's initial value must then be typed as host memory too
  (``jax.typeof(x).memory_space == Space.Host``). ``jax.device_put(x, host_sharding)``
  gives that, and so does a jitted allocator whose last op is
  ``jax.device_put(x, jax.memory.Space.Host)``; a jit with only
  ``out_shardings=<pinned_host>`` returns a pinned_host array typed as *device* memory, and
  a loop carrying it fails with "carry input and carry output must have equal types".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from . import kv_quant
from . import page_fetch

OP_TOKENS = "write_tokens"
OP_PAGES = "write_pages"


def keep_on_host(x):
    """Re-annotate ``x`` as host memory: ``jax.device_put(x, jax.memory.Space.Host)``.

    Use on the result of :func:`write_tokens` / :func:`write_pages` applied to the
    pinned_host tier inside a traced loop body (the carry must keep its memory kind).
    Eagerly, or on an array already typed as host memory, it is a no-op.
    """
    if not page_fetch.is_traced(x):
        return x
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
        return x
    return jax.device_put(x, jax.memory.Space.Host)


def _check_tokens(dst, rows, offsets, kv, page_size):
    if dst.ndim != 2 or kv.ndim != 4 or kv.shape[1] != 2:
        raise ValueError(f"dst must be [N, R] and kv [M, 2, H, D]; got {dst.shape}, {kv.shape}")
    M, _, H, D = kv.shape
    R = kv_quant.row_elems(dst.dtype, H, page_size, D)
    if dst.shape[1] != R:
        raise ValueError(f"row length {dst.shape[1]} != {R} (2 * H {H} * page_size {page_size} * "
                         f"D {D}{' + scales' if kv_quant.is_quantized(dst.dtype) else ''})")
    if rows.shape != (M,) or offsets.shape != (M,):
        raise ValueError(f"rows {rows.shape} and offsets {offsets.shape} must be [{M}]")


def store_token(dst_ref, row, offset, ok, kv_ref, kv_row, *, page_size: int, head_dim: int,
                scales: bool = False):
    """Kernel helper (Triton): write the encoded token ``kv_ref[kv_row]`` (``[2 * H * D]``:
    segment ``s`` = (K or V, head), ``D`` elements each; with ``scales`` then ``2 * H`` scale
    bytes, ``kv_quant.encode_tokens``) into row ``row`` of ``dst_ref`` (row layout
    ``[2, H, page_size, D]``, then with ``scales`` the scale bytes ``[2, H, page_size]``) at
    token ``offset``; nothing where ``ok`` is False. The loads are issued before the stores."""
    D = head_dim
    n = kv_ref.shape[1] // (D + 1) if scales else kv_ref.shape[1] // D  # segments (2 * H)
    r = jnp.where(ok, row, 0)
    o = jnp.where(ok, offset, 0)
    mask = jnp.full((D,), ok)
    vals = [kv_ref[kv_row, pl.ds(seg * D, D)] for seg in range(n)]
    if scales:  # the n scale bytes in one gathered load / store; the power-of-two padding
        # lanes repeat the last segment (duplicate stores of equal values, no mask needed)
        seg = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (_common.next_pow2(n),), 0), n - 1)
        e = plgpu.load(kv_ref.at[jnp.full(seg.shape, kv_row), n * D + seg])
    for seg_i, v in enumerate(vals):  # segment = (K or V, head): a [page_size, D] block
        plgpu.store(dst_ref.at[r, pl.ds((seg_i * page_size + o) * D, D)], v, mask=mask)
    if scales:
        plgpu.store(dst_ref.at[jnp.full(seg.shape, r), n * page_size * D + seg * page_size + o],
                    e, mask=jnp.full(seg.shape, ok))


def _write_tokens_pallas(dst, rows, offsets, kv, *, page_size: int, num_warps: int = 4):
    """Pallas: grid (M,); program m stores the 2*H head vectors of entry m (D elements each)."""
    _check_tokens(dst, rows, offsets, kv, page_size)
    N, R = dst.shape
    M, _, H, D = kv.shape
    ps = int(page_size)
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two (Triton blocks)")
    if M == 0:  # no entry: nothing to write (a grid of 0 programs over [0] blocks cannot lower)
        return dst
    kv2 = kv_quant.encode_tokens(kv, dst.dtype)
    scales = kv_quant.is_quantized(dst.dtype)
    rows = jnp.asarray(rows, jnp.int32)
    offsets = jnp.asarray(offsets, jnp.int32)

    def kernel(rows_ref, offs_ref, kv_ref, dst_in_ref, dst_ref):
        del dst_in_ref  # aliased with dst_ref
        m = pl.program_id(0)
        r = rows_ref[m]
        o = offs_ref[m]
        ok = (r >= 0) & (r < N) & (o >= 0) & (o < ps)
        store_token(dst_ref, r, o, ok, kv_ref, m, page_size=ps, head_dim=D, scales=scales)

    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(dst.shape, dst.dtype),
        grid=(M,),
        in_specs=[full((M,)), full((M,)), full(kv2.shape), full(dst.shape)],
        out_specs=full(dst.shape),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode(),
        name="write_tokens",
    )(rows, offsets, kv2, dst)


@_common.register(OP_TOKENS, "pallas")
def write_tokens_pallas(dst, rows, offsets, kv, *, page_size, **tuning):
    """Pallas implementation of :func:`write_tokens`."""
    return _write_tokens_pallas(dst, rows, offsets, kv, page_size=page_size, **tuning)


@_common.register(OP_TOKENS, "xla")
def write_tokens_reference(dst, rows, offsets, kv, *, page_size, **tuning):
    """Pure-jnp reference of :func:`write_tokens`: a loop over entries that reads the row,
    sets the token and writes the row back (device_put across memory kinds when ``dst`` is
    a host array; sequential, so repeated rows with distinct offsets compose)."""
    del tuning
    _check_tokens(dst, rows, offsets, kv, page_size)
    N, R = dst.shape
    M, _, H, D = kv.shape
    ps = int(page_size)
    dtype = dst.dtype
    if M == 0:  # no entry (the loop body below cannot index an empty batch)
        return dst
    kv = kv_quant.encode_tokens(kv, dtype)
    rows = jnp.asarray(rows, jnp.int32)
    offsets = jnp.asarray(offsets, jnp.int32)
    ok = (rows >= 0) & (rows < N) & (offsets >= 0) & (offsets < ps)
    on_host = jax.typeof(dst).memory_space == jax.memory.Space.Host
    if kv_quant.bytes_movable(dst):   # fp8: the loop moves bytes
        dst, kv = kv_quant.bits(dst), kv_quant.bits(kv)

    def body(m, dst):
        r = jnp.where(ok[m], rows[m], 0)
        o = jnp.where(ok[m], offsets[m], 0)
        old = jax.lax.dynamic_slice_in_dim(dst, r, 1, 0)
        if on_host:
            old = jax.device_put(old, jax.memory.Space.Device)
        cols = kv_quant.token_columns(H, ps, D, o, dtype)
        new = jnp.where(ok[m], old.at[0, cols].set(kv[m]), old)
        if on_host:
            new = jax.device_put(new, jax.memory.Space.Host)
        return jax.lax.dynamic_update_slice_in_dim(dst, new, r, 0)

    return kv_quant.from_bits(jax.lax.fori_loop(0, M, body, dst), dtype)


def write_tokens(dst, rows, offsets, kv, *, page_size, implementation=None, **tuning):
    """Write one token's K/V per entry into a page array, in place.

    Args:
      dst: [N, R] page array, ``R = 2 * H * page_size * D`` (row layout [2, H, ps, D]);
        pinned_host tier or device pool; donated.
      rows: [M] int32 global rows of ``dst``; ``-1`` (or out of range) = write nothing.
      offsets: [M] int32 token offsets within the page, in ``[0, page_size)``.
      kv: [M, 2, H, D] K (index 0) and V (index 1) of the token; cast to ``dst.dtype``
        (fp8 / int8: quantized, its scales written too).
      page_size: static int, tokens per page.
      implementation: "pallas" | "xla" | None.
      **tuning: ``num_warps`` of the Pallas kernel.
    Returns:
      dst [N, R] with the tokens written. Inside a traced loop over a host carry, wrap it
      in :func:`keep_on_host`.
    """
    fn = _common.resolve(OP_TOKENS, implementation)
    return page_fetch.call_in_place(fn, (dst, rows, offsets, kv), 0, page_size=int(page_size),
                                    **tuning)


def write_tokens_pair(host, host_rows, pool, pool_rows, offsets, kv, *, page_size,
                      implementation=None, **tuning):
    """Write-through: each entry's token into ``host`` and into ``pool`` (two
    :func:`write_tokens` launches; one launch with a pinned_host and a device output fails
    XLA's aliasing check on the GPU: "Different aliasing shapes: bf16[..]{1,0} vs
    bf16[..]{1,0:S(5)}").

    Args:
      host: [Nh, R] host tier (pinned_host), donated; pool: [Np, R] device pool, donated.
      host_rows, pool_rows: [M] int32 rows of each array (-1 = skip that array for the entry).
      offsets, kv, page_size, implementation, **tuning: as :func:`write_tokens`.
    Returns:
      (host, pool) with the tokens written. Inside a traced loop over a host carry, wrap the
      host result in :func:`keep_on_host`.
    """
    kw = dict(page_size=page_size, implementation=implementation, **tuning)
    return (write_tokens(host, host_rows, offsets, kv, **kw),
            write_tokens(pool, pool_rows, offsets, kv, **kw))


@_common.register(OP_PAGES, "pallas")
def write_pages_pallas(dst, rows, pages, **tuning):
    """Pallas implementation of :func:`write_pages` (the fetch kernel, source = ``pages``)."""
    src_rows = jnp.arange(pages.shape[0], dtype=jnp.int32)
    return page_fetch.copy_rows_pallas(pages.astype(dst.dtype), dst, src_rows,
                                       jnp.asarray(rows, jnp.int32), **tuning)


@_common.register(OP_PAGES, "xla")
def write_pages_reference(dst, rows, pages, **tuning):
    """Pure-jnp reference of :func:`write_pages`."""
    del tuning
    src_rows = jnp.arange(pages.shape[0], dtype=jnp.int32)
    return page_fetch.copy_rows_reference(pages.astype(dst.dtype), dst, src_rows,
                                          jnp.asarray(rows, jnp.int32))


def write_pages(dst, rows, pages, *, implementation=None, **tuning):
    """Write whole rows (prefill): ``dst[rows[m]] = pages[m]``, in place.

    Args:
      dst: [N, R] page array (pinned_host tier or device pool); donated.
      rows: [M] int32 global rows; ``-1`` = write nothing; valid ones distinct.
      pages: [M, R] rows to write (device array); cast to ``dst.dtype`` (quantized: already
        encoded, ``kv_quant.pack_pages``).
      implementation: "pallas" | "xla" | None.
      **tuning: tunables of the copy kernel (see ``page_fetch.resolve_tuning``).
    Returns:
      dst [N, R]. Inside a traced loop over a host carry, wrap it in :func:`keep_on_host`.
    """
    if kv_quant.is_quantized(dst.dtype) and pages.dtype != dst.dtype:
        raise ValueError(f"write_pages into a {dst.dtype} array takes encoded rows of that dtype "
                         f"(kv_quant.pack_pages / encode_rows), got {pages.dtype}")
    fn = _common.resolve(OP_PAGES, implementation)
    return page_fetch.call_in_place(fn, (dst, rows, pages), 0, **tuning)
