"""The decode state: what the compiled decode loop carries from step to step (donated
between rounds), and its construction after a prefill."""
from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from jaxkv import cache as kvcache
from jaxkv import selectors
from jaxkv.plan import Plan
from jaxkv.sampling import per_request
from jaxkv.spec import INVALID


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries (donated between rounds).

    kv: HostTierCache (host mode) or ResidentCache. summaries: selector summaries.
    lengths [B]: tokens in the cache = position of ``last_token``. last_token [B]: the next
    token to feed. done [B] bool. n_generated [B]: tokens produced so far. key [B]: each
    request's PRNG key.
    logprobs: () or ([B, N] float32,),
    the log-probability of each round step's chosen token under the model (NaN: none).
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
    logprobs: tuple = ()


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
                n_generated: int = 1, lookahead=None, dense=(), logprobs: bool = False) -> DecodeState:
    """The decode state right after a prefill: lengths [B] (tokens in the cache), last_token [B]
    (the next token to feed), ``done`` [B] bool (default all False), every request's
    ``n_generated`` set to the given count, empty per-step selections (``lookahead`` default:
    ``init_lookahead(plan)``), a per-round buffer of
    chosen-token log-probabilities if ``logprobs``. ``key``: one PRNG key per request [B], or
    one key (request b then draws with ``fold_in(key, b)``)."""
    B = plan.batch
    return DecodeState(
        kv=kv, summaries=summaries, lengths=jnp.asarray(lengths, jnp.int32),
        last_token=jnp.asarray(last_token, jnp.int32),
        done=jnp.zeros((B,), jnp.bool_) if done is None else jnp.asarray(done),
        n_generated=jnp.full((B,), n_generated, jnp.int32), key=per_request(key, B),
        lookahead=init_lookahead(plan) if lookahead is None else lookahead, dense=dense,
        logprobs=(jnp.full((B, plan.cache.round_steps), jnp.nan, jnp.float32),) if logprobs else ())


def init_lookahead(plan: Plan):
    """Per-step scheduling: the previous step's selections [L, R] (and, "scratch", the scratch
    rows they were fetched into)."""
    if not plan.per_step:
        return ()
    shape = (plan.model.num_layers, plan.requests_per_layer)
    if plan.in_place:
        return (jnp.full(shape, INVALID, jnp.int32),)
    return (jnp.full(shape, INVALID, jnp.int32), jnp.full(shape, INVALID, jnp.int32))


def init_summaries(plan: Plan):
    """The selector's empty summaries, then (``jaxkv.selectors.split``) with quantized KV the
    stored keys' shift [L, B, H, D] float32 (zeros until the prefill) and with lagged
    selection ``ahead`` [L, B, H, k] int32, all -1 (no page)."""
    m = plan.model
    shift = (jnp.zeros((m.num_layers, plan.batch, m.num_kv_heads, m.head_dim), jnp.float32)
             if plan.key_shift else None)
    ahead = (jnp.full((m.num_layers, plan.batch, m.num_kv_heads, plan.k), INVALID, jnp.int32)
             if plan.lagged else None)
    return selectors.join(plan.selector.init(plan), shift, ahead)


def state_shardings(state: DecodeState):
    """Output shardings that keep every leaf where it is (the host tier stays pinned)."""
    return jax.tree.map(lambda a: a.sharding, state)


def abstract_state(plan: Plan, lengths, *, device=None) -> DecodeState:
    """The state :func:`start_state` builds after a prefill of ``lengths``, as
    ``jax.ShapeDtypeStruct`` leaves that carry their shardings and memory spaces (the host
    tier in pinned host memory, the rest on ``device``); nothing is allocated. With it a decode
    round lowers at full size on a machine that could not hold the cache (an 8B-like model's
    128k tier for an abstract H200 on a CPU: :mod:`jaxkv.lowering`), and its bytes count
    before anything is allocated (``validation.nbytes_by_space``). One device only."""
    B = plan.batch

    def build():
        return start_state(plan, init_kv(plan, traced=True), init_summaries(plan), lengths,
                           jnp.zeros((B,), jnp.int32), jax.random.key(0),
                           dense=init_dense(plan, traced=True))

    dev = kvcache.device_sharding(device)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev,
                                                        _memory_space=jax.memory.Space.Device),
                         jax.eval_shape(build))
    if plan.cache.mode != "host":
        return state
    host_kv = jax.ShapeDtypeStruct(plan.spec.host_shape, plan.spec.dtype,
                                   sharding=kvcache.host_sharding(device),
                                   _memory_space=jax.memory.Space.Host)
    return state.replace(kv=state.kv.replace(host_kv=host_kv))
