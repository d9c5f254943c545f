"""Residency: where each page a layer attends to is read from, one object per schedule.

A decode step runs, per layer: select -> residency (map the pages to rows, fetching or
recording misses) -> attend -> write-through. The schedules (``CacheConfig.mode`` and
``schedule``) differ only in the residency part and in what happens once per step:

* :class:`Resident`: every page on device; row = ``layer * P + logical page``.
* :class:`InPlace` (host tier, schedule "step", the default): at the step start ONE LRU
  ensure for all layers installs the previous step's selections into pool slots (with lagged
  selection: this step's own pages) and ONE launch fetches them; per layer one lookup kernel
  maps the pages to pool rows, records the selection for the next install and writes the new
  token through; pages missing from the pool are read in place from pinned host memory by
  the attention kernel. Hits, misses and host reads are counted once at the step end.
* :class:`Scratch` (schedule "scratch"): as "step", but each layer first copies its misses
  into per-layer scratch rows of the pool (one fetch launch per layer), so attention reads
  device memory only.
* :class:`PerLayer` (schedule "layer"): a full LRU ensure and fetch before each layer's
  attention; misses beyond the pool are dropped from attention and counted.

Every method is traced inside the compiled step: fixed shapes, ``-1`` sentinels, counters
for what could go wrong silently (``dropped``, ``overflow``, ``host_reads``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import cache as kvcache
from jaxkv import lru
from jaxkv.kernels import layer_lookup, page_fetch, page_write
from jaxkv.plan import Plan
from jaxkv.spec import INVALID


def ensure_options(plan: Plan) -> dict:
    """The LRU ensure's method and thresholds (``jaxkv.Tuning``)."""
    t = plan.tuning
    return dict(method=t.ensure_method, dense_max_elems=t.ensure_dense_max_elems,
                pallas_max=t.ensure_pallas_max)


def protected_pages(plan: Plan, pos, active):
    """Pinned pages (sinks and the most recent pages) as logical ids [B * pinned], -1 pad."""
    B, Np = plan.batch, plan.pages_per_seq
    cur = pos // plan.page_size
    sinks = jnp.broadcast_to(jnp.arange(plan.cache.sink_pages, dtype=jnp.int32), (B, plan.cache.sink_pages))
    recent = cur[:, None] - jnp.arange(plan.cache.recent_pages, dtype=jnp.int32)[None, :]
    pages = jnp.concatenate([sinks, recent], axis=1)
    ok = (pages >= 0) & (pages <= cur[:, None]) & active[:, None]
    logical = jnp.arange(B, dtype=jnp.int32)[:, None] * Np + pages
    return jnp.where(ok, logical, INVALID).reshape(-1)


def install_previous(plan: Plan, kv, lookahead, protect):
    """Per-step scheduling, step start: one LRU ensure over all layers for the previous
    step's selections (with lagged selection in "step": this step's own pages, so no layer
    reads a page over PCIe), then one launch that copies the pages it assigned slots to into
    the pool: from the host tier ("step") or from the scratch rows they were fetched into
    ("scratch")."""
    spec = plan.spec
    L, S, P = spec.num_layers, spec.num_slots, spec.num_logical_pages
    sel = lookahead[0]
    prot = jnp.broadcast_to(protect, (L, protect.shape[-1]))
    lcol = jnp.arange(L, dtype=jnp.int32)[:, None]
    impl = plan.cache.implementation
    c = kv.counters
    if plan.in_place:
        res = lru.ensure(kv.page_table, kv.slot_owner, kv.last_used, sel, prot, kv.step,
                         implementation=impl, **ensure_options(plan))
        ok = res.fetch_dst >= 0
        # Per-layer lists (compacted by the ensure): a zero-miss step is one small launch.
        pool = page_fetch.fetch_layer_pages(kv.host_kv, kv.pool, res.fetch_src, res.fetch_dst,
                                            src_stride=P, dst_stride=S, implementation=impl)
        # The host tier is written in place later in the step; tie it to the fetch's result so
        # XLA orders that write after this read instead of copying the whole host array.
        host_kv, pool = jax.lax.optimization_barrier((kv.host_kv, pool))
        kv = dataclasses.replace(kv, host_kv=host_kv)
        c = dataclasses.replace(c, pages_fetched=c.pages_fetched + jnp.sum(ok).astype(jnp.int32))
    else:
        res = lru.ensure(kv.page_table, kv.slot_owner, kv.last_used, sel, prot, kv.step,
                         payload=lookahead[1], implementation=impl, **ensure_options(plan))
        dst = jnp.where(res.fetch_dst >= 0, lcol * S + res.fetch_dst, INVALID)
        pool = page_fetch.move_rows(kv.pool, res.fetch_payload.reshape(-1), dst.reshape(-1),
                                    implementation=impl)
    counters = dataclasses.replace(c, evictions=c.evictions + res.evictions,
                                   overflow=c.overflow + res.dropped)
    return dataclasses.replace(kv, pool=pool, page_table=res.page_table,
                               slot_owner=res.slot_owner, last_used=res.last_used,
                               counters=counters)


def _first_occurrence(sel):
    """sel [B, H, k] logical pages -> (is_dup [B, H, k], leader flat index into [H*k]).

    An entry is a duplicate if an earlier KV head of the same request selected the same page;
    its leader is the first such entry. Fixed shapes: an [B, H*k, H*k] comparison."""
    B, H, k = sel.shape
    flat = sel.reshape(B, H * k)
    head = jnp.repeat(jnp.arange(H, dtype=jnp.int32), k)
    eq = (flat[:, :, None] == flat[:, None, :]) & (head[None, None, :] < head[None, :, None])
    eq &= flat[:, :, None] >= 0
    is_dup = jnp.any(eq, axis=-1)
    leader = jnp.where(is_dup, jnp.argmax(eq, axis=-1), jnp.arange(H * k, dtype=jnp.int32)[None])
    return is_dup.reshape(B, H, k), leader.astype(jnp.int32)


def lookup_in_place(plan: Plan, kv, layer, pages, active, logical, offset, tok_kv, record):
    """Per-step scheduling "step", one layer: map the selection to rows, record it for the next
    step's install and write the new token through (its pool row if its page is resident, in
    the same launch, then the host tier). Resident pages are read from their slots, missed
    pages in place from the host tier by the attention kernel.

    pages [B, H, k] the selector's pages (-1 pad; inactive requests are masked here); active
    [B]; logical [B] the new token's logical page (-1 = inactive), offset [B] its offset;
    tok_kv [B, 2, H, D]; record [L, R] the step's selections. Returns (kv, rows [B, H, k] pool
    rows or -1, host_rows [B, H, k] host rows or -1, record). Hit/miss counters are added once
    per step by :func:`count_in_place` (the page table does not change within a step)."""
    impl = plan.cache.implementation
    pool, record, rows, host_rows, tok_host_rows = layer_lookup.layer_lookup(
        pages, active, logical, offset, tok_kv, kv.page_table, layer, kv.pool, record,
        pages_per_seq=plan.pages_per_seq, page_size=plan.page_size, reuse=plan.cache.reuse,
        slots_per_layer=plan.spec.num_slots, implementation=impl)
    host_kv = page_write.write_tokens(kv.host_kv, tok_host_rows, offset, tok_kv,
                                      page_size=plan.page_size, implementation=impl)
    kv = dataclasses.replace(kv, pool=pool, host_kv=page_write.keep_on_host(host_kv))
    return kv, rows, host_rows, record


def _resident_entries(plan: Plan, page_table, sel_all):
    """sel_all [L, R] logical pages (-1 pad) -> (hits, misses) int32 scalars: the selected
    (KV head, page) entries with / without a slot in ``page_table``."""
    P = plan.spec.num_logical_pages
    lcol = jnp.arange(sel_all.shape[0], dtype=jnp.int32)[:, None]
    slot = jnp.where(sel_all >= 0, page_table[lcol, jnp.clip(sel_all, 0, P - 1)], INVALID)
    if not plan.cache.reuse:
        slot = jnp.full_like(slot, INVALID)
    n_hit = jnp.sum(slot >= 0).astype(jnp.int32)
    n_miss = jnp.sum((sel_all >= 0) & (slot < 0)).astype(jnp.int32)
    return n_hit, n_miss


def count_in_place(plan: Plan, kv, sel_all, n_active, before=None, pool_only=False):
    """Per-step scheduling "step", once at the step end: hits, misses (= host reads) and
    tokens written of the step's sparse layers, counted against the current page table.
    sel_all [L, R] the step's selections (-1 pad; the dense layers' rows are all -1); n_active
    int32 scalar. ``before``: (hits, misses) of the same entries before this step's install of
    its own pages (lagged selection), counted instead; the misses after it are host
    reads, or with ``pool_only`` (attention had no host operand) ``dropped``: left out of
    attention (never, by ``pool_only_reads``; counted so a broken bound shows)."""
    n_hit, n_read = _resident_entries(plan, kv.page_table, sel_all)  # dense layers' rows: -1
    n_miss = n_read
    if before is not None:
        n_hit, n_miss = before
    c = kv.counters
    written = (plan.spec.num_layers - plan.num_dense) * n_active
    lost = {"dropped": c.dropped + n_read} if pool_only else {"host_reads": c.host_reads + n_read}
    counters = dataclasses.replace(c, hits=c.hits + n_hit, misses=c.misses + n_miss,
                                   tokens_written=c.tokens_written + written, **lost)
    return dataclasses.replace(kv, counters=counters)


def lookup_and_fetch(plan: Plan, kv, layer, sel):
    """Per-step scheduling, one layer: resident pages are read from their slots, missed pages
    are fetched (once per request) into this layer's scratch rows. sel [B, H, k] logical
    pages (-1 pad). Returns (kv, rows [B, H, k] global pool rows, scratch rows [E] or -1)."""
    spec = plan.spec
    L, S, P, E = spec.num_layers, spec.num_slots, spec.num_logical_pages, spec.num_scratch
    B, H, k = sel.shape
    per_req = plan.scratch_per_request
    slot = jnp.where(sel >= 0, kv.page_table[layer, jnp.clip(sel, 0, P - 1)], INVALID)
    if not plan.cache.reuse:
        slot = jnp.full_like(slot, INVALID)
    miss = (sel >= 0) & (slot < 0)
    is_dup, leader = _first_occurrence(sel)
    fetch = (miss & ~is_dup).reshape(B, H * k)
    # Each request's fetched (distinct) pages take its scratch rows in order: < per_req.
    rank = lru.prefix_sum(fetch.astype(jnp.int32)) - 1
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    scratch = jnp.where(fetch, L * S + layer * E + b_idx * per_req + rank, INVALID)  # [B, H*k]
    lead_scratch = jnp.take_along_axis(scratch, leader, axis=1).reshape(B, H, k)
    rows = jnp.where(slot >= 0, layer * S + slot, jnp.where(miss, lead_scratch, INVALID))
    fetch = fetch.reshape(B, H, k)
    src = jnp.where(fetch, layer * P + sel, INVALID).reshape(-1)
    dst = scratch.reshape(-1)
    pool = page_fetch.fetch_pages(kv.host_kv, kv.pool, src, dst,
                                  implementation=plan.cache.implementation)
    c = kv.counters
    counters = dataclasses.replace(
        c, hits=c.hits + jnp.sum(slot >= 0).astype(jnp.int32),
        misses=c.misses + jnp.sum(miss).astype(jnp.int32),
        pages_fetched=c.pages_fetched + jnp.sum(fetch).astype(jnp.int32))
    return dataclasses.replace(kv, pool=pool, counters=counters), rows, dst


def pool_only_reads(plan: Plan) -> bool:
    """With the lagged install of the step's own pages: can no page be dropped? A layer's
    requests (``B * H * k``) and pinned pages (``B * (sink + recent)``) are all the slots a
    step protects, so a pool of at least that many slots (the engine's default) always has a
    free slot for every miss. Attention then takes no host operand (a leaner kernel). Were a
    page left out all the same, the ensure would count it (``overflow``) and the step's count
    (``count_in_place``) in ``dropped``."""
    return plan.spec.num_slots >= plan.step_pages


def lagged_requests(plan: Plan, ahead, active):
    """Lagged selection: the step's pages ``ahead`` [L, B, H, k] (request-local, -1 pad) as the
    install's requests [L, B * H * k] logical pages (-1: padding, inactive requests, the dense
    layers), in the order of the lookup's record."""
    L, B = plan.model.num_layers, plan.batch
    b = jnp.arange(B, dtype=jnp.int32)[None, :, None, None]
    sparse = jnp.asarray(plan.sparse_mask)[:, None, None, None]
    ok = (ahead >= 0) & active[None, :, None, None] & sparse
    return jnp.where(ok, b * plan.pages_per_seq + ahead, INVALID).reshape(L, -1)


def _logical_selection(plan: Plan, pages, b_idx):
    """pages [B, H, k] within-sequence (-1 pad) -> logical page ids (request-major); b_idx
    [B] the requests' indices."""
    return jnp.where(pages >= 0, b_idx[:, None, None] * plan.pages_per_seq + pages, INVALID)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One residency schedule (the module docstring lists them). The decode step calls, in
    this order: :meth:`begin` once, then per sparse layer :meth:`write` (the new token, before
    the selection) and :meth:`rows` (after it), then :meth:`end` and :meth:`tick` once; the
    dense layers (``plan.dense_set``) call :meth:`write_dense` instead."""

    #: The per-layer lookup masks inactive requests' pages itself (the step need not).
    lookup_masks_inactive = False

    def begin(self, plan: Plan, kv, lookahead, ahead, active, protect):
        """Step start. ``lookahead``: the previous step's per-step record; ``ahead`` [L, B,
        H, k]: this step's own pages (lagged selection) or None. Returns (kv, before,
        pool_only): ``before`` the (hits, misses) of this step's entries before an install of
        them, or None; ``pool_only``: attention never needs a host operand."""
        return kv, None, False

    def write(self, plan: Plan, kv, layer, logical, offset, tok_kv):
        """The new token's K/V [B, 2, H, D] at logical page ``logical`` [B] (-1: inactive),
        offset ``offset`` [B]."""
        return kvcache.write_through(plan.spec, kv, layer, logical, offset, tok_kv,
                                     implementation=plan.cache.implementation)

    def write_dense(self, plan: Plan, kv, dense, layer, logical, offset, tok_kv):
        """A dense layer's new token. Returns (kv, dense, the pool that holds every page of
        the layer, the layer's index in that pool)."""
        impl = plan.cache.implementation
        kv = kvcache.write_through(plan.spec, kv, layer, logical, offset, tok_kv,
                                   implementation=impl)
        slot = plan.dense_slot(layer)
        dense = kvcache.write_resident(plan.spec, dense, slot, logical, offset, tok_kv,
                                       implementation=impl)
        return kv, dense, dense.pool, slot

    def rows(self, plan: Plan, kv, layer, pages, look, *, b_idx, active, logical, offset,
             tok_kv, protect, pool_only):
        """Map one layer's pages [B, H, k] (-1 pad, inactive requests masked unless
        ``lookup_masks_inactive``) to pool rows; b_idx [B] the requests' indices. Returns (kv, rows [B, H, k], attention's
        host-tier operands (a dict, empty when it reads the pool only), look)."""
        raise NotImplementedError

    def end(self, plan: Plan, kv, look, active, before, pool_only):
        """Once per step after the layers (counters); active [B] the step's active requests."""
        return kv

    def tick(self, kv):
        """Advance the LRU clock at the step's very end."""
        return kvcache.tick(kv)


@dataclasses.dataclass(frozen=True)
class Resident(Schedule):
    """Every page on device: no fetch, no LRU."""

    def write(self, plan, kv, layer, logical, offset, tok_kv):
        return kvcache.write_resident(plan.spec, kv, layer, logical, offset, tok_kv,
                                      implementation=plan.cache.implementation)

    def write_dense(self, plan, kv, dense, layer, logical, offset, tok_kv):
        kv = self.write(plan, kv, layer, logical, offset, tok_kv)
        return kv, dense, kv.pool, layer

    def rows(self, plan, kv, layer, pages, look, *, b_idx, **_):
        sel = _logical_selection(plan, pages, b_idx)
        P = plan.spec.num_logical_pages
        return kv, jnp.where(sel >= 0, layer * P + sel, INVALID), {}, look

    def tick(self, kv):
        return kv


@dataclasses.dataclass(frozen=True)
class PerLayer(Schedule):
    """Host tier, schedule "layer": a full LRU ensure and fetch before each layer's attention."""

    def rows(self, plan, kv, layer, pages, look, *, b_idx, protect, **_):
        sel = _logical_selection(plan, pages, b_idx)
        kv, rows = kvcache.ensure_resident(plan.spec, kv, sel.reshape(1, -1), protect,
                                           layers=layer[None],
                                           implementation=plan.cache.implementation,
                                           **ensure_options(plan))
        return kv, rows.reshape(sel.shape), {}, look


@dataclasses.dataclass(frozen=True)
class Scratch(Schedule):
    """Host tier, schedule "scratch": misses copied into scratch rows per layer; the step start
    installs the previous step's selections from those rows."""

    def begin(self, plan, kv, lookahead, ahead, active, protect):
        if plan.cache.reuse:
            kv = install_previous(plan, kv, lookahead, protect)
        return kv, None, False

    def rows(self, plan, kv, layer, pages, look, *, b_idx, **_):
        sel = _logical_selection(plan, pages, b_idx)
        kv, rows, scr = lookup_and_fetch(plan, kv, layer, sel)
        return kv, rows, {}, (look[0].at[layer].set(sel.reshape(-1)), look[1].at[layer].set(scr))


@dataclasses.dataclass(frozen=True)
class InPlace(Schedule):
    """Host tier, schedule "step" (the default): misses read in place from pinned host memory
    by attention; one install per step."""

    lookup_masks_inactive = True

    def begin(self, plan, kv, lookahead, ahead, active, protect):
        if not plan.cache.reuse:
            return kv, None, False
        before = None
        if ahead is not None:  # lagged: install the pages this step attends to
            lookahead = (lagged_requests(plan, ahead, active),)
            before = _resident_entries(plan, kv.page_table, lookahead[0])
        kv = install_previous(plan, kv, lookahead, protect)
        return kv, before, ahead is not None and pool_only_reads(plan)

    def write(self, plan, kv, layer, logical, offset, tok_kv):
        return kv  # written by the layer's lookup, after the selection

    def rows(self, plan, kv, layer, pages, look, *, active, logical, offset, tok_kv, pool_only,
             **_):
        kv, rows, host_rows, record = lookup_in_place(plan, kv, layer, pages, active, logical,
                                                      offset, tok_kv, look[0])
        # pages the pool could not take are read in place from the host
        host = {} if pool_only else dict(host=kv.host_kv, host_rows=host_rows)
        return kv, rows, host, (record,)

    def end(self, plan, kv, look, active, before, pool_only):
        return count_in_place(plan, kv, look[0], jnp.sum(active).astype(jnp.int32), before,
                              pool_only)


def schedule_for(plan: Plan) -> Schedule:
    """The residency schedule of ``plan`` (``CacheConfig.mode`` / ``schedule``)."""
    if plan.cache.mode == "resident":
        return Resident()
    return {"step": InPlace, "scratch": Scratch, "layer": PerLayer}[plan.cache.schedule]()
