"""Kept contexts: a request's KV (host tier or resident pool), selector summaries and
conversation, reused by a later :func:`jaxkv.generate` call without prefilling it again.

``generate(..., keep=True)`` returns a :class:`Context` in ``result.context``. A later
``generate(model, new_prompts, context=ctx)`` continues it: each request's tokens that are
not in the cache yet (the last generated token) and the new prompt's tokens are prefilled
against the cached ones (:func:`jaxkv.prefill.extend_layer`: every appended token attends to
the whole cached context and to the appended tokens before it, as one long prompt would),
then generation goes on. With as many prompts as the context has requests, request ``b``
continues request ``b`` (multi-turn chat); a context of one request with N prompts forks it
N times (several questions over one document). ``context=ctx.select(i, ...)`` picks
requests.

Isolation and cost: every call copies the context's pages into fresh arrays laid out for the
new call's plan (:func:`relayout`), so calls never write into the context or into each
other, and one context can be continued any number of times. The copy moves each request's
KV once through host memory (``context_copy_time_s`` in the stats): O(tokens) bytes, far
less than the prefill it replaces. The appended tokens' prefill reads every cached page of
each layer once (dense attention over the context, then the selector's summaries take the
new tokens one by one, as decode steps would); its cost grows with the context and the turn
like one chunk of a long prompt's prefill.

A request cut by a stop string keeps only the tokens up to the string; its cache may hold the
K/V of a few tokens after them (generated in the same round). Attention never reads them (the
length masks them) and the next tokens overwrite them; the selector's page summaries of that
last page still include them until then (a possible difference in the pages chosen, never in
what is read as context).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvcache
from jaxkv import selectors
from jaxkv.plan import Plan
from jaxkv.spec import INVALID


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """A kept context (see the module doc). ``tokens[b]``: request b's conversation so far
    (prompt and generated ids); ``cached[b]``: how many of them have their K/V in the arrays
    (the rest are fed first by the next call). ``messages[b]``: the chat so far for a
    request built from chat messages (None otherwise), so new turns render with the template.
    """

    plan: Plan
    kv_pages: jax.Array          # host mode: the host tier; resident: the pool, [L*P, R]
    dense_pages: object          # host mode with dense layers: their device copy, else None
    summaries: tuple
    tokens: tuple
    cached: tuple
    messages: tuple
    prefill_tokens_per_s: float
    reply_start: tuple = ()      # per request: where the last generated reply starts in tokens

    @property
    def batch(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> list[int]:
        """Tokens per request (conversation length)."""
        return [len(t) for t in self.tokens]

    def select(self, *requests: int) -> "ContextView":
        """The given requests of this context (e.g. ``ctx.select(0, 0, 2)``: two forks of
        request 0 and one continuation of request 2) for ``generate(..., context=...)``."""
        for r in requests:
            if not isinstance(r, (int, np.integer)) or not 0 <= r < self.batch:
                raise ValueError(f"Context.select: request {r!r} is not in [0, {self.batch})")
        if not requests:
            raise ValueError("Context.select needs at least one request index")
        return ContextView(self, tuple(int(r) for r in requests))

    def __repr__(self):
        return (f"Context({self.batch} request(s), tokens={self.lengths}, "
                f"mode={self.plan.cache.mode!r}, selector={self.plan.cache.selector!r})")


@dataclasses.dataclass(frozen=True)
class ContextView:
    context: Context
    requests: tuple


def sources(context, num_prompts: int) -> tuple[Context, list[int]]:
    """(context, the context request each new request continues)."""
    if isinstance(context, ContextView):
        src = list(context.requests)
        context = context.context
    elif isinstance(context, Context):
        if context.batch == num_prompts:
            src = list(range(num_prompts))
        elif context.batch == 1:
            src = [0] * num_prompts
        else:
            raise ValueError(
                f"context has {context.batch} requests and there are {num_prompts} prompts: "
                "pass one prompt per request, or pick requests with context.select(...)")
    else:
        raise TypeError(f"context must be a jaxkv Context (generate(..., keep=True).context), "
                        f"got {type(context).__name__}")
    if len(src) != num_prompts:
        raise ValueError(f"context.select(...) picked {len(src)} requests for {num_prompts} prompts")
    # generate never deletes a context's arrays; the caller may have (.delete(), or donated
    # them to a jitted function), and JAX would fail inside the copy
    dead = [name for name in ("kv_pages", "dense_pages", "summaries")
            if any(a.is_deleted() for a in jax.tree.leaves(getattr(context, name))
                   if isinstance(a, jax.Array))]
    if dead:
        raise ValueError(f"context: its {' and '.join(dead)} arrays have been deleted (.delete(), "
                         "or donated to a jitted function): keep them alive to continue the "
                         "context, or build it again with generate(..., keep=True)")
    return context, src


def check_compatible(context: Context, plan: Plan):
    """The new call must read the pages and summaries the way they were written."""
    a, b = context.plan, plan
    for what, x, y in (("mode", a.cache.mode, b.cache.mode),
                       ("selector", a.cache.selector, b.cache.selector),
                       ("page_size", a.page_size, b.page_size),
                       ("candidate_block", a.cache.candidate_block, b.cache.candidate_block),
                       ("kv_dtype", a.kv_dtype, b.kv_dtype),  # resolved: None is the model's
                       ("kv_key_shift", a.key_shift, b.key_shift),
                       ("kv_key_rotation", a.key_rotation, b.key_rotation),
                       ("dense_layers", a.dense_set, b.dense_set),
                       ("selection_lag", a.lagged, b.lagged)):
        if x != y:
            note = " (None resolves to the model's dtype)" if what == "kv_dtype" else ""
            raise ValueError(f"the context was built with CacheConfig {what}={x!r}, this call "
                             f"uses {y!r}{note}: continue a context with the same cache settings")
    if a.model != b.model:
        raise ValueError("the context belongs to another model: continue it with the same model")


def keep(plan: Plan, state, tokens: list[list[int]], messages: list, prefill_tokens_per_s: float,
         reply_start: list[int]) -> Context:
    """A context from the final decode state (its arrays, which no later call donates)."""
    lengths = np.asarray(state.lengths)
    kv = state.kv
    pages = kv.host_kv if plan.cache.mode == "host" else kv.pool
    dense = state.dense.pool if plan.num_dense and plan.cache.mode == "host" else None
    cached = tuple(min(int(n), len(t)) for n, t in zip(lengths, tokens))
    return Context(plan=plan, kv_pages=pages, dense_pages=dense, summaries=state.summaries,
                   tokens=tuple(tuple(t) for t in tokens), cached=cached,
                   messages=tuple(messages), prefill_tokens_per_s=prefill_tokens_per_s,
                   reply_start=tuple(reply_start))


def _in_host_memory_of_a_gpu(x) -> bool:
    """Whether ``x`` lives in pinned host memory that the GPU's programs do not compute on
    (then the copies go through numpy; on the CPU both memory kinds are RAM that jit reads)."""
    return (jax.default_backend() != "cpu" and isinstance(x, jax.Array)
            and x.sharding.memory_kind == "pinned_host")


def _copy_pages(old: jax.Array, shape: tuple, sharding, layers: int, old_plan: Plan, plan: Plan,
                src) -> jax.Array:
    """Rows ``shape`` = [layers * B * Np (+ unused rows, ``spec.alloc_rows``), R] in
    ``sharding`` (None: ``old``'s): the new request b's pages are the old request src[b]'s
    (the pages that fit), the rest zero. One jitted gather where jit computes on ``old``'s
    memory; a pinned host tier on the GPU is built on the host (``np.zeros``) and placed
    once: no buffer of the tier's size on the device."""
    n = min(old_plan.pages_per_seq, plan.pages_per_seq)
    geometry = (layers, old_plan.batch, old_plan.pages_per_seq, plan.batch, plan.pages_per_seq,
                n, tuple(shape))
    if not _in_host_memory_of_a_gpu(old):
        old = jnp.asarray(old)
        sharding = sharding or old.sharding
        return _copy_pages_jit(geometry, sharding)(old, jnp.asarray(src, jnp.int32))
    used = layers * old_plan.batch * old_plan.pages_per_seq
    a = np.asarray(jax.device_get(old))[:used].reshape(layers, old_plan.batch,
                                                        old_plan.pages_per_seq, -1)
    out = np.zeros(shape, a.dtype)
    rows = out[:layers * plan.batch * plan.pages_per_seq].reshape(
        layers, plan.batch, plan.pages_per_seq, a.shape[-1])
    rows[:, :, :n] = a[:, src, :n]
    return jax.device_put(out, sharding)


@functools.lru_cache(maxsize=32)
def _copy_pages_jit(geometry, sharding):
    layers, old_b, old_np, new_b, new_np, n, shape = geometry

    def copy(old, src):
        if jax.typeof(old).memory_space == jax.memory.Space.Host:   # the CPU's host tier
            old = jax.device_put(old, jax.memory.Space.Device)
        a = old[:layers * old_b * old_np].reshape(layers, old_b, old_np, -1)
        a = jnp.take(a, src, axis=1)[:, :, :n]                          # [L, B', n, R]
        a = jnp.pad(a, ((0, 0), (0, 0), (0, new_np - n), (0, 0))).reshape(-1, a.shape[-1])
        return jnp.pad(a, ((0, shape[0] - a.shape[0]), (0, 0)))

    return jax.jit(copy, out_shardings=sharding)


def _copy_summary(old, new, old_plan: Plan, plan: Plan, src, ahead: bool):
    """A summary leaf [L, B, ...] (Quest's [L, B, Np, H, D], the two-stage selector's key copy
    [L, B, H, Np, ps, D], or the lagged ``ahead`` [L, B, H, k], page indices): the region both
    shapes hold is copied, so a larger capacity keeps its pages (empty past the old ones)."""
    return _copy_summary_jit(ahead, plan.pages_per_seq)(old, new, jnp.asarray(src, jnp.int32))


@functools.lru_cache(maxsize=32)
def _copy_summary_jit(ahead: bool, pages_per_seq: int):
    def copy(old, new, src):
        a = jnp.take(old, src, axis=1)
        if ahead:
            k = min(a.shape[-1], new.shape[-1])
            out = jnp.full(new.shape, INVALID, new.dtype)
            return out.at[..., :k].set(jnp.where(a[..., :k] < pages_per_seq, a[..., :k],
                                                 INVALID))
        both = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, new.shape))
        return new.at[both].set(a[both])

    return jax.jit(copy, donate_argnums=(1,))


def relayout(context: Context, plan: Plan, src: list[int], eng):
    """Fresh (kv, summaries, dense) for ``plan`` holding the context's pages for the new
    requests (request b <- context request src[b]); the device pool of the host mode starts
    empty (its pages are fetched again as the selector asks for them)."""
    old, spec = context.plan, plan.spec
    L = plan.model.num_layers
    if plan.cache.mode == "host":
        kv = kvcache.init_cache(spec, traced=True)      # the pool and LRU state, no host tier
        kv = dataclasses.replace(kv, host_kv=_copy_pages(
            context.kv_pages, spec.host_shape, kvcache.host_sharding(), L, old, plan, src))
    else:
        kv = kvcache.ResidentCache(pool=_copy_pages(
            context.kv_pages, spec.host_shape, kvcache.device_sharding(), L, old, plan, src),
            counters=kvcache.CacheCounters.zeros())
    dense = eng.init_dense(plan) if context.dense_pages is None else kvcache.ResidentCache(
        pool=_copy_pages(context.dense_pages, plan.dense_spec.host_shape,
                         kvcache.device_sharding(), max(1, plan.num_dense), old, plan, src),
        counters=kvcache.CacheCounters.zeros())
    fresh = eng.init_summaries(plan)
    # the selector's arrays and the keys' shift are per request: copied by region
    own, shift, ahead = selectors.split(context.summaries, plan)
    fown, fshift, fahead = selectors.split(fresh, plan)
    own, shift = jax.tree.map(lambda o, n: _copy_summary(o, n, old, plan, src, False),
                              (tuple(own), shift), (tuple(fown), fshift))
    if plan.lagged:
        ahead = _copy_summary(ahead, fahead, old, plan, src, True)
    return kv, selectors.join(own, shift, ahead), dense
