"""Static-shape LRU ``ensure``: make a step's requested pages resident in the device pool.

Fixed shapes (no boolean-mask indexing, no ``jnp.unique``), batched over layers (``vmap``
of pure jnp, or a grid over layers), so all layers cost one launch of each op. Three
implementations, identical outputs (every field, fetch entries in the same order):

* ``method="sort"``: one sort of the requests (to find duplicates), one sort of the slots
  (to rank victims), a few prefix sums and scatters. Scales to any shape.
* ``method="dense"``: no sort, no prefix sum: [R, R], [S, S], [R, S] and [Q, S] compare
  matrices that XLA fuses into a few wide kernels, one gather and one scatter on the page
  table. For small pools, where the cost is the number of kernels, not arithmetic.
* ``method="pallas"``: "dense" as ONE Pallas kernel for all layers (grid over layers,
  compare matrices in registers; ``jaxkv.kernels.lru_ensure``). R, S, Q <= ``PALLAS_MAX``
  (256). Interpret mode (slow) off the GPU.
* ``method="auto"`` (default): where R*R + S*S + R*S + Q*S <= ``dense_max_elems`` (2**20
  compare elements per layer): "pallas" on the GPU (or with ``JAXKV_IMPL=pallas``) when
  R, S, Q <= ``pallas_max`` (128), else "dense"; bigger shapes: "sort" (the engine takes both
  thresholds from ``jaxkv.Tuning``).

Semantics, per layer and step (the plain-Python model in tests/lru_model.py is the spec):

1. Requests are logical page ids, ``-1`` = padding; duplicates count once.
2. A requested page that is resident is a **hit**; otherwise a **miss**.
3. Protected slots are never victims: slots holding a page requested this step, and slots
   holding a page listed in ``protect`` (pinned sink/recent pages).
4. Misses, in ascending page id, take the unprotected slots in victim order: empty slots
   first (lowest slot first), then least recently used (ties: lowest slot first).
5. Misses beyond the unprotected slots are **dropped**: their slot is ``-1`` and the
   ``dropped`` counter says how many (a strict caller raises on it).
6. Every resident requested page gets ``last_used = step``.
7. Fetch entries (``fetch_src`` / ``fetch_dst`` / ``fetch_payload``) are compacted: the
   assigned misses in ascending page order at positions ``0 .. n - 1`` of the layer's row,
   ``-1`` after (``jaxkv.kernels.page_fetch.fetch_layer_pages`` then only walks ``n``).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.kernels import _common, lru_ensure
from jaxkv.kernels._common import INVALID
from jaxkv.kernels.lru_ensure import ensure_layer_dense as _ensure_layer_dense

_BIG = jnp.iinfo(jnp.int32).max
_SCAN_BLOCK = 64
METHODS = ("auto", "dense", "sort", "pallas")
# Largest R, S and Q of the one-kernel "pallas" method (its [S, S] matrix is in registers).
PALLAS_MAX = lru_ensure.MAX_SIZE
# Defaults of ``resolve_method``'s thresholds (``jaxkv.Tuning`` holds the engine's; the
# measurements behind both are in docs/decisions.md). "dense" fuses each compare into its
# reduction, so its cost is arithmetic against the sort path's kernel count; above 128 the
# Pallas kernel pads to 256 and its compare matrices spill registers.
# Off the GPU the sort form wins from a few thousand compare elements (XLA:CPU, 30 layers:
# 0.21 against 0.26 ms at R=32, S=64; 0.88 against 2.5 ms at R=192, S=200; 1.7 against 27.7
# ms at R=384, S=400), the compare matrices only for the smallest pools.
DENSE_MAX_ELEMS = 2 ** 20
DENSE_MAX_ELEMS_CPU = 2048
PALLAS_AUTO_MAX = 128


def prefix_sum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sum along the last axis of an int32 array [..., n].

    The same values as ``jnp.cumsum``, computed with compare-and-reduce fusions over blocks
    of 64 (two or three wide kernels): XLA:GPU lowers a cumsum to a ``reduce_window`` run by
    a single thread block (its cost on the H200: docs/decisions.md)."""
    return _prefix(x, jnp.sum, 0, lambda a, b: a + b)


def prefix_max(x: jax.Array) -> jax.Array:
    """Inclusive running maximum along the last axis of an int32 array [..., n] (as
    ``lax.cummax``, for values > int32 min), computed like ``prefix_sum``."""
    return _prefix(x, jnp.max, jnp.iinfo(jnp.int32).min, jnp.maximum)


def _prefix(x, reduce, identity, combine):
    n = x.shape[-1]
    if n <= _SCAN_BLOCK:
        i = jnp.arange(n)
        return reduce(jnp.where(i[None, :] <= i[:, None], x[..., None, :], identity), axis=-1)
    c = _SCAN_BLOCK
    nb = -(-n // c)
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * c - n)], constant_values=identity)
    local = _prefix(xp.reshape(x.shape[:-1] + (nb, c)), reduce, identity, combine)  # [..., nb, c]
    incl = _prefix(local[..., -1], reduce, identity, combine)                       # [..., nb]
    excl = jnp.concatenate([jnp.full(incl.shape[:-1] + (1,), identity, incl.dtype),
                            incl[..., :-1]], axis=-1)
    return combine(local, excl[..., None]).reshape(x.shape[:-1] + (nb * c,))[..., :n]


@struct.dataclass
class EnsureResult:
    """Output of :func:`ensure` for ``L`` layers and ``R`` requests per layer.

    page_table [L, P], slot_owner [L, S], last_used [L, S]: the new LRU state (int32).
    slots [L, R]: slot of each request (-1 for padding and dropped requests).
    fetch_src [L, R], fetch_dst [L, R]: logical page -> slot copies the step needs
      (-1 = nothing to move); at most one entry per distinct missed page.
    fetch_payload [L, R]: for each fetch entry, the ``payload`` value of the request that
      brought the page (e.g. where a copy of it already is); -1 elsewhere.
    hits, misses, evictions, dropped: int32 counts over all layers (distinct pages).
    """

    page_table: jax.Array
    slot_owner: jax.Array
    last_used: jax.Array
    slots: jax.Array
    fetch_src: jax.Array
    fetch_dst: jax.Array
    fetch_payload: jax.Array
    hits: jax.Array
    misses: jax.Array
    evictions: jax.Array
    dropped: jax.Array


def _ensure_layer(page_table, slot_owner, last_used, requests, protect, payload, step):
    """One layer. page_table [P], slot_owner/last_used [S], requests [R], protect [Q]."""
    P = page_table.shape[0]
    S = slot_owner.shape[0]
    R = requests.shape[0]
    idx = jnp.arange(R, dtype=jnp.int32)

    valid = (requests >= 0) & (requests < P)
    req = jnp.where(valid, requests, P).astype(jnp.int32)  # padding sorts last
    sorted_req, order = jax.lax.sort_key_val(req, idx)
    s_valid = sorted_req < P
    prev = jnp.concatenate([jnp.full((1,), -2, jnp.int32), sorted_req[:-1]])
    first = s_valid & (sorted_req != prev)

    safe_req = jnp.minimum(sorted_req, P - 1)
    cur = jnp.where(s_valid, page_table[safe_req], INVALID)
    hit = first & (cur >= 0)
    miss = first & (cur < 0)

    # Protected slots: hits of this step and resident protected pages.
    prot = jnp.zeros((S,), jnp.bool_).at[jnp.where(hit, cur, S)].set(True, mode="drop")
    pvalid = (protect >= 0) & (protect < P)
    pslot = jnp.where(pvalid, page_table[jnp.clip(protect, 0, P - 1)], INVALID)
    prot = prot.at[jnp.where(pslot >= 0, pslot, S)].set(True, mode="drop")

    # Victim order: unprotected empty slots, then least recently used; ties by slot index.
    key = jnp.where(prot, _BIG, jnp.where(slot_owner < 0, -1, last_used))
    _, victims = jax.lax.sort_key_val(key, jnp.arange(S, dtype=jnp.int32))
    n_free = jnp.sum(~prot).astype(jnp.int32)

    rank = prefix_sum(miss.astype(jnp.int32)) - 1
    assigned = miss & (rank < n_free)
    new_slot = victims[jnp.clip(rank, 0, S - 1)]
    lead_slot = jnp.where(hit, cur, jnp.where(assigned, new_slot, INVALID))

    # Duplicates take the slot of the first occurrence (the run's leader in sorted order).
    leader = prefix_max(jnp.where(first, idx, 0))
    s_slot = jnp.where(s_valid, lead_slot[leader], INVALID)
    slots = jnp.zeros((R,), jnp.int32).at[order].set(s_slot)

    # State update: evict old owners, install new pages, touch everything used.
    dst = jnp.where(assigned, new_slot, S)
    old_owner = jnp.where(assigned, slot_owner[jnp.clip(dst, 0, S - 1)], INVALID)
    evicted = old_owner >= 0
    page_table = page_table.at[jnp.where(evicted, old_owner, P)].set(INVALID, mode="drop")
    page_table = page_table.at[jnp.where(assigned, sorted_req, P)].set(new_slot, mode="drop")
    slot_owner = slot_owner.at[dst].set(sorted_req, mode="drop")
    last_used = last_used.at[jnp.where(s_slot >= 0, s_slot, S)].set(step, mode="drop")

    # Fetch entries compacted at the front: the assigned misses are the first n_assigned
    # misses in page order, so an assigned miss's rank is its position.
    at = jnp.where(assigned, rank, R)
    fetch_src, fetch_dst, fetch_payload = (
        jnp.full((R,), INVALID, jnp.int32).at[at].set(v, mode="drop")
        for v in (sorted_req, new_slot, payload[order]))
    counts = jnp.stack([
        jnp.sum(hit), jnp.sum(miss), jnp.sum(evicted), jnp.sum(miss & ~assigned)
    ]).astype(jnp.int32)
    return page_table, slot_owner, last_used, slots, fetch_src, fetch_dst, fetch_payload, counts


def resolve_method(method: str, R: int, S: int, Q: int, implementation: str | None = None, *,
                   dense_max_elems: int | None = None,
                   pallas_max: int = PALLAS_AUTO_MAX) -> str:
    """The implementation ``ensure(..., method=method)`` runs for R requests, S slots and Q
    protected pages per layer: "pallas", "dense" or "sort". "auto": if
    R*R + S*S + R*S + Q*S <= dense_max_elems, "pallas" when the Pallas implementation is
    selected (``JAXKV_IMPL=pallas``, or on the GPU unless ``JAXKV_IMPL=xla``) and
    R, S, Q <= pallas_max, else "dense"; otherwise "sort". ``dense_max_elems=None``: the
    measured threshold (``DENSE_MAX_ELEMS`` on the GPU or with the Pallas implementation,
    ``DENSE_MAX_ELEMS_CPU`` for XLA off the GPU)."""
    pallas = _common.implementation_name(implementation) == "pallas"
    if dense_max_elems is None:
        gpu_like = pallas or _common.on_gpu()
        dense_max_elems = DENSE_MAX_ELEMS if gpu_like else DENSE_MAX_ELEMS_CPU
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "pallas" and max(R, S, Q) > PALLAS_MAX:
        raise ValueError(f"method 'pallas' needs R, S, Q <= {PALLAS_MAX}, got {R}, {S}, {Q}")
    if method == "auto":
        if R * R + S * S + R * S + Q * S > dense_max_elems:
            return "sort"
        return "pallas" if pallas and max(R, S, Q) <= min(pallas_max, PALLAS_MAX) else "dense"
    return method


def ensure(page_table, slot_owner, last_used, requests, protect, step, payload=None,
           method: str = "auto", implementation: str | None = None, *,
           dense_max_elems: int | None = None,
           pallas_max: int = PALLAS_AUTO_MAX) -> EnsureResult:
    """Make the requested pages of every layer resident (fixed shapes, all layers at once).

    Args:
      page_table: [L, P] int32, logical page -> slot (-1 = not resident).
      slot_owner: [L, S] int32, slot -> logical page (-1 = empty).
      last_used: [L, S] int32, step at which each slot was last used.
      requests: [L, R] int32 logical pages wanted this step (-1 = padding; duplicates ok).
      protect: [L, Q] int32 logical pages that must not be evicted (-1 = padding).
      step: int32 scalar, the current step (a strictly increasing clock).
      payload: optional [L, R] int32 carried to ``fetch_payload`` (default: -1).
      method: static str, "auto" | "dense" | "sort" | "pallas" (see
        :func:`resolve_method`); all give identical results. "pallas" writes the new page
        table into ``page_table``'s buffer (donate it under jit to avoid a copy).
      implementation: "pallas" | "xla" | None: what "auto" may use (``_common``'s rule).
      dense_max_elems, pallas_max: the thresholds of "auto" (:func:`resolve_method`).
    Returns:
      :class:`EnsureResult`.
    """
    step = jnp.asarray(step, jnp.int32)
    requests = requests.astype(jnp.int32)
    if payload is None:
        payload = jnp.full(requests.shape, INVALID, jnp.int32)
    name = resolve_method(method, requests.shape[-1], slot_owner.shape[-1], protect.shape[-1],
                          implementation, dense_max_elems=dense_max_elems, pallas_max=pallas_max)
    args = (page_table, slot_owner, last_used, requests, protect.astype(jnp.int32),
            payload.astype(jnp.int32), step)
    if name == "pallas":
        out = lru_ensure.ensure_layers_pallas(*args)
    else:
        layer = {"dense": _ensure_layer_dense, "sort": _ensure_layer}[name]
        out = jax.vmap(layer, in_axes=(0, 0, 0, 0, 0, 0, None))(*args)
    pt, so, lu, slots, src, dst, pay, counts = out
    c = jnp.sum(counts, axis=0)
    return EnsureResult(pt, so, lu, slots, src, dst, pay, c[0], c[1], c[2], c[3])
