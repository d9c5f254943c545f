"""Synthetic long contexts for the benchmarks: a ready-to-decode :class:`engine.DecodeState`
without a prefill.

:func:`build_state` fills the host tier (or the resident pool) of a :class:`engine.Plan` with
random K/V page by page on the device, in chunks written with ``page_write.write_pages`` (a
64+ GiB host tier never has a device copy), and builds the selector summaries (Quest
``kmax``/``kmin``, indexer page sums) from the same keys, so selection is consistent with
the data. :func:`reuse_state` rebinds a filled tier to another plan (pool size, selector,
round length) and resets the sequence lengths, so one fill serves several configurations.
Both take ``tp`` (a ``jaxkv.parallel.TensorParallel``) to fill and rebind every device's
shard of a tensor-parallel state (each device draws its own stream).

Key model (per layer, request, KV head and page ``p``; ``n_t ~ N(0, I)`` per token):
``k_t = c_p + exp(salience * g_p) * n_t`` with a page centre ``c_p ~ N(0, center_scale^2 I)``
and a page "salience" ``g_p ~ N(0, 1)``; values are ``N(0, value_scale^2)``. Quest's
upper-bound score is about ``q . c_p + exp(salience * g_p) * |q|_1 * E[max n]``: the first
term changes with every query, the second is the same for every query, so ``salience``
sets how persistent the selection is, i.e. the step-to-step selection overlap (``0``: a
fresh random selection every step; large: the same pages every step).
:func:`calibrate_salience` finds the salience that gives a target overlap, by simulating
the selector on generated summaries with ``N(0, 1)`` queries (what a random-weight model
produces); :func:`trace_selections` records the selections of a real decode (resident
plans) and :func:`selection_overlap` measures their overlap. Indexer index keys use the
same model with the salience on the page centre's norm (not calibrated separately).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvcache
from jaxkv import engine, parallel, selectors
from jaxkv.selectors import rescore
from jaxkv.spec import INVALID
from jaxkv.models import llama
from jaxkv.kernels import kv_quant, page_write, quest
from jaxkv.kernels import candidate_mass as mass_kernels
from jaxkv.kernels import indexer as indexer_ops
from jaxkv.kernels.candidate_select import top_candidates
from jaxkv.kernels.sparse_attention import sparse_paged_attention

DEFAULT_CHUNK_BYTES = 256 * 2**20  # K/V bytes generated and written per fill call


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """How synthetic keys and values are drawn (see the module docstring).

    salience: persistence knob (>= 0); traced in the fill, so changing it never recompiles.
    center_scale: std of the page centres. value_scale: std of the values.
    """

    salience: float = 0.0
    center_scale: float = 1.0
    value_scale: float = 1.0

    def __post_init__(self):
        for f in ("salience", "center_scale", "value_scale"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Synthetic.{f} must be a finite number >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static description of a fill (the jit key)."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    num_logical_pages: int
    kv_dtype: str
    model_dtype: str
    selector: str      # "quest", "indexer" or "dense" (what the summaries hold)
    key_bits: int      # rescoring selectors: precision of their key copy (0: no copy)
    quest_block: int   # pages per Quest bound (the two-stage selectors' first-stage block)
    bounds_int8: bool  # Quest's bounds in int8 with a scale per block (CacheConfig.bounds_int8)
    index_dim: int
    chunk_pages: int
    center_scale: float
    value_scale: float
    host: bool
    implementation: str | None


# --------------------------------------------------------------------------------------
# the generator (shared by the fill and the calibration)
# --------------------------------------------------------------------------------------
_U32 = jnp.uint32


def _mix(h):
    """murmur3's 32-bit finalizer (a bijection that scrambles every bit)."""
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _combine(h, x):
    """Hash of (h, x) for uint32 h and integer x (broadcasting)."""
    return _mix(h ^ (jnp.asarray(x).astype(jnp.uint32) * _U32(0x9E3779B1) + _U32(0x7F4A7C15)))


def _normal(base, stream: int, shape) -> jax.Array:
    """Counter-based N(0, 1) draws [shape] f32 from a uint32 ``base`` (Box-Muller on hashes)."""
    n = math.prod(shape)
    h = _combine(_combine(base, stream), jnp.arange(n, dtype=jnp.uint32))
    u1 = ((_mix(h ^ _U32(0x68E31DA4)) >> 8).astype(jnp.float32) + 0.5) * (2.0 ** -24)
    u2 = (_mix(h ^ _U32(0xB5297A4D)) >> 8).astype(jnp.float32) * (2.0 ** -24)
    z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos((2.0 * math.pi) * u2)
    return z.reshape(shape)


def _page_key(seed, layer, b, page):
    """uint32 key of one (layer, request, page): independent of chunking and capacity."""
    h = _combine(_U32(0x2545F491), seed)
    return _combine(_combine(_combine(h, layer), b), page)


def _page_keys(pk, salience, *, H, D, ps, center_scale):
    """Post-RoPE keys of one page for all KV heads: [H, ps, D] f32."""
    spread = jnp.exp(salience * _normal(pk, 0, (H,)))
    centre = center_scale * _normal(pk, 1, (H, 1, D))
    return centre + spread[:, None, None] * _normal(pk, 2, (H, ps, D))


def _page_values(pk, *, H, D, ps, value_scale):
    """Values of one page: [H, ps, D] f32."""
    return value_scale * _normal(pk, 3, (H, ps, D))


def _page_index_keys(pk, salience, *, dI, ps):
    """Indexer index keys of one page: [ps, dI] f32 (salience scales the centre's norm)."""
    scale = jnp.exp(salience * _normal(pk, 4, ()))
    return scale * _normal(pk, 5, (1, dI)) + _normal(pk, 6, (ps, dI))


def _quest_summary(keys, valid, dtype):
    """keys [H, ps, D] f32, valid [ps] bool -> (kmax, kmin) [H, D] in ``dtype`` (of the stored keys)."""
    k = keys.astype(dtype)
    m = valid[None, :, None]
    return (jnp.where(m, k, -jnp.inf).max(axis=1).astype(dtype),
            jnp.where(m, k, jnp.inf).min(axis=1).astype(dtype))


def _index_summary(ikeys, valid, model_dtype):
    """ikeys [ps, dI] f32 -> page sum [dI] f32 of the valid tokens (keys rounded to the model dtype)."""
    return jnp.where(valid[:, None], ikeys.astype(model_dtype).astype(jnp.float32), 0.0).sum(axis=0)


# --------------------------------------------------------------------------------------
# fill
# --------------------------------------------------------------------------------------
def _fill_chunk(lay: _Layout, dst, summaries, layer, b, j0, length, key, salience):
    """Generate pages ``[j0, j0 + chunk)`` of (layer, b), write the used ones, update summaries."""
    summaries_in = summaries
    H, D, ps, C = lay.num_kv_heads, lay.head_dim, lay.page_size, lay.chunk_pages
    kv_dt, m_dt = jnp.dtype(lay.kv_dtype), jnp.dtype(lay.model_dtype)
    pages = j0 + jnp.arange(C, dtype=jnp.int32)
    tok = jnp.arange(ps, dtype=jnp.int32)

    def one(p):
        pk = _page_key(key, layer, b, p)
        keys = _page_keys(pk, salience, H=H, D=D, ps=ps, center_scale=lay.center_scale)
        vals = _page_values(pk, H=H, D=D, ps=ps, value_scale=lay.value_scale)
        # the barrier pins the stored values: the summaries read exactly what is written
        # (fp8 / int8: the rows carry scales; the summaries, like the prefill's, read the keys in
        # the model's dtype)
        if kv_quant.is_quantized(kv_dt):
            row = jax.lax.optimization_barrier(kv_quant.encode_rows(jnp.stack([keys, vals]), kv_dt))
            stored = keys.astype(m_dt)
        else:
            row = jax.lax.optimization_barrier(jnp.stack([keys, vals]).astype(kv_dt))
            stored = row[0]
        valid = p * ps + tok < length
        out = {"row": row.reshape(-1)}                                # [2, H, ps, D] flat (+ scales)
        if lay.selector == "quest":
            out["kmax"], out["kmin"] = _quest_summary(stored, valid, stored.dtype)
            if lay.key_bits:
                out["keys"], out["scales"] = rescore.quantize(stored, lay.key_bits)
        elif lay.selector == "indexer":
            ik = _page_index_keys(pk, salience, dI=lay.index_dim, ps=ps)
            out["isum"] = _index_summary(ik, valid, m_dt)
        return out

    out = jax.vmap(one)(pages)
    used = (pages * ps < length) & (pages < lay.pages_per_seq)
    rows = jnp.where(used, layer * lay.num_logical_pages + b * lay.pages_per_seq + pages, INVALID)
    dst = page_write.write_pages(dst, rows, out["row"], implementation=lay.implementation)
    if lay.host:
        dst = page_write.keep_on_host(dst)
    if lay.selector == "quest" and lay.bounds_int8:
        # each block's bounds quantized once, as the prefill does (blocks with no token: 0);
        # a chunk holds whole blocks of r pages (_chunk_pages)
        r = lay.quest_block
        kmax = out["kmax"].reshape(C // r, r, H, D).max(axis=1)
        kmin = out["kmin"].reshape(C // r, r, H, D).min(axis=1)
        q = quest.quantize_bounds(kmax, kmin)
        summaries = tuple(a.at[layer, b, pages[::r] // r].set(v, mode="drop")
                          for a, v in zip(summaries[:3], q)) + (summaries_in[3],)  # shift 0
        if lay.key_bits:
            keys, scales = summaries_in[4:]
            keys = keys.at[layer, b, :, pages].set(out["keys"].astype(keys.dtype), mode="drop")
            scales = scales.at[layer, b, :, pages].set(out["scales"], mode="drop")
            summaries += (keys, scales)
    elif lay.selector == "quest":
        kmax, kmin = summaries[:2]
        # a bound per block of r pages, over its pages' (initialized -inf / +inf; pages past
        # the sequence are -inf / +inf themselves), whichever chunk each page comes in
        r = lay.quest_block
        summaries = (kmax.at[layer, b, pages // r].max(out["kmax"], mode="drop"),
                     kmin.at[layer, b, pages // r].min(out["kmin"], mode="drop"))
        if lay.key_bits:  # the key copy [L, B, H, Np, ps, D]: page rows of every head
            keys, scales = summaries_in[2:]
            keys = keys.at[layer, b, :, pages].set(out["keys"].astype(keys.dtype), mode="drop")
            scales = scales.at[layer, b, :, pages].set(out["scales"], mode="drop")
            summaries += (keys, scales)
    elif lay.selector == "indexer":
        summaries = (summaries[0].at[layer, b, pages].set(out["isum"], mode="drop"),)
    return dst, summaries


@functools.lru_cache(maxsize=32)
def _fill_fn(lay: _Layout, dst_sharding, summ_shardings):
    return jax.jit(functools.partial(_fill_chunk, lay), donate_argnums=(0, 1),
                   out_shardings=(dst_sharding, summ_shardings))


def _summary_kind(selector) -> str:
    if isinstance(selector, selectors.quest.Quest):  # Quest and the two-stage rescorers
        return "quest"
    if selector.name not in ("indexer", "dense"):
        raise ValueError(f"synthetic contexts have no fill for the {selector.name!r} selector")
    return selector.name


def layout(plan: engine.Plan, synth: Synthetic, chunk_bytes: int) -> _Layout:
    """The static fill layout of ``plan`` (the fill chunk's compile key)."""
    return _Layout(
        num_kv_heads=plan.model.num_kv_heads, head_dim=plan.model.head_dim,
        page_size=plan.page_size, pages_per_seq=plan.pages_per_seq,
        num_logical_pages=plan.spec.num_logical_pages, kv_dtype=plan.kv_dtype,
        model_dtype=plan.model.dtype, selector=_summary_kind(plan.selector),
        key_bits=getattr(plan.selector, "key_bits", 0) if isinstance(plan.selector,
                                                                     rescore.Rescore) else 0,
        quest_block=plan.cache.candidate_block,
        bounds_int8=plan.cache.bounds_int8,
        index_dim=plan.model.indexer_dim, chunk_pages=_chunk_pages(plan, chunk_bytes),
        center_scale=float(synth.center_scale), value_scale=float(synth.value_scale),
        host=plan.cache.mode == "host", implementation=plan.cache.implementation)


def lower_fill_chunk(plan: engine.Plan, kv, summaries, *, synth: Synthetic = Synthetic(),
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """The lowered fill chunk of ``build_state`` for ``kv`` / ``summaries`` (as
    ``engine.init_kv`` / ``init_summaries`` make them; not consumed). For memory analysis."""
    lay = layout(plan, synth, chunk_bytes)
    dst = kv.host_kv if lay.host else kv.pool
    fn = _fill_fn(lay, dst.sharding, tuple(s.sharding for s in summaries))
    i = np.int32(0)
    return fn.lower(dst, tuple(summaries), i, i, i, i, np.uint32(0), jnp.float32(synth.salience))


def _chunk_pages(plan: engine.Plan, chunk_bytes: int) -> int:
    """Pages per fill chunk: a power of two times the first stage's block (whole blocks per
    chunk, so int8 bounds are quantized once per block), about ``chunk_bytes`` of K/V."""
    r = plan.cache.candidate_block
    n = max(1, int(chunk_bytes) // (plan.spec.page_bytes * r))
    n = 1 << (n.bit_length() - 1)
    return r * max(1, min(n, 1 << max(0, -(-plan.pages_per_seq // r) - 1).bit_length()))


def _check_lengths(plan: engine.Plan, lengths) -> np.ndarray:
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if lengths.shape != (plan.batch,):
        raise ValueError(f"lengths must have {plan.batch} entries (plan.batch), got {lengths.shape[0]}")
    if (lengths < 1).any() or (lengths >= plan.max_context).any():
        raise ValueError(f"lengths must be in [1, max_context - 1 = {plan.max_context - 1}], got "
                         f"{lengths.tolist()}")
    return lengths.astype(np.int32)


def forced_ahead(plan: engine.Plan, lengths):
    """Lagged selection without a prompt query: every layer's first pages are only the forced
    ones, the sink pages and the page of the token at position ``lengths`` [B]. Returns
    ``ahead`` [L, B, H, k] int32, ascending, -1 padded."""
    L, B, H, k = plan.model.num_layers, plan.batch, plan.model.num_kv_heads, plan.k
    sinks = plan.cache.sink_pages
    cur = (jnp.asarray(lengths, jnp.int32) // plan.page_size)[:, None]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    pages = jnp.where(j < jnp.minimum(sinks, cur + 1), j,
                      jnp.where((j == sinks) & (cur >= sinks), cur, INVALID))
    pages = jnp.where(pages < plan.pages_per_seq, pages, INVALID)
    return jnp.broadcast_to(pages[None, :, None, :], (L, B, H, k))


def _fresh(plan: engine.Plan, kv, summaries, lengths: np.ndarray, seed: int) -> engine.DecodeState:
    """The state to decode from; ``summaries`` the selector's own (no lagged ``ahead``): with
    lagged selection there is no prompt query to select with, so the first step reads the
    forced pages only (:func:`forced_ahead`)."""
    summaries = tuple(summaries)
    if plan.lagged:
        summaries += (forced_ahead(plan, lengths),)
    rng = np.random.default_rng([seed, 7])
    last = rng.integers(3, plan.model.vocab_size, plan.batch).astype(np.int32)
    return engine.start_state(plan, kv, summaries, lengths, last, jax.random.key(seed),
                              n_generated=0)


def build_state(plan: engine.Plan, lengths, *, synth: Synthetic = Synthetic(), seed: int = 0,
                poison: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                tp: parallel.TensorParallel | None = None, kv=None) -> engine.DecodeState:
    """A DecodeState for ``plan`` whose requests hold ``lengths`` tokens of synthetic context.

    Args:
      plan: the engine plan (host or resident mode, any selector); with ``tp``, one device's
        plan.
      lengths: [B] context tokens per request, in [1, plan.max_context - 1].
      synth: the key/value model (:class:`Synthetic`).
      seed: the data depend only on (seed, layer, request, page, synth), not on the chunking,
        the batch or the capacity; the first tokens to feed are random ids.
      poison: fill the device pool with NaN first (tests).
      chunk_bytes: K/V bytes generated per fill call (bounds device scratch memory).
      tp: fill every device's shard of a tensor-parallel state over ``tp``'s mesh, each
        device with its own stream (device 0's data are those of ``tp=None``).
      kv: a resident cache of another plan's state with this plan's layout, filled in place
        instead of a new one (same ``seed`` and ``synth``: the same data), so that several
        plans share one cache (``ab_step.py --share-kv``); resident mode only.
    Returns:
      DecodeState: the tier holds every page with a token ``< lengths[b]`` (whole pages: the
      tail of the last page is random too, as after a padded prefill), summaries cover the
      valid tokens only, ``done`` False, ``n_generated`` 0, an empty LRU (host mode).
    """
    lengths = _check_lengths(plan, lengths)
    lay = layout(plan, synth, chunk_bytes)
    if kv is not None:
        want = jax.eval_shape(lambda: engine.init_kv(plan))
        if plan.cache.mode != "resident" or tp is not None or (
                jax.tree.map(lambda a: (a.shape, a.dtype), kv)
                != jax.tree.map(lambda a: (a.shape, a.dtype), want)):
            raise ValueError("kv= takes a resident cache of this plan's layout (no tp)")
        # the array is shared, the counters are the state's own
        kv = dataclasses.replace(kv, counters=kvcache.CacheCounters.zeros())
        summaries = engine.init_summaries(plan)
    elif tp is None:
        kv, summaries = engine.init_kv(plan, poison=poison), engine.init_summaries(plan)
    else:
        kv, summaries = tp.init_kv(plan, poison=poison), tp.init_summaries(plan) or ()
    # the selector's own summaries are filled; the keys' shift (quantized KV) stays zero: the
    # synthetic keys are stored as drawn
    summaries, shift, _ = selectors.split(summaries, plan)
    dst = kv.host_kv if lay.host else kv.pool
    shardings = (dst.sharding, tuple(s.sharding for s in summaries))
    fn = _fill_fn(lay, *shardings) if tp is None else _tp_fill_fn(tp, lay, *shardings)
    key = np.uint32(seed % 2**32)
    sal = jnp.float32(synth.salience)
    C, ps = lay.chunk_pages, plan.page_size
    for layer in range(plan.model.num_layers):
        for b in range(plan.batch):
            n = -(-int(lengths[b]) // ps)
            for j0 in range(0, n, C):
                dst, summaries = fn(dst, summaries, np.int32(layer), np.int32(b), np.int32(j0),
                                    np.int32(lengths[b]), key, sal)
    kv = dataclasses.replace(kv, host_kv=dst) if lay.host else dataclasses.replace(kv, pool=dst)
    summaries = selectors.join(summaries, shift)
    if tp is None:
        return _fresh(plan, kv, summaries, lengths, seed)
    # every device's shard gets its fresh state (forced pages, first tokens) in reuse_state
    state = engine.start_state(plan, kv, summaries, lengths,
                               jnp.zeros((plan.batch,), jnp.int32), jax.random.key(seed),
                               n_generated=0, lookahead=tp.init_lookahead(plan))
    return reuse_state(plan, state, lengths, seed=seed, tp=tp)


@functools.lru_cache(maxsize=8)
def _tp_fill_fn(tp: parallel.TensorParallel, lay: _Layout, dst_sharding, summ_shardings):
    """The fill chunk on every device's shard of ``tp``'s mesh (the key mixed with the
    device's index: an independent stream per device)."""
    PS = jax.sharding.PartitionSpec

    def local(dst, summ, layer, b, j0, length, key, sal):
        key = key ^ (jax.lax.axis_index(parallel.AXIS).astype(jnp.uint32) * _U32(0x9E3779B1))
        dst, summ = _fill_chunk(lay, dst[0], tuple(a[0] for a in summ), layer, b, j0, length,
                                key, sal)
        return dst[None], tuple(a[None] for a in summ)

    smap = jax.shard_map(local, mesh=tp.mesh,
                         in_specs=(PS(parallel.AXIS), PS(parallel.AXIS)) + (PS(),) * 6,
                         out_specs=(PS(parallel.AXIS), PS(parallel.AXIS)), check_vma=False)
    return jax.jit(smap, donate_argnums=(0, 1), out_shardings=(dst_sharding, summ_shardings))


def reuse_state(plan: engine.Plan, state: engine.DecodeState, lengths, *, seed: int = 0,
                summaries=None, poison: bool = False,
                tp: parallel.TensorParallel | None = None) -> engine.DecodeState:
    """Rebind the filled tier of ``state`` to ``plan`` and restart at ``lengths``.

    ``plan`` must have the same model, batch, page size, capacity, KV dtype and mode as the
    plan ``state`` was built for; the pool size, selector, round length and options may
    differ. Host mode: a cold LRU (empty page table) and zeroed counters; the pool buffer
    is reused when its shape matches, else a new one is allocated (NaN if ``poison``).
    Summaries: ``summaries`` if given, else ``state.summaries`` (``()`` for the dense
    selector). ``state`` must not be used afterwards (its buffers move to the result).
    Tokens after ``lengths`` that an earlier run wrote are overwritten before they are read
    (attention masks positions ``>= length``; a page's summary restarts at its first token).
    ``tp``: ``state`` is a tensor-parallel state over ``tp``'s mesh and ``plan`` one device's
    plan; every device's shard is rebound (``summaries`` must be None).
    """
    if tp is not None:
        if summaries is not None:
            raise ValueError("reuse_state: summaries= needs tp=None")
        lengths = [int(x) for x in np.asarray(lengths).reshape(-1)]
        return tp.map_state(lambda s: reuse_state(plan, s, lengths, seed=seed, poison=poison),
                            state)
    lengths = _check_lengths(plan, lengths)
    spec = plan.spec
    kv = state.kv
    if plan.cache.mode == "host":
        if not isinstance(kv, kvcache.HostTierCache) or kv.host_kv.shape != spec.host_shape:
            raise ValueError("reuse_state: the state's host tier does not match the plan")
        pool = kv.pool
        if pool.shape != spec.pool_shape:
            # free the old pool first: both at once may not fit (8B-like B=8: 32 + 64 GiB)
            if not isinstance(pool, jax.core.Tracer):
                pool.delete()
            fill = jnp.nan if poison else 0
            pool = jnp.full(spec.pool_shape, fill, spec.jnp_dtype)
        L, P, S = spec.num_layers, spec.num_logical_pages, spec.num_slots
        kv = kvcache.HostTierCache(
            host_kv=kv.host_kv, pool=pool,
            page_table=jnp.full((L, P), INVALID, jnp.int32),
            slot_owner=jnp.full((L, S), INVALID, jnp.int32),
            last_used=jnp.full((L, S), INVALID, jnp.int32),
            step=jnp.zeros((), jnp.int32), counters=kvcache.CacheCounters.zeros())
    else:
        if not isinstance(kv, kvcache.ResidentCache) or kv.pool.shape != spec.host_shape:
            raise ValueError("reuse_state: the state's resident pool does not match the plan")
        kv = kvcache.ResidentCache(pool=kv.pool, counters=kvcache.CacheCounters.zeros())
    fresh = jax.eval_shape(functools.partial(engine.init_summaries, plan))
    own, shift, _ = selectors.split(fresh, plan)
    want = selectors.join(own, shift)                 # without a lagged state's pages
    if plan.cache.selector == "dense":               # the keys' shift (quantized KV) only: zeros
        summ = tuple(jnp.zeros(a.shape, a.dtype) for a in want)
    else:
        summ = tuple(state.summaries if summaries is None else summaries)
        if len(summ) == len(want) + 1:  # a lagged state's pages: chosen again below
            summ = summ[:-1]
        want = [(a.shape, a.dtype) for a in jax.tree.leaves(want)]
        have = [(a.shape, a.dtype) for a in jax.tree.leaves(summ)]
        if want != have:
            raise ValueError(f"reuse_state: summaries {have} do not match the plan's selector "
                             f"{plan.cache.selector!r}: pass summaries=")
    return _fresh(plan, kv, summ, lengths, seed)


# --------------------------------------------------------------------------------------
# selection traces and overlap
# --------------------------------------------------------------------------------------
def _trace(plan: engine.Plan, params, state: engine.DecodeState, tokens):
    cfg, spec, ps = plan.model, plan.spec, plan.page_size
    B, Np, H, L = plan.batch, plan.pages_per_seq, cfg.num_kv_heads, cfg.num_layers
    P = spec.num_logical_pages
    impl = plan.cache.implementation
    b_idx = jnp.arange(B, dtype=jnp.int32)
    kp = plan.k

    def step(st, tok):
        pos = st.lengths
        logical = b_idx * Np + pos // ps
        offset = pos % ps
        buf = jnp.full((L, B, H, kp), INVALID, jnp.int32)

        def attend(layer, lp, h, q, k, v, carry):
            kv, summ, buf = carry
            q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]
            tok_kv = jnp.stack([k1, v1], axis=1).astype(plan.summary_dtype)
            kv = kvcache.write_resident(spec, kv, layer, logical, offset, tok_kv, implementation=impl)
            own, shift, ahead = selectors.split(summ, plan)
            own, pages = plan.selector.update_select(plan, own, layer, lp, h, q1, tok_kv, pos)
            summ = selectors.join(own, shift, ahead)
            rows = jnp.where(pages >= 0, layer * P + b_idx[:, None, None] * Np + pages, INVALID)
            out, _ = sparse_paged_attention(q1, kv.pool, rows, pages, pos + 1, page_size=ps,
                                            num_kv_heads=H, implementation=impl)
            buf = jax.lax.dynamic_update_index_in_dim(buf, pages.astype(jnp.int32), layer, 0)
            return out[:, None].astype(q.dtype), (kv, summ, buf)

        logits, (kv, summ, buf) = llama.forward(params, cfg, tok[:, None], pos[:, None], attend,
                                                (st.kv, st.summaries, buf))
        greedy = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        st = dataclasses.replace(st, kv=kv, summaries=summ, lengths=pos + 1, last_token=tok)
        return st, (buf, greedy)

    state, (pages, greedy) = jax.lax.scan(step, state, tokens.T)
    return state, pages, greedy.T


@functools.lru_cache(maxsize=16)
def _trace_fn(plan: engine.Plan, shardings_key):
    return jax.jit(functools.partial(_trace, plan), donate_argnums=(1,),
                   out_shardings=(_SHARDINGS[shardings_key], None, None))


_SHARDINGS: dict = {}


def trace_selections(plan: engine.Plan, params, state: engine.DecodeState, tokens):
    """Decode teacher-forced ``tokens`` from a resident-mode state, recording every selection.

    Mirrors the resident path of ``engine.decode_step`` (write, select, sparse attention),
    feeding ``tokens[:, t]`` at position ``lengths + t`` instead of sampling.
    Args: tokens [B, T] int32 (needs ``lengths + T <= plan.max_context``); ``state`` donated.
    Returns (state, pages [T, L, B, H, k] int32 within-sequence pages (-1 padded; the
    indexer's shared selection is repeated per head), greedy [B, T] int32: the argmax of the
    logits after each fed token).
    """
    if plan.cache.mode != "resident":
        raise ValueError("trace_selections needs a resident-mode plan")
    if plan.lagged:
        raise ValueError("trace_selections records the exact selections: use a plan with "
                         "CacheConfig(selection_lag=0)")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[0] != plan.batch:
        raise ValueError(f"tokens must be [B={plan.batch}, T], got {tokens.shape}")
    sh = engine.state_shardings(state)
    key = (jax.tree.structure(sh), tuple(jax.tree.leaves(sh)))
    _SHARDINGS.setdefault(key, sh)
    return _trace_fn(plan, key)(params, state, tokens)


def selection_overlap(pages, *, num_sink_pages: int = 0) -> dict:
    """Step-to-step overlap of a selection trace.

    pages: [T, L, B, H, k] int (-1 padded) within-sequence pages per step (T >= 2).
    Returns a dict: ``mean`` (over steps t >= 1, layers, requests and heads of
    |S_t & S_{t-1}| / |S_t|), ``per_layer`` [L], ``per_step`` [T-1], ``union_mean`` (the same
    for the union over heads of a (layer, request): what the cache sees), ``selected_mean``
    (mean |S_t|), ``excl_forced_mean`` (sink pages and each step's last page left out of
    both sets).
    """
    pages = np.asarray(pages)
    if pages.ndim != 5 or pages.shape[0] < 2:
        raise ValueError(f"pages must be [T >= 2, L, B, H, k], got {pages.shape}")
    T, L, B, H, k = pages.shape
    per = np.zeros((T - 1, L, B, H))
    per_x = np.zeros((T - 1, L, B, H))
    union = np.zeros((T - 1, L, B))
    sizes = []
    for t in range(1, T):
        a, p = pages[t], pages[t - 1]
        va = a >= 0
        hit = ((a[..., :, None] == p[..., None, :]) & (p[..., None, :] >= 0)).any(-1) & va
        n = va.sum(-1)
        per[t - 1] = hit.sum(-1) / np.maximum(n, 1)
        sizes.append(n.mean())
        last_a = np.where(va, a, -1).max(-1, keepdims=True)
        last_p = np.where(p >= 0, p, -1).max(-1, keepdims=True)
        keep_a = va & (a >= num_sink_pages) & (a != last_a) & (a != last_p)
        hit_x = ((a[..., :, None] == p[..., None, :]) & (p[..., None, :] >= 0)).any(-1) & keep_a
        per_x[t - 1] = hit_x.sum(-1) / np.maximum(keep_a.sum(-1), 1)
        for l in range(L):
            for b in range(B):
                sa = set(a[l, b][a[l, b] >= 0].tolist())
                sp = set(p[l, b][p[l, b] >= 0].tolist())
                union[t - 1, l, b] = len(sa & sp) / max(len(sa), 1)
    return {"mean": float(per.mean()), "per_layer": per.mean(axis=(0, 2, 3)).tolist(),
            "per_step": per.mean(axis=(1, 2, 3)).tolist(), "union_mean": float(union.mean()),
            "selected_mean": float(np.mean(sizes)), "excl_forced_mean": float(per_x.mean()),
            "steps": T, "layers": L, "batch": B, "heads": H, "k": k}


# --------------------------------------------------------------------------------------
# calibration of the salience knob
# --------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("selector", "heads", "group", "head_dim", "page_size",
                                             "num_pages", "k", "sink_pages", "dtype",
                                             "index_heads", "index_dim", "steps",
                                             "center_scale", "implementation", "candidates",
                                             "key_bits"))
def _simulate(salience, key, *, selector, heads, group, head_dim, page_size, num_pages, k,
              sink_pages, dtype, index_heads, index_dim, steps, center_scale, implementation,
              candidates=0, key_bits=8):
    """Selections [steps, 1, 1, H, k] for iid N(0, 1) queries over one layer's synthetic pages.
    ``selector``: "quest", "indexer", or "two_stage" (Quest's ``candidates`` pages re-ranked
    by their attention mass from the key copy, int8 for ``key_bits`` 8, as ``quest_rescore*``
    does)."""
    H, D, ps = heads, head_dim, page_size
    dt = jnp.dtype(dtype)
    chunk = min(num_pages, 2048)
    n_chunks = -(-num_pages // chunk)
    valid = jnp.ones((ps,), jnp.bool_)

    def summarize(c):
        def one(p):
            pk = _page_key(key, 0, 0, p)
            if selector in ("quest", "two_stage"):
                keys = _page_keys(pk, salience, H=H, D=D, ps=ps, center_scale=center_scale)
                summ = _quest_summary(keys, valid, dt)
                if selector == "two_stage":  # + the key copy's page rows [H, ps, D]
                    summ += rescore.quantize(keys.astype(dt), key_bits)
                return summ
            return (_index_summary(_page_index_keys(pk, salience, dI=index_dim, ps=ps), valid, dt),)
        return jax.vmap(one)(c * chunk + jnp.arange(chunk, dtype=jnp.int32))

    summ = jax.lax.map(summarize, jnp.arange(n_chunks, dtype=jnp.int32))
    summ = tuple(s.reshape((n_chunks * chunk,) + s.shape[2:])[:num_pages][None, None] for s in summ)
    seq = jnp.full((1,), num_pages * ps, jnp.int32)
    qkey = _combine(_U32(0x51ED270B), key)

    if selector == "two_stage":  # the key copy as the selector holds it: [L, B, H, Np, ps, D]
        keys, scales = (jnp.moveaxis(a, 3, 2) for a in summ[2:])
        summ = summ[:2]

    def select(t):
        kq = _combine(qkey, t)
        if selector == "quest":
            q = _normal(kq, 7, (1, H * group, D)).astype(dt)
            return quest.quest_select(q, summ[0], summ[1], 0, seq, k=k, page_size=ps,
                                      num_sink_pages=sink_pages, implementation=implementation)
        if selector == "two_stage":
            q = _normal(kq, 7, (1, H * group, D)).astype(dt)
            cand = quest.quest_select(q, summ[0], summ[1], 0, seq, k=candidates, page_size=ps,
                                      num_sink_pages=sink_pages, implementation=implementation,
                                      ordered=False)
            mass = mass_kernels.candidate_mass(q, keys, scales, 0, cand, seq - 1,
                                               implementation=implementation)
            return top_candidates(mass, cand, seq, k=k, page_size=ps, num_pages=num_pages,
                                  num_sink_pages=sink_pages)
        qi = _normal(kq, 8, (1, index_heads, index_dim)).astype(dt)
        w = _normal(kq, 9, (1, index_heads)) * index_heads ** -0.5
        pages = indexer_ops.indexer_select(qi, w, summ[0], 0, seq, k=k, page_size=ps,
                                           num_sink_pages=sink_pages, implementation=implementation)
        return jnp.broadcast_to(pages[:, None], (1, H, k))

    return jax.lax.map(select, jnp.arange(steps, dtype=jnp.int32))[:, None]


def simulate_overlap(salience: float, *, model, page_size: int, num_pages: int, k: int,
                     selector: str = "quest", sink_pages: int = 1, dtype: str | None = None,
                     steps: int = 16, seed: int = 0, center_scale: float = 1.0,
                     implementation: str | None = None) -> float:
    """Mean step-to-step selection overlap of the synthetic keys at ``salience``.

    One layer and request of ``num_pages`` full pages drawn like :func:`build_state` does
    (``model``: a ModelConfig, for heads, group size, head dim and indexer shape), and
    ``steps`` independent ``N(0, 1)`` queries (indexer weights ``N(0, 1/H_I)``), selected with
    the real selector (``k`` pages): Quest, the indexer, or a two-stage selector's ops (Quest's
    first stage, the second stage's masses from its key copy, the final choice). Exact
    masses persist less than Quest's bound under independent queries, so a two-stage
    selector needs a larger salience for the same overlap. Returns the mean of
    :func:`selection_overlap`.
    """
    kind = _simulated_kind(selector)
    cands, bits = 0, 8
    if kind == "two_stage":  # the selector's first-stage count (its default, at most Np)
        two = selectors.get(selector)
        cands = min(two.default_candidates(int(k), int(page_size)), int(num_pages))
        bits = two.key_bits
    pages = _simulate(jnp.float32(salience), np.uint32(seed % 2**32), selector=kind,
                      heads=model.num_kv_heads, group=model.group_size, head_dim=model.head_dim,
                      page_size=page_size, num_pages=int(num_pages), k=int(min(k, num_pages)),
                      sink_pages=sink_pages, dtype=dtype or model.dtype,
                      index_heads=model.indexer_heads, index_dim=model.indexer_dim,
                      steps=int(steps), center_scale=float(center_scale),
                      implementation=implementation, candidates=cands, key_bits=bits)
    return selection_overlap(np.asarray(pages))["mean"]


def _simulated_kind(selector: str) -> str:
    """What :func:`simulate_overlap` runs for a selector name: "quest", "indexer" or
    "two_stage" (``quest_rescore`` / ``quest_rescore8``)."""
    if selector in ("quest", "indexer"):
        return selector
    if selector in selectors.names() and selectors.get(selector).two_stage:
        return "two_stage"
    raise ValueError(f"simulate_overlap: selector must be 'quest', 'indexer' or a two-stage "
                     f"selector ({[n for n in selectors.names() if selectors.get(n).two_stage]}), "
                     f"got {selector!r}")


def calibrate_salience(target: float, *, lo: float = 1e-4, hi: float = 10.0, iters: int = 14,
                       **kw) -> tuple[float, float]:
    """The salience whose :func:`simulate_overlap` (same ``kw``) is closest to ``target``.

    Bisection on ``log(salience)`` in ``[lo, hi]`` (the overlap grows with the salience).
    Returns (salience, simulated overlap); an unreachable target gives the nearest end.
    """
    f_lo, f_hi = simulate_overlap(lo, **kw), simulate_overlap(hi, **kw)
    if target <= f_lo:
        return lo, f_lo
    if target >= f_hi:
        return hi, f_hi
    a, b = math.log(lo), math.log(hi)
    best = (lo, f_lo) if abs(f_lo - target) < abs(f_hi - target) else (hi, f_hi)
    for _ in range(iters):
        m = 0.5 * (a + b)
        f = simulate_overlap(math.exp(m), **kw)
        if abs(f - target) < abs(best[1] - target):
            best = (math.exp(m), f)
        if f < target:
            a = m
        else:
            b = m
    return best
