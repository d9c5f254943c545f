"""The LRU ``ensure`` of all layers as ONE Pallas kernel (small pools).

Grid ``(L,)``: program ``l`` runs exactly the sort-free algorithm of
:func:`ensure_layer_dense` (the "xla" reference here; semantics in ``jaxkv.lru``) on
layer ``l``, with the compare matrices ([R, R], [S, S], [R, S], [Q, S]) held in registers:
one launch per step instead of XLA's dozen small kernels. Outputs are bit-identical to the
reference (fetch entries in the same order too).

Layout inside the kernel: R, S and Q are padded to powers of two (Triton arrays must be);
padded requests / protected pages are ``-1`` (invalid), padded slots are treated as
protected (never victims, not counted as free), and every load/store of a padded lane is
masked. The page table is read with two pointer gathers (requests, protected pages) and
updated in place (output aliased to the input) with two masked scatters: evictions (-1),
then installs (slot); the two never touch the same page.

Size cap: the [S, S] and [R, S] matrices live in registers, so R, S, Q <= ``MAX_SIZE`` (256).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from ._common import INVALID

OP = "lru_ensure"
MAX_SIZE = 256          # cap on R, S and Q (the [S, S] compare matrix is in registers)
_BIG = jnp.iinfo(jnp.int32).max


def _i32(x):
    return x.astype(jnp.int32)


def _sum(x, axis=None):
    """int32 sum of a bool/int array along ``axis`` (or of a 1-D array to a scalar); a double
    negation after a reduce that leaves an array (a layout conversion, triton#1776)."""
    x = jnp.sum(_i32(x), axis=0 if axis is None else axis)
    return -(-x) if x.ndim else x


def _iota(n):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _ensure_kernel(step_ref, pt_ref, so_ref, lu_ref, req_ref, prot_ref, pay_ref,
                   pt_out, so_out, lu_out, slots_out, src_out, dst_out, pay_out, counts_out,
                   *, P: int, S: int, R: int, Q: int):
    l = pl.program_id(0)
    Rp, Sp, Qp = (_common.next_pow2(n) for n in (R, S, Q))
    i_r, i_s, i_q = _iota(Rp), _iota(Sp), _iota(Qp)
    in_r, in_s = i_r < R, i_s < S

    requests = plgpu.load(req_ref.at[l, i_r], mask=in_r, other=INVALID)
    protect = plgpu.load(prot_ref.at[l, i_q], mask=i_q < Q, other=INVALID)
    payload = plgpu.load(pay_ref.at[l, i_r], mask=in_r, other=INVALID)
    slot_owner = plgpu.load(so_ref.at[l, i_s], mask=in_s, other=INVALID)
    last_used = plgpu.load(lu_ref.at[l, i_s], mask=in_s, other=0)
    step = step_ref[0]

    valid = (requests >= 0) & (requests < P)
    req = jnp.where(valid, requests, P)
    pvalid = (protect >= 0) & (protect < P)
    cur = plgpu.load(pt_ref.at[l, jnp.where(valid, requests, 0)], mask=valid, other=INVALID)
    pslot = plgpu.load(pt_ref.at[l, jnp.where(pvalid, protect, 0)], mask=pvalid,
                       other=INVALID)

    # [R, R]: first copies, and "strictly smaller page" for the miss ranks.
    eq = req[:, None] == req[None, :]
    dup = _sum(eq & (i_r[None, :] < i_r[:, None]), axis=1) > 0
    first = valid & jnp.logical_not(dup)
    less = valid[None, :] & (req[None, :] < req[:, None])   # [i, j]: req[j] < req[i]
    hit = first & (cur >= 0)
    miss = first & (cur < 0)
    rank = _sum(less & miss[None, :], axis=1)

    # [R, S] / [Q, S]: protected slots (padded slots count as protected).
    used_slot = _sum(cur[:, None] == i_s[None, :], axis=0) > 0
    prot = (used_slot | (_sum(pslot[:, None] == i_s[None, :], axis=0) > 0)
            | jnp.logical_not(in_s))
    # [S, S]: victim rank = stable sort position of the key.
    key = jnp.where(prot, _BIG, jnp.where(slot_owner < 0, -1, last_used))
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                               & (i_s[None, :] < i_s[:, None]))
    vrank = _sum(before, axis=1)
    n_free = _sum(jnp.logical_not(prot))
    n_assigned = jnp.minimum(_sum(miss), n_free)

    missing = valid & (cur < 0)
    assigned_any = missing & (rank < n_free)
    match = rank[:, None] == vrank[None, :]                  # [R, S]
    new_slot = _sum(jnp.where(assigned_any[:, None] & match, i_s[None, :], 0), axis=1)
    slots = jnp.where(cur >= 0, cur, jnp.where(assigned_any, new_slot, INVALID))
    assigned = first & assigned_any

    installed = vrank < n_assigned
    new_owner = _sum(jnp.where(miss[:, None] & match, req[:, None], 0), axis=0)
    evicted = installed & (slot_owner >= 0)

    # Page table in place: evictions first, then installs (disjoint pages); masked lanes
    # aim past the row (P), which interpret mode drops and the GPU never touches.
    plgpu.store(pt_out.at[l, jnp.where(evicted, slot_owner, P)],
                jnp.full((Sp,), INVALID, jnp.int32), mask=evicted)
    plgpu.store(pt_out.at[l, jnp.where(assigned, req, P)], new_slot, mask=assigned)
    plgpu.store(so_out.at[l, i_s], jnp.where(installed, new_owner, slot_owner), mask=in_s)
    plgpu.store(lu_out.at[l, i_s], jnp.where(used_slot | installed, step, last_used),
                mask=in_s)
    plgpu.store(slots_out.at[l, i_r], slots, mask=in_r)

    # Fetch entries compacted at the front in page order (entry k = the miss of rank k).
    put = assigned[:, None] & (rank[:, None] == i_r[None, :])  # [i, position]
    anyput = _sum(put, axis=0) > 0

    def place(v):
        return jnp.where(anyput, _sum(jnp.where(put, v[:, None], 0), axis=0), INVALID)

    plgpu.store(src_out.at[l, i_r], place(req), mask=in_r)
    plgpu.store(dst_out.at[l, i_r], place(new_slot), mask=in_r)
    plgpu.store(pay_out.at[l, i_r], place(payload), mask=in_r)

    i4 = _iota(4)
    counts = jnp.where(i4 == 0, _sum(hit), jnp.where(
        i4 == 1, _sum(miss), jnp.where(i4 == 2, _sum(evicted), _sum(miss & jnp.logical_not(
            assigned)))))
    plgpu.store(counts_out.at[l, i4], counts)


def _default_warps(R: int, S: int) -> int:
    """4 warps up to 4096 elements in the largest compare matrix, 8 up to 16384, else 16."""
    Rp, Sp = _common.next_pow2(R), _common.next_pow2(S)
    n = max(Rp * Rp, Sp * Sp, Rp * Sp)
    return 4 if n <= 4096 else 8 if n <= 16384 else 16


@_common.register(OP, "pallas")
def ensure_layers_pallas(page_table, slot_owner, last_used, requests, protect, payload, step,
                         *, num_warps: int | None = None, interpret: bool | None = None):
    """All layers' ensure in one kernel launch (grid over layers).

    page_table [L, P], slot_owner [L, S], last_used [L, S], requests [L, R], protect [L, Q],
    payload [L, R]: int32 (as ``jaxkv.lru.ensure``); step: int32 scalar (traced).
    Returns (page_table [L, P], slot_owner [L, S], last_used [L, S], slots [L, R],
    fetch_src [L, R], fetch_dst [L, R], fetch_payload [L, R], counts [L, 4] =
    hits, misses, evictions, dropped per layer), all int32, identical to the "xla" reference.
    The new page table is written in place into ``page_table``'s buffer (aliased output):
    donate it to avoid a copy. Requires R, S, Q <= ``MAX_SIZE``. ``num_warps`` (static):
    default from the largest compare matrix (:func:`_default_warps`).
    """
    L, P = page_table.shape
    S, R, Q = slot_owner.shape[-1], requests.shape[-1], protect.shape[-1]
    if max(R, S, Q) > MAX_SIZE:
        raise ValueError(f"lru_ensure pallas kernel: R={R}, S={S}, Q={Q} must be <= {MAX_SIZE}")
    args = [jnp.asarray(step, jnp.int32).reshape(1)] + [
        jnp.asarray(a).astype(jnp.int32)
        for a in (page_table, slot_owner, last_used, requests, protect, payload)]

    def full(shape):
        return pl.BlockSpec(shape, lambda l: (0,) * len(shape))

    shapes = [(L, P), (L, S), (L, S), (L, R), (L, R), (L, R), (L, R), (L, 4)]
    return tuple(pl.pallas_call(
        functools.partial(_ensure_kernel, P=P, S=S, R=R, Q=Q),
        out_shape=[jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes],
        grid=(L,),
        in_specs=[full((1,))] + [full(a.shape) for a in args[1:]],
        out_specs=[full(s) for s in shapes],
        input_output_aliases={1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or _default_warps(R, S),
                                             num_stages=1),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="lru_ensure",
    )(*args))


def ensure_layer_dense(page_table, slot_owner, last_used, requests, protect, payload, step):
    """One layer of the LRU ensure, sort-free (the kernel's pure-jnp reference; ``jaxkv.lru``
    gives the semantics and its sort form the same outputs, fetch entries in the same order
    too), from fixed-size compare matrices ([R, R], [S, S], [R, S], [Q, S]) that
    XLA fuses into a few elementwise+reduce kernels; one gather and one scatter on
    ``page_table``, none on the [S] state. Shapes: page_table [P], slot_owner / last_used [S], requests / payload [R], protect [Q] int32; step int32 scalar."""
    P = page_table.shape[0]
    S = slot_owner.shape[0]
    R = requests.shape[0]
    i_r = jnp.arange(R, dtype=jnp.int32)
    i_s = jnp.arange(S, dtype=jnp.int32)

    valid = (requests >= 0) & (requests < P)
    req = jnp.where(valid, requests, P).astype(jnp.int32)
    pvalid = (protect >= 0) & (protect < P)
    # One gather for requests and protected pages together.
    both = jnp.concatenate([jnp.clip(requests, 0, P - 1), jnp.clip(protect, 0, P - 1)])
    looked = page_table[both]
    cur = jnp.where(valid, looked[:R], INVALID)              # [R] current slot (every copy)
    pslot = jnp.where(pvalid, looked[R:], INVALID)           # [Q]

    # [R, R]: duplicates (an earlier equal request) and "strictly smaller page" relations.
    eq = req[:, None] == req[None, :]
    first = valid & ~jnp.any(eq & (i_r[None, :] < i_r[:, None]), axis=1)
    less = valid[None, :] & (req[None, :] < req[:, None])    # [i, j]: req[j] < req[i]
    hit = first & (cur >= 0)
    miss = first & (cur < 0)
    # The rank of a missed page among the missed pages (same for copies).
    rank = jnp.sum(less & miss[None, :], axis=1, dtype=jnp.int32)

    # [R, S] / [Q, S]: protected slots = slots of resident requested pages (every copy has
    # the same slot, so no need to wait for ``first``) and of resident protected pages.
    used_slot = jnp.any(cur[:, None] == i_s[None, :], axis=0)
    prot = used_slot | jnp.any(pslot[:, None] == i_s[None, :], axis=0)
    # [S, S]: victim order = stable sort position of the key (ties by slot index).
    key = jnp.where(prot, _BIG, jnp.where(slot_owner < 0, -1, last_used))
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                               & (i_s[None, :] < i_s[:, None]))
    vrank = jnp.sum(before, axis=1, dtype=jnp.int32)        # [S] a permutation of 0..S-1
    n_free = jnp.sum(~prot, dtype=jnp.int32)
    n_assigned = jnp.minimum(jnp.sum(miss, dtype=jnp.int32), n_free)

    # The missed page of rank k takes the slot of victim rank k (k < n_assigned).
    missing = valid & (cur < 0)                              # every copy of a missed page
    assigned_any = missing & (rank < n_free)
    take = assigned_any[:, None] & (rank[:, None] == vrank[None, :])  # [R, S]
    new_slot = jnp.sum(jnp.where(take, i_s[None, :], 0), axis=1, dtype=jnp.int32)
    slots = jnp.where(cur >= 0, cur, jnp.where(assigned_any, new_slot, INVALID))
    assigned = first & assigned_any

    # Dense [S] state updates, straight from the per-slot ranks (no wait for ``new_slot``).
    installed = vrank < n_assigned
    new_owner = jnp.sum(jnp.where(miss[:, None] & (rank[:, None] == vrank[None, :]),
                                  req[:, None], 0), axis=0, dtype=jnp.int32)
    evicted = installed & (slot_owner >= 0)
    # One scatter for the page table: evictions -> -1 and installs -> slot (disjoint pages:
    # an evicted page is resident, an installed one was not).
    idx = jnp.concatenate([jnp.where(evicted, slot_owner, P), jnp.where(assigned, req, P)])
    val = jnp.concatenate([jnp.full((S,), INVALID, jnp.int32), new_slot])
    page_table = page_table.at[idx].set(val, mode="drop")
    slot_owner = jnp.where(installed, new_owner, slot_owner)
    last_used = jnp.where(used_slot | installed, step, last_used)

    # Fetch entries compacted at the front in page order: entry k is the miss of rank k
    # ([R, R] select), -1 from n_assigned on.
    put = assigned[:, None] & (rank[:, None] == i_r[None, :])  # [i, position]
    anyput = jnp.any(put, axis=0)

    def place(v):
        return jnp.where(anyput, jnp.sum(jnp.where(put, v[:, None], 0), axis=0,
                                         dtype=jnp.int32), INVALID)

    counts = jnp.stack([
        jnp.sum(hit), jnp.sum(miss), jnp.sum(evicted), jnp.sum(miss & ~assigned)
    ]).astype(jnp.int32)
    return (page_table, slot_owner, last_used, slots, place(req), place(new_slot),
            place(payload), counts)


@_common.register(OP, "xla")
def ensure_layers_reference(page_table, slot_owner, last_used, requests, protect, payload,
                            step):
    """Pure-jnp reference: :func:`ensure_layer_dense` vmapped over layers. Shapes and
    result as :func:`ensure_layers_pallas`."""
    return jax.vmap(ensure_layer_dense, in_axes=(0, 0, 0, 0, 0, 0, None))(
        *(jnp.asarray(a).astype(jnp.int32)
          for a in (page_table, slot_owner, last_used, requests, protect, payload)),
        jnp.asarray(step, jnp.int32))
