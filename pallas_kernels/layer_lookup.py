"""One sparse layer's host-tier bookkeeping in one launch (the engine's in-place schedule).

Per decode step and layer the engine has to translate the selector's pages into pool rows
(resident pages) or host rows (missed pages, read in place by the attention kernel), record
the selection for the next step's install, and write the new token into its pool slot when its
page is resident. Written as XLA ops these are three or four tiny kernels per layer (a
page-table gather, a dynamic-update-slice into the record, the token's slot lookup); here they
are one Pallas launch that also does the pool write. Semantics (kernel and reference):

* ``logical[b, h, i] = b * pages_per_seq + pages[b, h, i]`` where ``pages >= 0`` and
  ``active[b]``, else -1; ``slot = page_table[layer, logical]`` (-1 = not resident; always -1
  when ``reuse=False``);
* ``rows = layer * S + slot`` where ``logical >= 0`` and ``slot >= 0``, else -1;
  ``host_rows = layer * P + logical`` where ``logical >= 0`` and ``slot < 0``, else -1;
* ``record[layer] = logical`` flattened (the other layers' rows are kept);
* the new token: ``tok_page[b]`` (a logical page, -1 = none) at ``tok_offset[b]``: if its
  slot ``page_table[layer, tok_page]`` is >= 0, ``pool[layer * S + slot]`` gets ``tok_kv[b]``
  at that offset; ``tok_host_rows[b] = layer * P + tok_page`` (-1 if none) is returned for the
  caller's write-through to the host tier.

``S`` slots per layer (``slots_per_layer``, default ``pool.shape[0] // L``; rows past ``L * S``
are never touched), ``P = page_table.shape[1]`` logical pages,
``L = page_table.shape[0]``. ``pool`` and ``record`` are updated in place (aliased; donate them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import _common, kv_quant, page_write
from ._common import INVALID

OP = "layer_lookup"


def _slots(pool, L, slots_per_layer):
    return pool.shape[0] // L if slots_per_layer is None else int(slots_per_layer)


def _check(pages, active, tok_page, tok_offset, tok_kv, page_table, pool, record, page_size,
           slots_per_layer=None):
    if pages.ndim != 3:
        raise ValueError(f"pages must be [B, H, K]; got {pages.shape}")
    B, H, K = pages.shape
    if active.shape != (B,) or tok_page.shape != (B,) or tok_offset.shape != (B,):
        raise ValueError(f"active {active.shape}, tok_page {tok_page.shape} and tok_offset "
                         f"{tok_offset.shape} must be [{B}]")
    if tok_kv.ndim != 4 or tok_kv.shape[:3] != (B, 2, H):
        raise ValueError(f"tok_kv {tok_kv.shape} must be [{B}, 2, {H}, D]")
    D = tok_kv.shape[3]
    if page_table.ndim != 2 or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be [L, P] int32; got {page_table.shape} {page_table.dtype}")
    L = page_table.shape[0]
    R = kv_quant.row_elems(pool.dtype, H, page_size, D)
    rows_ok = (pool.shape[0] % L == 0 if slots_per_layer is None
               else 0 < int(slots_per_layer) and L * int(slots_per_layer) <= pool.shape[0])
    if pool.ndim != 2 or not rows_ok or pool.shape[1] != R:
        raise ValueError(f"pool {pool.shape} must be [L * S (+ unused rows), R] with L = {L}, "
                         f"S = {slots_per_layer or 'pool rows / L'}, R = {R} "
                         f"(2 * H * page_size * D{' + scales' if R != 2 * H * page_size * D else ''})")
    if record.shape != (L, B * H * K) or record.dtype != jnp.int32:
        raise ValueError(f"record {record.shape} {record.dtype} must be [{L}, {B * H * K}] int32")


def _logical(pages, active, pages_per_seq):
    B = pages.shape[0]
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None]
    ok = (pages >= 0) & (active.astype(bool)[:, None, None])
    return jnp.where(ok, b * pages_per_seq + pages, INVALID).astype(jnp.int32)


@_common.register(OP, "xla")
def layer_lookup_reference(pages, active, tok_page, tok_offset, tok_kv, page_table, layer, pool,
                           record, *, pages_per_seq, page_size, reuse=True, slots_per_layer=None):
    """Pure-jnp reference of :func:`layer_lookup` (same arguments and results)."""
    _check(pages, active, tok_page, tok_offset, tok_kv, page_table, pool, record, page_size,
           slots_per_layer)
    L, P = page_table.shape
    S = _slots(pool, L, slots_per_layer)
    B, H, K = pages.shape
    D = tok_kv.shape[3]
    layer = jnp.asarray(layer, jnp.int32)
    logical = _logical(pages, active, pages_per_seq)
    table = page_table[layer]

    def slot_of(lg):
        s = jnp.where(lg >= 0, table[jnp.clip(lg, 0, P - 1)], INVALID)
        return s if reuse else jnp.full_like(s, INVALID)

    slot = slot_of(logical)
    rows = jnp.where((logical >= 0) & (slot >= 0), layer * S + slot, INVALID)
    host_rows = jnp.where((logical >= 0) & (slot < 0), layer * P + logical, INVALID)
    record = record.at[layer].set(logical.reshape(-1))
    tok_ok = (tok_page >= 0) & (tok_page < P)
    tok_slot = slot_of(jnp.where(tok_ok, tok_page, INVALID))
    tok_host_rows = jnp.where(tok_ok, layer * P + tok_page, INVALID).astype(jnp.int32)
    # The encoded token into its pool row (kv_quant.token_columns: [2, H, D] at the offset of
    # the [2, H, ps, D] payload, quantized: also its scale bytes).
    ok = (tok_slot >= 0) & (tok_offset >= 0) & (tok_offset < page_size)
    prow = jnp.where(ok, layer * S + tok_slot, 0)
    off = jnp.where(ok, tok_offset, 0)
    dtype = pool.dtype
    cols = jax.vmap(lambda o: kv_quant.token_columns(H, page_size, D, o, dtype))(off)
    pool = kv_quant.bits(pool)                          # fp8: the scatter moves bytes
    enc = kv_quant.bits(kv_quant.encode_tokens(tok_kv, dtype))
    new = jax.vmap(lambda row, c, t: row.at[c].set(t))(pool[prow], cols, enc)
    # Rows not written keep their value (a write to row 0 with ok False rewrites old content).
    pool = kv_quant.from_bits(pool.at[jnp.where(ok, prow, pool.shape[0])].set(new, mode="drop"),
                              dtype)
    return pool, record, rows.astype(jnp.int32), host_rows.astype(jnp.int32), tok_host_rows


def _kernel(layer_ref, pages_ref, act_ref, tpage_ref, toff_ref, kv_ref, pt_ref, pool_in, rec_in,
            pool_ref, rec_ref, rows_ref, hrows_ref, thr_ref, *, B, HK, CH, C, Np, P, S, ps, H, D,
            reuse, scales):
    """Program (b, j): entries [j * CH, (j + 1) * CH) of request b for j < C, its token for
    j == C (independent chains of dependent loads, run side by side)."""
    del pool_in, rec_in  # aliased with pool_ref / rec_ref
    b, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    @pl.when(j < C)
    def _entries():
        # Lanes past H*K (the power-of-two padding) repeat the last entry: duplicate stores of
        # equal values, so no masks are needed (interpret mode resolves masked duplicates badly).
        flat = b * HK + jnp.minimum(j * CH + jax.lax.broadcasted_iota(jnp.int32, (CH,), 0), HK - 1)
        pg = pages_ref[flat]
        ok = (pg >= 0) & (act_ref[b] != 0)
        logical = jnp.where(ok, b * Np + pg, INVALID)
        if reuse:
            slot = pltriton.load(pt_ref.at[layer * P + jnp.clip(logical, 0, P - 1)], mask=ok,
                                 other=INVALID)
            slot = jnp.where(ok, slot, INVALID)
        else:
            slot = jnp.full((CH,), INVALID, jnp.int32)
        rows_ref[flat] = jnp.where(slot >= 0, layer * S + slot, INVALID)
        hrows_ref[flat] = jnp.where(ok & (slot < 0), layer * P + logical, INVALID)
        rec_ref[layer * (B * HK) + flat] = logical

    @pl.when(j == C)
    def _token():
        tp = tpage_ref[b]
        t_ok = (tp >= 0) & (tp < P)
        thr_ref[b] = jnp.where(t_ok, layer * P + tp, INVALID)
        if reuse:
            ts = pt_ref[layer * P + jnp.where(t_ok, tp, 0)]
            o = toff_ref[b]
            w_ok = t_ok & (ts >= 0) & (o >= 0) & (o < ps)
            page_write.store_token(pool_ref, layer * S + ts, o, w_ok, kv_ref, b, page_size=ps,
                                   head_dim=D, scales=scales)


ENTRIES_PER_PROGRAM = 64


@_common.register(OP, "pallas")
@functools.partial(jax.jit, static_argnames=("pages_per_seq", "page_size", "reuse", "slots_per_layer"))
def layer_lookup_pallas(pages, active, tok_page, tok_offset, tok_kv, page_table, layer, pool,
                        record, *, pages_per_seq, page_size, reuse=True, slots_per_layer=None):
    """Pallas (Triton) kernel of :func:`layer_lookup`: grid (B, C + 1); programs (b, j < C) map
    request b's entries in power-of-two chunks of at most ENTRIES_PER_PROGRAM, program (b, C)
    writes its token."""
    _check(pages, active, tok_page, tok_offset, tok_kv, page_table, pool, record, page_size,
           slots_per_layer)
    L, P = page_table.shape
    S = _slots(pool, L, slots_per_layer)
    B, H, K = pages.shape
    D = tok_kv.shape[3]
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two (Triton blocks)")
    HK = H * K
    CH = min(_common.next_pow2(HK), ENTRIES_PER_PROGRAM)
    C = -(-HK // CH)
    kernel = functools.partial(_kernel, B=B, HK=HK, CH=CH, C=C, Np=pages_per_seq, P=P, S=S,
                               ps=page_size, H=H, D=D, reuse=reuse,
                               scales=kv_quant.is_quantized(pool.dtype))
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), pages.astype(jnp.int32).reshape(-1),
                active.astype(jnp.int32), tok_page.astype(jnp.int32), tok_offset.astype(jnp.int32),
                kv_quant.encode_tokens(tok_kv, pool.dtype), page_table.reshape(-1), pool,
                record.reshape(-1)]
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    pool, rec, rows, hrows, thr = pl.pallas_call(
        kernel,
        grid=(B, C + 1),
        in_specs=[full(x.shape) for x in operands],
        out_specs=[full(pool.shape), full((L * B * HK,)), full((B * HK,)), full((B * HK,)),
                   full((B,))],
        out_shape=[jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                   jax.ShapeDtypeStruct((L * B * HK,), jnp.int32),
                   jax.ShapeDtypeStruct((B * HK,), jnp.int32),
                   jax.ShapeDtypeStruct((B * HK,), jnp.int32),
                   jax.ShapeDtypeStruct((B,), jnp.int32)],
        input_output_aliases={7: 0, 8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4),
        interpret=_common.interpret_mode(),
        name="layer_lookup",
    )(*operands)
    return (pool, rec.reshape(L, B * HK), rows.reshape(B, H, K), hrows.reshape(B, H, K), thr)


def layer_lookup(pages, active, tok_page, tok_offset, tok_kv, page_table, layer, pool, record, *,
                 pages_per_seq, page_size, reuse=True, slots_per_layer=None, implementation=None):
    """Translate one layer's selection, record it and write the new token into the pool.

    Args:
      pages: [B, H, K] int32 selected pages of each request's sequence (-1 pad).
      active: [B] bool or int32, requests decoding this step (inactive ones select nothing).
      tok_page: [B] int32 logical page of the new token (-1 = none); tok_offset: [B] int32.
      tok_kv: [B, 2, H, D] the new token's K and V (cast to ``pool.dtype``; a quantized pool
        gets it quantized, ``kv_quant``).
      page_table: [L, P] int32 logical page -> slot (-1 = not resident).
      layer: int32 scalar (traced is fine).
      pool: [L * S (+ unused rows), R] device pool (``R = kv_quant.row_elems``); donated,
        updated in place.
      record: [L, B * H * K] int32 selections of the step; donated, row ``layer`` replaced.
      pages_per_seq, page_size: static ints. reuse: static; False = nothing is resident.
      slots_per_layer: static int S (default ``pool.shape[0] // L``); the pool may have unused
        rows after ``L * S`` (``jaxkv.spec.alloc_rows``).
      implementation: "pallas" | "xla" | None.
    Returns:
      (pool, record, rows [B, H, K], host_rows [B, H, K], tok_host_rows [B]), int32 rows as in
      the module docstring.
    """
    fn = _common.resolve(OP, implementation)
    return fn(pages, active, tok_page, tok_offset, tok_kv, page_table, layer, pool, record,
              pages_per_seq=int(pages_per_seq), page_size=int(page_size), reuse=bool(reuse),
              slots_per_layer=slots_per_layer)
