"""The decode step and the compiled decode round.

:func:`decode_step` produces one token for every active request: per layer it selects the
pages to read (the plan's selector), maps them to rows (the plan's residency schedule, which
fetches or records misses), attends over them, and writes the new token's K/V through.
:func:`decode_round` is one jitted ``lax.while_loop`` of up to ``round_steps`` such steps with
the decode state donated: no host sync inside.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import residency, selectors
from jaxkv.config import Sampling
from jaxkv.kernels import dense_select, kv_quant
from jaxkv.kernels.sparse_attention import sparse_paged_attention
from jaxkv.models import llama
from jaxkv.plan import Plan, round_compiler_options
from jaxkv.sampling import agree, sample, split as split_keys
from jaxkv.spec import INVALID
from jaxkv.state import DecodeState, state_shardings


def stored_kv(plan: Plan, kv, shift=None, rot=None):
    """K/V ``kv`` [..., 2, H, D] as the cache stores them: with quantized KV the keys less
    their request's shift ``shift`` (broadcast to [..., H, D], float32; ``plan.key_shift``),
    which the softmax cancels, then rotated by ``rot`` (``kv_quant.hadamard(D)``, built once
    by the caller; ``plan.key_rotation``), which the rotated queries cancel. Other plans
    store them as they are."""
    if not (plan.key_shift or plan.key_rotation):
        return kv
    k_st = kv[..., 0, :, :].astype(jnp.float32)
    if plan.key_shift:
        k_st = k_st - shift
    if plan.key_rotation:
        k_st = k_st @ rot
    return kv.at[..., 0, :, :].set(k_st.astype(kv.dtype))


def decode_step(plan: Plan, params, st: DecodeState, sampling: Sampling, stop_ids, max_new,
                step_index=0):
    """One token for every active request. Returns (state, tokens [B] (-1 if inactive)).
    ``step_index``: the step's column in ``st.logprobs``."""
    cfg, spec, ps = plan.model, plan.spec, plan.page_size
    B, Np, H = plan.batch, plan.pages_per_seq, cfg.num_kv_heads
    P = spec.num_logical_pages
    impl = plan.cache.implementation
    selector, sched = plan.selector, residency.schedule_for(plan)
    active = ~st.done
    pos = st.lengths
    b_idx = jnp.arange(B, dtype=jnp.int32)
    logical = jnp.where(active, b_idx * Np + pos // ps, INVALID)
    offset = pos % ps
    positions = jnp.where(active, pos, INVALID)
    protect = residency.protected_pages(plan, pos, active)[None, :]
    kv0, before, pool_only = sched.begin(plan, st.kv, st.lookahead,
                                         st.summaries[-1] if plan.lagged else None, active,
                                         protect)
    # Lagged selection with a selector that selects all layers at once after the layer loop:
    # each layer stores its query and new K/V row in ``sel_in`` ([L, B, Hq, D],
    # [L, B, 2, H, D]) instead of selecting.
    L, Hq, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
    batched = plan.lagged and selector.selects_all_layers
    sel_in = ((jnp.zeros((L, B, Hq, D), cfg.dtype), jnp.zeros((L, B, 2, H, D), plan.summary_dtype))
              if batched else ())

    rot = kv_quant.hadamard(D) if plan.key_rotation else None
    materialize_qk = plan.cache.tuning.materialize_qk
    if materialize_qk is None:
        materialize_qk = selector.two_stage

    def stored(tok_kv, summ, layer):
        """The new token's K/V [B, 2, H, D] as the cache stores them (:func:`stored_kv`)."""
        shift = selectors.split(summ, plan)[1][layer] if plan.key_shift else None
        return stored_kv(plan, tok_kv, shift, rot)

    def query(q1):
        """The query attention multiplies with the stored keys (rotated alike)."""
        if rot is None:
            return q1
        return (q1.astype(jnp.float32) @ rot).astype(q1.dtype)

    def attend_dense(layer, lp, h, q, k, v, carry):
        """The layers of ``plan.dense_set``: every valid page, read from device memory."""
        kv, summ, look, dense, sel_in = carry
        q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]
        tok_kv = jnp.stack([k1, v1], axis=1).astype(plan.summary_dtype)
        kv, dense, pool, at = sched.write_dense(plan, kv, dense, layer, logical, offset,
                                                stored(tok_kv, summ, layer))
        pages = dense_select.dense_select(jnp.maximum(positions + 1, 1), num_pages=Np,
                                          num_kv_heads=H, page_size=ps)
        pages = jnp.where(active[:, None, None], pages, INVALID)
        rows = jnp.where(pages >= 0, at * P + b_idx[:, None, None] * Np + pages, INVALID)
        out, _ = sparse_paged_attention(query(q1), pool, rows, pages,
                                        jnp.where(active, pos + 1, 1), page_size=ps,
                                        num_kv_heads=H, implementation=impl)
        return out[:, None].astype(q.dtype), (kv, summ, look, dense, sel_in)

    def attend(layer, lp, h, q, k, v, carry):
        kv, summ, look, dense, sel_in = carry
        q1, k1, v1 = q[:, 0], k[:, 0], v[:, 0]
        tok_kv = jnp.stack([k1, v1], axis=1).astype(plan.summary_dtype)       # [B, 2, H, D]
        if materialize_qk:  # one product each, read by every consumer
            q1, tok_kv = jax.lax.optimization_barrier((q1, tok_kv))
        st_kv = stored(tok_kv, summ, layer)
        kv = sched.write(plan, kv, layer, logical, offset, st_kv)
        # select
        if batched:  # attend to the pages chosen last step; select for the next after the loop
            pages = summ[-1][layer]
            sel_in = tuple(a.at[layer].set(x) for a, x in zip(sel_in, (q1, tok_kv)))
        else:
            own, shift, ahead = selectors.split(summ, plan)
            own, pages = selector.update_select(plan, own, layer, lp, h, q1, tok_kv, positions,
                                                ahead=plan.lagged)
            if plan.lagged:  # attend to the pages chosen last step; keep these for the next
                keep = jnp.where(active[:, None, None], pages, ahead[layer])  # inactive: kept
                pages, ahead = ahead[layer], ahead.at[layer].set(keep)
            summ = selectors.join(own, shift, ahead)
        # inactive requests select nothing (a lookup that masks them itself still gets lagged
        # pages masked here: a fusion instead of a copy of the slice of ``ahead``)
        if not sched.lookup_masks_inactive or plan.lagged:
            pages = jnp.where(active[:, None, None], pages, INVALID)
        # residency, then attention
        kv, rows, host, look = sched.rows(plan, kv, layer, pages, look, b_idx=b_idx,
                                          active=active, logical=logical, offset=offset,
                                          tok_kv=st_kv, protect=protect, pool_only=pool_only)
        out, _ = sparse_paged_attention(query(q1), kv.pool, rows, pages,
                                        jnp.where(active, pos + 1, 1),
                                        page_size=ps, num_kv_heads=H, implementation=impl, **host)
        if host:  # order the next in-place host write after this read (no host-array copy)
            host_kv, out = jax.lax.optimization_barrier((kv.host_kv, out))
            kv = dataclasses.replace(kv, host_kv=host_kv)
        return out[:, None].astype(q.dtype), (kv, summ, look, dense, sel_in)

    x = llama.embed(params, cfg, st.last_token[:, None])
    tpos = jnp.maximum(pos, 0)[:, None]
    carry = (kv0, st.summaries, st.lookahead, st.dense, sel_in)
    # RoPE's cos / sin once per step for every layer: XLA would otherwise emit one cos / sin
    # kernel per layer (Qwen-like B=8: 27 kernels, the step 1.5% longer; docs/decisions.md)
    rope = jax.lax.optimization_barrier(llama.model_rope_tables(cfg, tpos))
    for start, stop, is_dense in plan.layer_runs:
        x, carry = llama.run_layers(params, cfg, x, tpos, attend_dense if is_dense else attend,
                                    carry, start=start, stop=stop, unroll=plan.layer_unroll,
                                    axis_name=plan.axis_name, rope=rope)
    kv, summ, look, dense, sel_in = carry
    if batched:
        lpos = jnp.where(jnp.asarray(plan.sparse_mask)[:, None], positions[None, :],
                         INVALID)                                                  # [L, B]
        own, shift, _ = selectors.split(summ, plan)
        own, ahead = selector.update_select_all_layers(plan, own, *sel_in, lpos)
        summ = selectors.join(own, shift,
                              jnp.where(lpos[:, :, None, None] >= 0, ahead, st.summaries[-1]))
    kv = sched.end(plan, kv, look, active, before, pool_only)
    logits = llama.final_logits(params, cfg, x)
    key, sub = split_keys(st.key)
    tok = agree(sample(logits[:, 0], sampling, sub), plan.axis_name)
    logprobs = st.logprobs
    if logprobs:  # the chosen token's log-probability under the model (temperature 1)
        lsm = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
        lp = jnp.take_along_axis(lsm, jnp.maximum(tok, 0)[:, None], axis=1)[:, 0]
        logprobs = (logprobs[0].at[:, step_index].set(jnp.where(active, lp, jnp.nan)),)
    tok = jnp.where(active, tok, INVALID)
    lengths = jnp.where(active, pos + 1, pos)
    n_gen = st.n_generated + active.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=1)
    done = st.done | (active & (stop | (n_gen >= max_new) | (lengths >= plan.max_context)))
    kv = sched.tick(kv)
    st = DecodeState(kv=kv, summaries=summ, lengths=lengths,
                     last_token=jnp.where(active, tok, st.last_token), done=done,
                     n_generated=n_gen, key=key, lookahead=look, dense=dense,
                     logprobs=logprobs)
    return st, tok


def _decode_round(plan: Plan, params, state: DecodeState, sampling: Sampling, stop_ids, max_new):
    N, B = plan.cache.round_steps, plan.batch
    buf = jnp.full((B, N), INVALID, jnp.int32)
    if plan.layer_unroll < plan.model.num_layers and llama.rolled_weights() == "stack":
        # a rolled layer loop scans stacked weights: stack them once per round, not per step
        params = dict(params, layers=llama.stack_layer_tree(params["layers"]))

    def cond(c):
        i, st, _ = c
        return (i < N) & ~jnp.all(st.done)

    if state.logprobs:  # a fresh per-round buffer
        state = state.replace(logprobs=(jnp.full((B, N), jnp.nan, jnp.float32),))

    def body(c):
        i, st, buf = c
        st, tok = decode_step(plan, params, st, sampling, stop_ids, max_new, step_index=i)
        buf = buf.at[:, i].set(tok)
        return i + 1, st, buf

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
