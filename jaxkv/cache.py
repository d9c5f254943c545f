"""Host-tier paged KV cache state and its per-step operations.

:class:`HostTierCache` is a registered-dataclass pytree (donate it through ``jit``):

* ``host_kv``  [L*P, R] in ``pinned_host`` memory: every (layer, logical page) row.
* ``pool``     [L*S, R] on device: the resident rows (``layer * S + slot``).
* ``page_table`` [L, P], ``slot_owner`` [L, S], ``last_used`` [L, S]: the LRU state.
* ``step``: int32 clock for ``last_used``; ``counters``: :class:`CacheCounters`.

The host tier is the source of truth: new tokens are written through to it (and to the
pool row if the page is resident), so evicting a slot is only a rebind, never a write-back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
import numpy as np

from jaxkv import lru
from jaxkv.spec import INVALID, CacheSpec
from jaxkv.kernels import page_fetch, page_write


@struct.dataclass
class CacheCounters:
    """int32 scalar counters, summed over layers and steps.

    hits/misses: requested pages found resident / not resident (per-layer scheduling:
      distinct pages per layer and step; per-step scheduling: selected (KV head, page)
      entries, so a page two heads miss counts twice but is fetched once; with lagged
      selection a step's entries are counted before the step start installs them).
    evictions: resident pages displaced by a miss.
    dropped: missed pages that found no slot and were left out of attention (per-layer
      scheduling, pool smaller than the step's working set; pool-only attention of the
      lagged "step" schedule, which its pool bound makes impossible).
    overflow: per-step scheduling: pages of the step-start install (the previous step's
      selections, or with lagged selection this step's own pages) that found no pool slot to
      stay in; attention reads them from scratch rows or in place from the host tier (with
      pool-only attention they would count as ``dropped``, which its pool bound rules out).
    pages_fetched: host->device rows moved into the pool; host_reads: (KV head, page)
    entries attention read in place from the host tier (each 1/H of a page row); tokens_written:
    token rows written (per layer): through to the host tier, or into a resident cache.
    """

    hits: jax.Array
    misses: jax.Array
    evictions: jax.Array
    dropped: jax.Array
    overflow: jax.Array
    pages_fetched: jax.Array
    tokens_written: jax.Array
    host_reads: jax.Array

    @classmethod
    def zeros(cls) -> "CacheCounters":
        # distinct buffers: the whole state is donated, and a buffer may be donated once
        return cls(*[jnp.zeros((), jnp.int32) for _ in dataclasses.fields(cls)])

    def as_dict(self, spec: CacheSpec, *, host: bool = True) -> dict:
        """The counts as ints with the hit rate and the bytes they move; ``host=False`` (a
        resident cache): its token rows are written on the device, so no byte goes to the host."""
        d = {f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)}
        total = d["hits"] + d["misses"]
        d["hit_rate"] = d["hits"] / total if total else float("nan")
        d["bytes_host_to_device"] = (d["pages_fetched"] * spec.page_bytes
                                     + d["host_reads"] * (spec.page_bytes // spec.num_kv_heads))
        d["bytes_device_to_host"] = d["tokens_written"] * spec.token_bytes if host else 0
        return d


@struct.dataclass
class HostTierCache:
    host_kv: jax.Array
    pool: jax.Array
    page_table: jax.Array
    slot_owner: jax.Array
    last_used: jax.Array
    step: jax.Array
    counters: CacheCounters


def host_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def device_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="device")


def cache_shardings(device=None) -> HostTierCache:
    """Shardings of a :class:`HostTierCache` (host tier pinned, the rest on device)."""
    dev = device_sharding(device)
    return HostTierCache(
        host_kv=host_sharding(device), pool=dev, page_table=dev, slot_owner=dev,
        last_used=dev, step=dev,
        counters=CacheCounters(*([dev] * len(dataclasses.fields(CacheCounters)))))


def host_zeros(shape: tuple, dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """A zeroed array of ``shape`` / ``dtype`` in ``sharding``'s pinned_host memory, built on
    the host: no device buffer of its size at any point.

    A jitted ``jnp.zeros`` with a pinned_host output is computed on the device and then
    copied out (its compiled temp is the whole array): a host tier larger than the free
    device memory then fails with a device out-of-memory error (measured:
    docs/decisions.md). Here the source is ``np.zeros`` (calloc: pages that are only read stay
    the kernel's shared zero page, so it costs no RAM beside the pinned buffer), placed with
    ``jax.device_put``, which also types the result as host memory (a loop carry keeps it).
    ``sharding``: any sharding with ``memory_kind="pinned_host"`` (one device or a mesh).
    """
    if getattr(sharding, "memory_kind", None) != "pinned_host":
        raise ValueError(f"host_zeros needs a pinned_host sharding, got {sharding}")
    dt = jnp.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    src = np.zeros(n * dt.itemsize, np.uint8).view(dt).reshape(shape)
    return jax.device_put(src, sharding)


@functools.lru_cache(maxsize=None)
def _filler(shape: tuple, dtype: str, fill: str, sharding, traced: bool = False) -> callable:
    """A cached jitted allocator of a device array, so repeated cache construction never
    recompiles. ``traced``: the plain function (no jit, no placement), for use inside a jit
    or shard_map whose output shardings place the result (jaxkv.parallel). Host arrays are
    made by :func:`host_zeros` instead (a program would build them in device memory)."""
    if sharding.memory_kind != "device":
        raise ValueError(f"_filler makes device arrays; use host_zeros for {sharding}")

    def alloc():
        return jnp.full(shape, float(fill), dtype)

    return alloc if traced else jax.jit(alloc, out_shardings=sharding)


def init_cache(spec: CacheSpec, *, device=None, poison: bool = False,
               traced: bool = False) -> HostTierCache:
    """Empty cache: host tier zeroed in pinned_host memory (:func:`host_zeros`), pool empty.

    ``poison=True`` fills the pool with NaN (tests: an unwritten slot must never be read).
    ``traced=True``: plain jnp ops, to call inside a jit / shard_map (one device's shard of
    a multi-device cache, jaxkv.parallel); ``host_kv`` is then ``None``: the caller places
    a :func:`host_zeros` tier (built in a program, it would pass through device memory).
    """
    fill = "nan" if poison else "0"
    host_kv = None if traced else host_zeros(spec.host_shape, spec.dtype, host_sharding(device))
    pool = _filler(spec.pool_shape, spec.dtype, fill, device_sharding(device), traced)()
    L, P, S = spec.num_layers, spec.num_logical_pages, spec.num_slots
    return HostTierCache(
        host_kv=host_kv,
        pool=pool,
        page_table=jnp.full((L, P), INVALID, jnp.int32),
        slot_owner=jnp.full((L, S), INVALID, jnp.int32),
        last_used=jnp.full((L, S), INVALID, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        counters=CacheCounters.zeros(),
    )


def _global_rows(local, layer, per_layer):
    """local [..] (-1 = none) -> layer * per_layer + local; -1 where local is -1 or out of
    range (an out-of-range page must never land in another layer's rows)."""
    ok = (local >= 0) & (local < per_layer)
    return jnp.where(ok, layer * per_layer + local, INVALID).astype(jnp.int32)


def ensure_resident(spec: CacheSpec, cache: HostTierCache, requests, protect, *,
                    layers=None, implementation=None, **ensure_options):
    """Make requested pages resident: LRU ensure of all given layers, then ONE fetch launch.

    Args:
      requests: [Lr, R] int32 logical pages per layer (-1 padding; duplicates fine).
      protect: [Lr, Q] int32 logical pages that must stay resident (-1 padding).
      layers: [Lr] int32 layer ids of the rows of ``requests`` (default: all L layers).
      ensure_options: ``lru.ensure``'s method and thresholds.
    Returns:
      (cache, slots [Lr, R] int32 global pool rows of each request, -1 if padding/dropped).
    """
    if layers is None:
        layers = jnp.arange(spec.num_layers, dtype=jnp.int32)
    layers = jnp.asarray(layers, jnp.int32)
    res = lru.ensure(cache.page_table[layers], cache.slot_owner[layers],
                     cache.last_used[layers], requests, protect, cache.step,
                     implementation=implementation, **ensure_options)
    lcol = layers[:, None]
    src = _global_rows(res.fetch_src, lcol, spec.num_logical_pages)
    dst = _global_rows(res.fetch_dst, lcol, spec.num_slots)
    pool = page_fetch.fetch_pages(cache.host_kv, cache.pool, src.reshape(-1), dst.reshape(-1),
                                  implementation=implementation)
    fetched = jnp.sum(res.fetch_src >= 0).astype(jnp.int32)
    c = cache.counters
    counters = dataclasses.replace(
        c, hits=c.hits + res.hits, misses=c.misses + res.misses,
        evictions=c.evictions + res.evictions, dropped=c.dropped + res.dropped,
        pages_fetched=c.pages_fetched + fetched)
    cache = dataclasses.replace(
        cache, pool=pool,
        page_table=cache.page_table.at[layers].set(res.page_table),
        slot_owner=cache.slot_owner.at[layers].set(res.slot_owner),
        last_used=cache.last_used.at[layers].set(res.last_used),
        counters=counters)
    return cache, _global_rows(res.slots, lcol, spec.num_slots)


def write_through(spec: CacheSpec, cache: HostTierCache, layer, logical_pages, offsets, kv, *,
                  implementation=None) -> HostTierCache:
    """Write one new token per entry to the host tier and, if resident, to its pool row.

    Args:
      layer: int32 scalar or [M] layer of each entry.
      logical_pages: [M] int32 logical page of each token (-1 = inactive, writes nothing).
      offsets: [M] int32 token offset within the page.
      kv: [M, 2, H, D] the token's K and V.
    """
    layer = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), logical_pages.shape)
    slot = cache.page_table[layer, jnp.clip(logical_pages, 0, spec.num_logical_pages - 1)]
    slot = jnp.where(logical_pages >= 0, slot, INVALID)
    host_kv, pool = page_write.write_tokens_pair(
        cache.host_kv, _global_rows(logical_pages, layer, spec.num_logical_pages), cache.pool,
        _global_rows(slot, layer, spec.num_slots), offsets, kv, page_size=spec.page_size,
        implementation=implementation)
    written = jnp.sum(logical_pages >= 0).astype(jnp.int32)
    counters = dataclasses.replace(cache.counters,
                                   tokens_written=cache.counters.tokens_written + written)
    return dataclasses.replace(cache, host_kv=page_write.keep_on_host(host_kv), pool=pool,
                               counters=counters)


def tick(cache: HostTierCache) -> HostTierCache:
    """Advance the LRU clock (once per decode step)."""
    return dataclasses.replace(cache, step=cache.step + 1)


@struct.dataclass
class ResidentCache:
    """The baseline: every (layer, logical page) row on device, ``pool`` [L*P, R].

    Row ``layer * P + logical_page``, the same layout as the host tier.
    """

    pool: jax.Array
    counters: CacheCounters


def init_resident(spec: CacheSpec, *, device=None, poison: bool = False,
                  traced: bool = False) -> ResidentCache:
    """Resident KV for ``spec`` (its ``num_slots`` is ignored: all P pages are on device).
    ``traced``: as in :func:`init_cache`."""
    fill = "nan" if poison else "0"
    pool = _filler(spec.host_shape, spec.dtype, fill, device_sharding(device), traced)()
    return ResidentCache(pool=pool, counters=CacheCounters.zeros())


def write_resident(spec: CacheSpec, cache: ResidentCache, layer, logical_pages, offsets, kv, *,
                   implementation=None) -> ResidentCache:
    """Resident counterpart of :func:`write_through` (same arguments)."""
    layer = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), logical_pages.shape)
    rows = _global_rows(logical_pages, layer, spec.num_logical_pages)
    pool = page_write.write_tokens(cache.pool, rows, offsets, kv, page_size=spec.page_size,
                                   implementation=implementation)
    written = jnp.sum(logical_pages >= 0).astype(jnp.int32)
    counters = dataclasses.replace(cache.counters,
                                   tokens_written=cache.counters.tokens_written + written)
    return dataclasses.replace(cache, pool=pool, counters=counters)
