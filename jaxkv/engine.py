"""The compiled parts of generation: the static plan, the decode state, prefill and decode.

* :class:`Plan` (frozen, hashable) fixes every shape: batch, prompt bucket, context capacity,
  cache layout. It is the static argument of every jitted function here.
* :class:`DecodeState` (pytree, donated) carries the cache, the selector summaries, the
  sequence lengths, the last tokens, the done flags and the PRNG key.
* :func:`prefill_layer` runs one layer over the whole (bucketed) prompt and writes its K/V
  page by page to the host tier (or the resident pool); python loops over layers so long
  prompts show progress and only one layer's K/V is on device at a time.
* :func:`decode_round` is one jitted ``lax.while_loop`` of up to ``round_steps`` decode steps:
  selection, LRU ensure, fetch, sparse attention, write-through and sampling for all layers
  of all requests, with no host sync inside.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

from jaxkv import cache as kvcache
from jaxkv import lru, selection
from jaxkv.config import CacheConfig, Sampling
from jaxkv.sampling import sample
from jaxkv.spec import INVALID, CacheSpec
from jaxkv.models import llama
from jaxkv.models.configs import ModelConfig
from jaxkv.kernels import dense_select, layer_lookup, page_fetch, page_write
from jaxkv.kernels.prefill_attention import prefill_attention
from jaxkv.kernels.sparse_attention import sparse_paged_attention


# XLA options every decode round is compiled with (``round_compiler_options``). The round's
# CUDA graph orders its kernels by their buffer dependencies, so independent ones may overlap:
# 1.2-1.7% off the Qwen-like B=8 step (benchmarks/results/ab_step_pdl_b46177f.json,
# ab_step_concurrent_b46177f.json). The CPU backend accepts and ignores it (other backends are
# not tried); an XLA that rejects an option gets the round without it (and a warning).
ROUND_COMPILER_OPTIONS = (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),)


@functools.lru_cache(maxsize=None)
def _accepted_options(options: tuple, backend: str) -> tuple:
    """The pairs of ``options`` that this XLA accepts, each tried once on a tiny program.
    ``backend`` (the default backend, where the program compiles) is only the cache key."""
    del backend
    ok = []
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile({name: value})
            ok.append((name, value))
        except Exception as e:  # noqa: BLE001 - any rejection: compile without the option
            warnings.warn(f"jaxkv: XLA rejects the decode round's default option "
                          f"{name}={value!r}; compiling without it ({str(e)[:200]})")
    return tuple(ok)


def round_compiler_options(plan) -> dict:
    """The XLA options of ``plan``'s compiled decode round: ``ROUND_COMPILER_OPTIONS`` (those
    this XLA accepts) updated by ``plan.compiler_options``."""
    defaults = _accepted_options(tuple(ROUND_COMPILER_OPTIONS), jax.default_backend())
    return {**dict(defaults), **dict(plan.compiler_options)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static shapes of one generate() call (hashable: the jit cache key)."""

    model: ModelConfig
    cache: CacheConfig
    batch: int
    prompt_len: int      # bucketed prompt length T (multiple of page_size)
    max_context: int     # tokens per sequence (multiple of page_size)
    num_stop: int        # length of the padded stop-token array
    # Tensor parallelism (jaxkv.parallel): the mesh axis this plan's functions run over
    # inside shard_map; ``model`` is then one device's share (its KV heads, MLP block).
    axis_name: str | None = None
    # XLA compiler options of the compiled decode round, as (name, value) pairs (hashable),
    # e.g. (("xla_gpu_exhaustive_tiling_search", True),), on top of ``ROUND_COMPILER_OPTIONS``
    # (a pair here overrides the default of the same name).
    compiler_options: tuple = ()

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def pages_per_seq(self) -> int:
        return self.max_context // self.page_size

    @property
    def k(self) -> int:
        """Selected pages per request, layer and KV head."""
        if self.cache.selector == "dense":
            return self.pages_per_seq
        return min(self.cache.selected_pages, self.pages_per_seq)

    @property
    def lagged(self) -> bool:
        """Pages chosen one step ahead (CacheConfig.selection_lag): the summaries tuple then
        ends with ``ahead`` [L, B, H, k] (jaxkv.selection)."""
        return self.cache.selection_lag == 1 and self.cache.selector != "dense"

    @property
    def layer_unroll(self) -> int:
        unroll = self.cache.unroll_layers
        if unroll is None:
            unroll = jax.default_backend() == "gpu"
        return self.model.num_layers if unroll else 1

    @property
    def num_pinned(self) -> int:
        return self.cache.sink_pages + self.cache.recent_pages

    @property
    def num_dense(self) -> int:
        """The first layers that attend densely (CacheConfig.dense_layers)."""
        return min(self.cache.dense_layers, self.model.num_layers)

    @property
    def dense_spec(self) -> CacheSpec:
        """Host mode: the device-resident K/V of the dense layers, [num_dense * P, R]."""
        return dataclasses.replace(self.spec, num_layers=max(1, self.num_dense),
                                   num_slots=self.spec.num_logical_pages, num_scratch=0)

    @property
    def per_step(self) -> bool:
        """Host mode with per-step scheduling, "step" or "scratch" (see CacheConfig.schedule)."""
        return self.cache.mode == "host" and self.cache.schedule in ("step", "scratch")

    @property
    def in_place(self) -> bool:
        """Per-step scheduling that reads missed pages in place from the host tier."""
        return self.per_step and self.cache.schedule == "step"

    @property
    def requests_per_layer(self) -> int:
        """Selected (request, KV head, page) entries per layer and step."""
        return self.batch * self.model.num_kv_heads * self.k

    @property
    def scratch_per_request(self) -> int:
        """Scratch rows per request and layer: distinct pages one request can miss in a step."""
        return min(self.model.num_kv_heads * self.k, self.pages_per_seq)

    @property
    def scratch_per_layer(self) -> int:
        return self.batch * self.scratch_per_request

    @property
    def kv_dtype(self) -> str:
        return self.cache.dtype or self.model.dtype

    @property
    def pool_pages(self) -> int:
        """Device slots per layer (host mode)."""
        P = self.batch * self.pages_per_seq
        if self.cache.pool_pages is not None:
            return self.cache.pool_pages
        return min(P, self.step_pages)

    @property
    def step_pages(self) -> int:
        """Most pages of one layer a decode step protects in the pool: every request's
        selected pages of every KV head and its pinned (sink + recent) pages."""
        return self.requests_per_layer + self.batch * self.num_pinned

    @property
    def spec(self) -> CacheSpec:
        m = self.model
        return CacheSpec(
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            page_size=self.page_size, dtype=self.kv_dtype,
            num_logical_pages=self.batch * self.pages_per_seq,
            num_slots=self.pool_pages if self.cache.mode == "host" else self.batch * self.pages_per_seq,
            max_requests=self.batch * m.num_kv_heads * self.k,
            num_sink_pages=self.cache.sink_pages, num_recent_pages=self.cache.recent_pages,
            max_batch=self.batch, num_scratch=self.scratch_per_layer if self.per_step and not self.in_place else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries (donated between rounds).

    kv: HostTierCache (host mode) or ResidentCache. summaries: selector summaries.
    lengths [B]: tokens in the cache = position of ``last_token``. last_token [B]: the next
    token to feed. done [B] bool. n_generated [B]: tokens produced so far. key: PRNG key.
    """

    kv: object
    summaries: tuple
    lengths: jax.Array
    last_token: jax.Array
    done: jax.Array
    n_generated: jax.Array
    key: jax.Array
    lookahead: tuple = ()
    dense: object = ()


# --------------------------------------------------------------------------------------
# state construction
# --------------------------------------------------------------------------------------
def init_kv(plan: Plan, *, poison: bool = False, traced: bool = False):
    """``traced``: build inside a jit / shard_map (see kvcache.init_cache)."""
    if plan.cache.mode == "host":
        return kvcache.init_cache(plan.spec, poison=poison, traced=traced)
    return kvcache.init_resident(plan.spec, poison=poison, traced=traced)


def init_dense(plan: Plan, *, poison: bool = False, traced: bool = False):
    """Device copy of the dense layers' K/V (host mode with CacheConfig.dense_layers > 0)."""
    if plan.cache.mode != "host" or plan.num_dense == 0:
        return ()
    return kvcache.init_resident(plan.dense_spec, poison=poison, traced=traced)


def start_state(plan: Plan, kv, summaries, lengths, last_token, key, *, done=None,
                n_generated: int = 1, lookahead=None, dense=()) -> DecodeState:
    """The decode state right after a prefill: lengths [B] (tokens in the cache), last_token [B]
    (the next token to feed), ``done`` [B] bool (default all False), every request's
    ``n_generated`` set to the given count, empty per-step selections (``lookahead`` default:
    ``init_lookahead(plan)``)."""
    B = plan.batch
    return DecodeState(
        kv=kv, summaries=summaries, lengths=jnp.asarray(lengths, jnp.int32),
        last_token=jnp.asarray(last_token, jnp.int32),
        done=jnp.zeros((B,), jnp.bool_) if done is None else jnp.asarray(done),
        n_generated=jnp.full((B,), n_generated, jnp.int32), key=key,
        lookahead=init_lookahead(plan) if lookahead is None else lookahead, dense=dense)


def init_lookahead(plan: Plan):
    """Per-step scheduling: the previous step's selections [L, R] (and, "scratch", the scratch
    rows they were fetched into)."""
    if not plan.per_step:
        return ()
    shape = (plan.model.num_layers, plan.requests_per_layer)
    if plan.in_place:
        return (jnp.full(shape, INVALID, jnp.int32),)
    return (jnp.full(shape, INVALID, jnp.int32), jnp.full(shape, INVALID, jnp.int32))


def forced_ahead(plan: Plan, lengths):
    """Lagged selection without a prompt query (synthetic contexts): every layer's first
    pages are only the forced ones, the sink pages and the page of the token at position
    ``lengths`` [B]. Returns ``ahead`` [L, B, H, k] int32, ascending, -1 padded."""
    L, B, H, k = plan.model.num_layers, plan.batch, plan.model.num_kv_heads, plan.k
    sinks = plan.cache.sink_pages
    cur = (jnp.asarray(lengths, jnp.int32) // plan.page_size)[:, None]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    pages = jnp.where(j < jnp.minimum(sinks, cur + 1), j,
                      jnp.where((j == sinks) & (cur >= sinks), cur, INVALID))
    pages = jnp.where(pages < plan.pages_per_seq, pages, INVALID)
    return jnp.broadcast_to(pages[None, :, None, :], (L, B, H, k))


def init_summaries(plan: Plan):
    m = plan.model
    return selection.init_summaries(
        plan.cache.selector, m.num_layers, plan.batch, plan.pages_per_seq, m.num_kv_heads,
        m.head_dim, jnp.dtype(plan.kv_dtype), m.indexer_dim,
        ahead_pages=plan.k if plan.lagged else 0)


def state_shardings(state: DecodeState):
    """Output shardings that keep every leaf where it is (the host tier stays pinned)."""
    return jax.tree.map(lambda a: a.sharding, state)


# --------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------
def _pack_pages(k, v, page_size):
    """k, v [B, T, H, D] -> rows [B, T/ps, R] in the row layout [2, H, ps, D]."""
    B, T, H, D = k.shape
    kv = jnp.stack([k, v], axis=2)                             # [B, T, 2, H, D]
    kv = kv.reshape(B, T // page_size, page_size, 2, H, D)
    kv = kv.transpose(0, 1, 3, 4, 2, 5)                        # [B, n, 2, H, ps, D]
    return kv.reshape(B, T // page_size, 2 * H * page_size * D)


def _in_token_chunks(fn, chunk: int, *xs):
    """``fn(*xs)`` for per-token work, ``chunk`` tokens at a time (``lax.map``: one piece's
    intermediates live at once). xs: arrays ``[B, T, ...]``; fn returns arrays or a tuple of
    arrays ``[B, T, ...]``. T <= chunk: one call. Otherwise T is padded with zeros to whole
    pieces and the padding dropped from the results."""
    B, T = xs[0].shape[:2]
    if T <= chunk:
        return fn(*xs)
    n = -(-T // chunk)

    def pieces(a):
        a = jnp.pad(a, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, n, chunk, *a.shape[2:]), 1, 0)

    out = jax.lax.map(lambda p: fn(*p), tuple(pieces(a) for a in xs))
    return jax.tree.map(
        lambda o: jnp.moveaxis(o, 0, 1).reshape(B, n * chunk, *o.shape[3:])[:, :T], out)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("kv", "summaries", "dense"))
def prefill_layer(plan: Plan, layer_params, layer, x, lengths, kv, summaries, dense=()):
    """One layer over the bucketed prompt; writes its K/V pages and selector summaries.

    layer_params: params["layers"][layer]; x [B, T, d]; lengths [B] prompt lengths; layer
    int32 scalar (traced: one compilation serves every layer). Returns (x, kv, summaries, dense).
    The per-token work (norms, projections, MLP) runs in pieces of
    ``CacheConfig.prefill_token_chunk`` tokens; attention sees the whole prompt.
    """
    cfg, ps = plan.model, plan.page_size
    B, T, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lp = layer_params
    pieces = plan.cache.prefill_token_chunk
    h, q, k, v = _in_token_chunks(lambda x, pos: llama.attention_inputs(lp, cfg, x, pos), pieces,
                                  x, positions)
    attn = prefill_attention(q, k, v, lengths, implementation=plan.cache.implementation,
                             chunk=plan.cache.prefill_chunk)
    x = _in_token_chunks(lambda x, a: llama.layer_output(lp, cfg, x, a, axis_name=plan.axis_name),
                         pieces, x, attn)

    dt = jnp.dtype(plan.kv_dtype)
    pages = _pack_pages(k.astype(dt), v.astype(dt), ps)             # [B, n, R]
    n = T // ps
    j = jnp.arange(n, dtype=jnp.int32)
    used = j[None, :] * ps < lengths[:, None]
    logical = jnp.arange(B, dtype=jnp.int32)[:, None] * plan.pages_per_seq + j[None, :]
    rows = jnp.where(used, layer * plan.spec.num_logical_pages + logical, INVALID).reshape(-1)
    impl = plan.cache.implementation
    if plan.cache.mode == "host":
        host_kv = page_write.write_pages(kv.host_kv, rows, pages.reshape(B * n, -1),
                                         implementation=impl)
        kv = dataclasses.replace(kv, host_kv=page_write.keep_on_host(host_kv))
    else:
        kv = dataclasses.replace(kv, pool=page_write.write_pages(
            kv.pool, rows, pages.reshape(B * n, -1), implementation=impl))
    if plan.cache.mode == "host" and plan.num_dense:
        drows = jnp.where(layer < plan.num_dense, rows, INVALID)
        dense = dataclasses.replace(dense, pool=page_write.write_pages(
            dense.pool, drows, pages.reshape(B * n, -1), implementation=impl))
    summ, ahead = selection.split_ahead(summaries, plan.lagged)
    summ = selection.summarize_prefill(plan.cache.selector, summ, layer, lp, cfg, h, k,
                                       positions, lengths, ps)
    if plan.lagged:  # the first decode step's pages, chosen with the prompt's last query
        last = jnp.maximum(lengths - 1, 0)
        h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)             # [B, 1, d]
        q_last = jnp.take_along_axis(q, last[:, None, None, None], axis=1)[:, 0]  # [B, Hq, D]
        pages = selection.select_after_prefill(
            plan.cache.selector, summ, layer, lp, cfg, h_last, q_last, lengths, k=plan.k,
            page_size=ps, num_sink_pages=plan.cache.sink_pages, implementation=impl)
        summ = summ + (ahead.at[layer].set(pages),)
    return x, kv, summ, dense


@functools.partial(jax.jit, static_argnames=("plan",))
def embed_prompt(plan: Plan, params, tokens):
    return llama.embed(params, plan.model, tokens)


@functools.partial(jax.jit, static_argnames=("plan",))
def first_token(plan: Plan, params, x, lengths, sampling: Sampling, key):
    """Sample the first new token from the prompt's last position. x [B, T, d] -> [B]."""
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)   # [B, 1, d]
    logits = llama.final_logits(params, plan.model, last)[:, 0]
    return agree(sample(logits, sampling, key), plan.axis_name)


def agree(tok, axis_name):
    """Tensor parallelism: every device takes the first device's tokens [B]. The devices
    compute identical logits and sample with the same key; this makes agreement (and so the
    shared while-loop condition) certain at the cost of one [B] int32 all-reduce."""
    if axis_name is None:
        return tok
    first = jax.lax.axis_index(axis_name) == 0
    return jax.lax.psum(jnp.where(first, tok, jnp.zeros_like(tok)), axis_name)


# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------
def _protected_pages(plan: Plan, pos, active):
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
    step's selections (with lagged selection in "step": this step's own pages, see
    ``INSTALL_LAGGED_AHEAD``), then one launch that copies the pages it assigned slots to into
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
                         implementation=impl)
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
                         payload=lookahead[1], implementation=impl)
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
        implementation=impl)
    host_kv = page_write.write_tokens(kv.host_kv, tok_host_rows, offset, tok_kv,
                                      page_size=plan.page_size, implementation=impl)
    kv = dataclasses.replace(kv, pool=pool, host_kv=page_write.keep_on_host(host_kv))
    return kv, rows, host_rows, record


def _resident_entries(plan: Plan, page_table, sel_all, start: int = 0):
    """sel_all [L - start, R] logical pages of layers ``start ..`` (-1 pad) -> (hits, misses)
    int32 scalars: the selected (KV head, page) entries with / without a slot in
    ``page_table``."""
    P = plan.spec.num_logical_pages
    lcol = jnp.arange(start, start + sel_all.shape[0], dtype=jnp.int32)[:, None]
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
    its own pages (``INSTALL_LAGGED_AHEAD``), counted instead; the misses after it are host
    reads, or with ``pool_only`` (attention had no host operand) ``dropped``: left out of
    attention (never, by ``pool_only_reads``; counted so a broken bound shows)."""
    nd = plan.num_dense  # the dense layers select nothing
    n_hit, n_read = _resident_entries(plan, kv.page_table, sel_all[nd:], nd)
    n_miss = n_read
    if before is not None:
        n_hit, n_miss = before
    c = kv.counters
    written = (plan.spec.num_layers - nd) * n_active
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


# The selector takes the new token's K from the stacked K/V that is written to the cache
# (Quest's kernel reads it in place) rather than from its own copy of K: one XLA fusion less
# per layer. Read when a step is traced (benchmarks/ab_step.py compares both).
SELECTOR_READS_STACKED_KV = True
# Lagged Quest selection (CacheConfig.selection_lag=1): True = once per step for all layers
# after the layer loop (one launch of each selector kernel instead of one per layer), False =
# per layer inside the loop, "resident" = the first in resident mode, the second with the host
# tier. Qwen-like B=8 at 128k, step vs exact selection: resident 0.846 all layers / 0.939 per
# layer, host tier 0.901 / 0.871 (benchmarks/results/ab_step_lag_{b,c2}_876ff82.json); once
# the host tier's copies of the lagged pages were gone (MASK_PAGES_BEFORE_LOOKUP), all layers
# / per layer in the host tier 0.989 (0.983-1.057; ab_step_mask_c2_lag_94fd037.json): all
# layers in both modes. Read when a step is traced.
BATCH_LAGGED_SELECTION = True
# Schedule "step" with lagged selection: mask the pages of inactive requests in XLA before the
# layer's lookup kernel (which masks them as well). The pages are a slice of ``ahead``; as the
# operand of the two custom calls (lookup, attention) XLA copies that slice, one copy kernel
# per layer and step, while the masking fusions of all layers merge into one or two: the
# Qwen-like B=8 128k host step (all-layer selection) 0.953x (0.944-0.963) of the unmasked one
# (benchmarks/results/ab_step_mask_c2_lag_94fd037.json). Exact selection passes the top-k's
# own output (no slice, no copy). Read when a step is traced.
MASK_PAGES_BEFORE_LOOKUP = True
# Lagged selection, schedule "step": the install at the step start takes the pages this step
# attends to (chosen last step, ``ahead``) instead of the pages the previous step attended to.
# Every page a layer reads is then in the pool before its attention (fetched by the one fetch
# launch at the step start) instead of read in place over PCIe by the attention kernel, one
# step before the install would have moved it anyway. Where no page can be dropped
# (``pool_only_reads``: the default pool or larger) attention then takes no host operand.
# Hits and misses count the step's entries against the pool before that install; host reads
# (0 with such a pool) after it. On the H200 (Qwen-like at 128k, host tier with the 2x pool,
# 16th session): B=16 host / resident 0.962 (0.890 with the previous step's pages installed;
# benchmarks/results/bench_decode_qwen_128k_b16_bc_lag_poolonly_7558eb8.json). While attention
# still took the host operand it measured 0.994x at B=8, with a slow start after a fresh state
# (ab_step_ahead_c2_lag_8d2f278.json). Read when a step is traced.
INSTALL_LAGGED_AHEAD = True


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
    sparse = (jnp.arange(L) >= plan.num_dense)[:, None, None, None]
    ok = (ahead >= 0) & active[None, :, None, None] & sparse
    return jnp.where(ok, b * plan.pages_per_seq + ahead, INVALID).reshape(L, -1)


def decode_step(plan: Plan, params, st: DecodeState, sampling: Sampling, stop_ids, max_new,
                enabled=None):
    """One token for every active request. Returns (state, tokens [B] (-1 if inactive)).

    ``enabled``: optional bool scalar; False makes the step a no-op for every request (all
    inactive: no token, no write, no summary or ``ahead`` change, the random key kept), so a
    loop body may run a fixed number of steps. The LRU may still install the previous
    step's pages (residency only, never a value)."""
    cfg, spec, ps = plan.model, plan.spec, plan.page_size
    B, Np, H = plan.batch, plan.pages_per_seq, cfg.num_kv_heads
    P = spec.num_logical_pages
    impl = plan.cache.implementation
    active = ~st.done if enabled is None else ~st.done & enabled
    pos = st.lengths
    b_idx = jnp.arange(B, dtype=jnp.int32)
    logical = jnp.where(active, b_idx * Np + pos // ps, INVALID)
    offset = pos % ps
    positions = jnp.where(active, pos, INVALID)
    protect = _protected_pages(plan, pos, active)[None, :]
    kv0 = st.kv
    install = plan.per_step and plan.cache.reuse
    # lagged, schedule "step": the install takes this step's own pages (INSTALL_LAGGED_AHEAD)
    prefetch = install and plan.lagged and plan.in_place and INSTALL_LAGGED_AHEAD
    # ... and then attention reads the pool only when no page can be dropped (pool_only_reads)
    pool_only = prefetch and pool_only_reads(plan)
    before = None  # the step's own pages (prefetch): (hits, misses) before their install
    if install:
        look_in = st.lookahead
        if prefetch:
            look_in = (lagged_requests(plan, st.summaries[-1], active),)
            before = _resident_entries(plan, kv0.page_table, look_in[0])
        kv0 = install_previous(plan, kv0, look_in, protect)
    # lagged Quest for all layers at once after the loop: each layer stores its query and new
    # K/V row in ``sel_in`` ([L, B, Hq, D], [L, B, 2, H, D]) instead of selecting
    L, Hq, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
    batched = plan.lagged and plan.cache.selector == "quest" and (
        plan.cache.mode == "resident" if BATCH_LAGGED_SELECTION == "resident"
        else bool(BATCH_LAGGED_SELECTION))
    sel_in = ((jnp.zeros((L, B, Hq, D), cfg.dtype), jnp.zeros((L, B, 2, H, D), spec.jnp_dtype))
              if batched else ())

    def attend_dense(layer, lp, h, q, k, v, carry):
        """The first plan.num_dense layers: every valid page, read from device memory."""
        kv, summ, look, dense, sel_in = carry
        q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]
        tok_kv = jnp.stack([k1, v1], axis=1).astype(spec.jnp_dtype)
        if plan.cache.mode == "host":
            kv = kvcache.write_through(spec, kv, layer, logical, offset, tok_kv, implementation=impl)
            dense = kvcache.write_resident(spec, dense, layer, logical, offset, tok_kv,
                                           implementation=impl)
            pool = dense.pool
        else:
            kv = kvcache.write_resident(spec, kv, layer, logical, offset, tok_kv, implementation=impl)
            pool = kv.pool
        pages = dense_select.dense_select(jnp.maximum(positions + 1, 1), num_pages=Np,
                                          num_kv_heads=H, page_size=ps)
        pages = jnp.where(active[:, None, None], pages, INVALID)
        rows = jnp.where(pages >= 0, layer * P + b_idx[:, None, None] * Np + pages, INVALID)
        out, _ = sparse_paged_attention(q1, pool, rows, pages, jnp.where(active, pos + 1, 1),
                                        page_size=ps, num_kv_heads=H, implementation=impl)
        return out[:, None].astype(q.dtype), (kv, summ, look, dense, sel_in)

    def attend(layer, lp, h, q, k, v, carry):
        kv, summ, look, dense, sel_in = carry
        q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]
        tok_kv = jnp.stack([k1, v1], axis=1).astype(spec.jnp_dtype)       # [B, 2, H, D]
        if plan.in_place:
            pass  # written by lookup_in_place, after the selection
        elif plan.cache.mode == "host":
            kv = kvcache.write_through(spec, kv, layer, logical, offset, tok_kv, implementation=impl)
        else:
            kv = kvcache.write_resident(spec, kv, layer, logical, offset, tok_kv, implementation=impl)
        if batched:  # attend to the pages chosen last step; select for the next after the loop
            pages = summ[-1][layer]
            sel_in = tuple(a.at[layer].set(x) for a, x in zip(sel_in, (q1, tok_kv)))
        else:
            summ, ahead = selection.split_ahead(summ, plan.lagged)
            summ, pages = selection.update_and_select(
                plan.cache.selector, summ, layer, lp, cfg, h, q1,
                tok_kv if SELECTOR_READS_STACKED_KV else k1, positions, num_pages=Np,
                k=plan.k, page_size=ps, num_sink_pages=plan.cache.sink_pages,
                implementation=impl, ahead=plan.lagged)
            if plan.lagged:  # attend to the pages chosen last step; keep these for the next
                keep = jnp.where(active[:, None, None], pages, ahead[layer])  # inactive: kept
                pages, summ = ahead[layer], summ + (ahead.at[layer].set(keep),)
        # inactive requests select nothing (the in-place lookup masks them itself; masking its
        # lagged pages here too is a fusion instead of a copy of the slice)
        if not plan.in_place or (MASK_PAGES_BEFORE_LOOKUP and plan.lagged):
            pages = jnp.where(active[:, None, None], pages, INVALID)
        host = {}
        if plan.in_place:
            kv, rows, host_rows, record = lookup_in_place(plan, kv, layer, pages, active, logical,
                                                          offset, tok_kv, look[0])
            look = (record,)
            if not pool_only:  # pages the pool could not take are read in place from the host
                host = dict(host=kv.host_kv, host_rows=host_rows)
        else:
            sel = jnp.where(pages >= 0, b_idx[:, None, None] * Np + pages, INVALID)
            if plan.per_step:
                kv, rows, scr = lookup_and_fetch(plan, kv, layer, sel)
                look = (look[0].at[layer].set(sel.reshape(-1)), look[1].at[layer].set(scr))
            elif plan.cache.mode == "host":
                kv, rows = kvcache.ensure_resident(spec, kv, sel.reshape(1, -1), protect,
                                                   layers=layer[None], implementation=impl)
                rows = rows.reshape(sel.shape)
            else:
                rows = jnp.where(sel >= 0, layer * P + sel, INVALID)
        out, _ = sparse_paged_attention(q1, kv.pool, rows, pages, jnp.where(active, pos + 1, 1),
                                        page_size=ps, num_kv_heads=H, implementation=impl, **host)
        if host:  # order the next in-place host write after this read (no host-array copy)
            host_kv, out = jax.lax.optimization_barrier((kv.host_kv, out))
            kv = dataclasses.replace(kv, host_kv=host_kv)
        return out[:, None].astype(q.dtype), (kv, summ, look, dense, sel_in)

    x = llama.embed(params, cfg, st.last_token[:, None])
    tpos = jnp.maximum(pos, 0)[:, None]
    carry = (kv0, st.summaries, st.lookahead, st.dense, sel_in)
    nd = plan.num_dense
    x, carry = llama.run_layers(params, cfg, x, tpos, attend_dense, carry, start=0, stop=nd,
                                unroll=plan.layer_unroll, axis_name=plan.axis_name)
    x, carry = llama.run_layers(params, cfg, x, tpos, attend, carry, start=nd,
                                unroll=plan.layer_unroll, axis_name=plan.axis_name)
    kv, summ, look, dense, sel_in = carry
    if batched:
        lpos = jnp.where(jnp.arange(L)[:, None] >= nd, positions[None, :], INVALID)  # [L, B]
        summ, ahead = selection.quest_update_select_all_layers(
            summ[:-1], *sel_in, lpos, k=plan.k, page_size=ps,
            num_sink_pages=plan.cache.sink_pages, implementation=impl)
        summ = summ + (jnp.where(lpos[:, :, None, None] >= 0, ahead, st.summaries[-1]),)
    if plan.in_place:
        kv = count_in_place(plan, kv, look[0], jnp.sum(active).astype(jnp.int32), before,
                            pool_only)
    logits = llama.final_logits(params, cfg, x)
    key, sub = jax.random.split(st.key)
    if enabled is not None:
        key = jnp.where(enabled, key, st.key)
    tok = agree(sample(logits[:, 0], sampling, sub), plan.axis_name)
    tok = jnp.where(active, tok, INVALID)
    lengths = jnp.where(active, pos + 1, pos)
    n_gen = st.n_generated + active.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=1)
    done = st.done | (active & (stop | (n_gen >= max_new) | (lengths >= plan.max_context)))
    if plan.cache.mode == "host":
        kv = kvcache.tick(kv)
    st = DecodeState(kv=kv, summaries=summ, lengths=lengths,
                     last_token=jnp.where(active, tok, st.last_token), done=done,
                     n_generated=n_gen, key=key, lookahead=look, dense=dense)
    return st, tok


# Decode steps per iteration of the round's while loop. Each iteration ends with the loop
# condition read back by the host, which then launches the next iteration's CUDA graph; more
# steps per iteration amortize that round trip over more tokens (a step past the round's end
# or after every request finished is a no-op, see ``decode_step(enabled=)``). Read when a
# round is traced.
STEPS_PER_ITERATION = 1


def steps_per_iteration(plan: Plan) -> int:
    """Decode steps per while-loop iteration (``STEPS_PER_ITERATION``, at most round_steps)."""
    return max(1, min(int(STEPS_PER_ITERATION), plan.cache.round_steps))


def _decode_round(plan: Plan, params, state: DecodeState, sampling: Sampling, stop_ids, max_new):
    N, B = plan.cache.round_steps, plan.batch
    buf = jnp.full((B, N), INVALID, jnp.int32)
    if plan.layer_unroll < plan.model.num_layers:
        # a rolled layer loop scans stacked weights: stack them once per round, not per step
        params = dict(params, layers=llama.stack_layer_tree(params["layers"]))

    def cond(c):
        i, st, _ = c
        return (i < N) & ~jnp.all(st.done)

    def body(c):
        i, st, buf = c
        st, tok = decode_step(plan, params, st, sampling, stop_ids, max_new)
        buf = buf.at[:, i].set(tok)
        i = i + 1
        for _ in range(1, steps_per_iteration(plan)):  # further steps: no-ops past the end
            go = (i < N) & ~jnp.all(st.done)
            st, tok = decode_step(plan, params, st, sampling, stop_ids, max_new, enabled=go)
            buf = buf.at[:, i].set(tok, mode="drop")
            i = i + go.astype(jnp.int32)
        return i, st, buf

    steps, state, buf = jax.lax.while_loop(cond, body, (jnp.int32(0), state, buf))
    return state, buf, steps


@functools.lru_cache(maxsize=64)
def _round_fn(plan: Plan, shardings_key):
    shardings = _SHARDINGS[shardings_key]
    return jax.jit(functools.partial(_decode_round, plan), donate_argnames=("state",),
                   out_shardings=(shardings, None, None),
                   compiler_options=round_compiler_options(plan) or None)


_SHARDINGS: dict = {}


def decode_round(plan: Plan, params, state: DecodeState, sampling: Sampling, stop_ids, max_new):
    """Up to ``plan.cache.round_steps`` decode steps in one compiled program.

    Returns (state, tokens [B, round_steps] int32 (-1 = no token), steps int32).
    ``state`` is donated.
    """
    state, key = _committed(state)
    return _round_fn(plan, key)(params, state, sampling, stop_ids, max_new)


def _committed(state: DecodeState):
    """Commit every leaf to its current sharding (a no-op for committed arrays), so the first
    round (fresh arrays from prefill) and later rounds (jit outputs) share one compilation."""
    sh = state_shardings(state)
    key = (jax.tree.structure(sh), tuple(jax.tree.leaves(sh)))
    _SHARDINGS.setdefault(key, sh)
    return jax.device_put(state, sh), key


def lower_decode_round(plan: Plan, params, state: DecodeState, sampling: Sampling, stop_ids, max_new):
    """The lowered (not yet compiled) decode round, for HLO inspection in tests."""
    state, key = _committed(state)
    return _round_fn(plan, key).lower(params, state, sampling, stop_ids, max_new)
