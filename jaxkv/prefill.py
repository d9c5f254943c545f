"""Prefill: the prompt through the model layer by layer, its K/V written page by page into
the host tier (or the resident pool) and the selector's summaries filled.

:func:`prefill_layer` runs one layer over the whole (bucketed) prompt; the caller loops over
layers, so long prompts show progress and only one layer's K/V is on device at a time.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import cache as kvcache
from jaxkv import selectors
from jaxkv.config import Sampling
from jaxkv.decode import stored_kv
from jaxkv.kernels import kv_quant, page_fetch, page_write
from jaxkv.kernels.prefill_attention import extend_attention, prefill_attention
from jaxkv.models import llama
from jaxkv.plan import Plan
from jaxkv.sampling import agree, sample
from jaxkv.selectors.base import key_mean
from jaxkv.spec import INVALID


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
    ``plan.prefill_token_chunk`` tokens; attention sees the whole prompt.
    """
    cfg, ps = plan.model, plan.page_size
    B, T, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lp = layer_params
    pieces = plan.prefill_token_chunk
    h, q, k, v = _in_token_chunks(lambda x, pos: llama.attention_inputs(lp, cfg, x, pos), pieces,
                                  x, positions)
    attn = prefill_attention(q, k, v, lengths, implementation=plan.cache.implementation,
                             chunk=plan.cache.prefill_chunk)
    x = _in_token_chunks(lambda x, a: llama.layer_output(lp, cfg, x, a, axis_name=plan.axis_name),
                         pieces, x, attn)

    own, shift, ahead = selectors.split(summaries, plan)
    k_st = k
    if plan.key_shift:  # quantized KV: store the keys less the request's mean (softmax-exact)
        mean = key_mean(k, lengths)                                  # [B, H, D] float32
        shift = shift.at[layer].set(mean)
        k_st = k.astype(jnp.float32) - mean[:, None]
    if plan.key_rotation:  # quantized KV: keys rotated (decode rotates its queries alike)
        k_st = k_st.astype(jnp.float32) @ kv_quant.hadamard(k.shape[-1])
    pages = kv_quant.pack_pages(k_st, v, ps, plan.kv_dtype)         # [B, n, R] (quantized rows)
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
        drows = jnp.where(used & plan.is_dense(layer),
                          plan.dense_slot(layer) * plan.spec.num_logical_pages + logical,
                          INVALID).reshape(-1)
        dense = dataclasses.replace(dense, pool=page_write.write_pages(
            dense.pool, drows, pages.reshape(B * n, -1), implementation=impl))
    selector = plan.selector
    own = selector.fill(plan, own, layer, lp, h, k, positions, lengths)
    if plan.lagged:  # the first decode step's pages, chosen with the prompt's last query
        ahead = _first_step_pages(plan, own, ahead, layer, lp, h, q, lengths - 1, lengths)
    return x, kv, selectors.join(own, shift, ahead), dense


def _first_step_pages(plan: Plan, own, ahead, layer, lp, h, q, last, seq_lens):
    """Lagged selection: ``ahead`` with layer ``layer``'s pages for the first decode step,
    chosen with the query at index ``last`` [B] of h [B, T, d] / q [B, T, Hq, D] for
    sequences of ``seq_lens`` [B] tokens."""
    last = jnp.maximum(last, 0)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)                 # [B, 1, d]
    q_last = jnp.take_along_axis(q, last[:, None, None, None], axis=1)[:, 0]      # [B, Hq, D]
    pages = plan.selector.first_pages(plan, own, layer, lp, h_last, q_last, seq_lens)
    return ahead.at[layer].set(pages)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("kv", "summaries", "dense"))
def extend_layer(plan: Plan, layer_params, layer, x, start, count, kv, summaries, dense=()):
    """One layer over tokens appended to a cached context (a continued :class:`Context`).

    x [B, T, d] the appended tokens' hidden states (request b's first ``count[b]`` rows;
    the rest padding); start [B] int32 the tokens already in the cache (the appended ones
    sit at positions ``start + t``); count [B] int32. The new tokens' K/V are written into
    the cache as the decode step writes them (quantized, shifted and rotated alike), each
    new token attends to every cached token before it and to the new ones up to itself
    (the cache's stored, dequantized K/V: what decoding reads), and the selector's summaries
    fold the tokens in at once (``Selector.fold``: what decode steps folding them one by one
    give). Returns
    (x, kv, summaries, dense).
    """
    cfg, ps, spec = plan.model, plan.page_size, plan.spec
    B, T, _ = x.shape
    H, D, Np, P = cfg.num_kv_heads, cfg.head_dim, plan.pages_per_seq, spec.num_logical_pages
    impl = plan.cache.implementation
    t = jnp.arange(T, dtype=jnp.int32)
    valid = t[None, :] < count[:, None]                                        # [B, T]
    positions = start[:, None] + t[None, :]
    lp = layer_params
    h, q, k, v = _in_token_chunks(lambda x, pos: llama.attention_inputs(lp, cfg, x, pos),
                                  plan.prefill_token_chunk, x, positions)
    own, shift, ahead = selectors.split(summaries, plan)
    tok_kv = jnp.stack([k, v], axis=2).astype(plan.summary_dtype)              # [B, T, 2, H, D]
    rot = kv_quant.hadamard(D) if plan.key_rotation else None
    st_kv = stored_kv(plan, tok_kv, shift[layer][:, None] if plan.key_shift else None, rot)
    # write: one entry per appended token
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    logical = jnp.where(valid, b_idx * Np + positions // ps, INVALID).reshape(-1)
    offsets = (positions % ps).reshape(-1)
    flat_kv = st_kv.reshape(B * T, 2, H, D)
    if plan.cache.mode == "host":
        kv = kvcache.write_through(spec, kv, layer, logical, offsets, flat_kv, implementation=impl)
        if plan.num_dense:
            slot = plan.dense_slot(layer)
            dense = kvcache.write_resident(plan.dense_spec, dense, slot,
                                           jnp.where(plan.is_dense(layer), logical, INVALID),
                                           offsets, flat_kv, implementation=impl)
        pages_src = kv.host_kv
    else:
        kv = kvcache.write_resident(spec, kv, layer, logical, offsets, flat_kv, implementation=impl)
        pages_src = kv.pool
    # read back every page of the layer (the cached tokens and the new ones, as stored)
    rows = (layer * P + jnp.arange(B * Np, dtype=jnp.int32))
    buf = jnp.zeros((B * Np, pages_src.shape[1]), pages_src.dtype)
    buf = page_fetch.fetch_pages(pages_src, buf, rows, jnp.arange(B * Np, dtype=jnp.int32),
                                 implementation=impl)
    if plan.cache.mode == "host":  # order the next in-place host write after this read
        host_kv, buf = jax.lax.optimization_barrier((kv.host_kv, buf))
        kv = dataclasses.replace(kv, host_kv=host_kv)
    cached = kv_quant.unpack_rows(buf, H, ps, D).reshape(B, Np, 2, H, ps, D)
    cached = cached.transpose(2, 0, 1, 4, 3, 5).reshape(2, B, Np * ps, H, D)  # [2, B, S, H, D]
    qa = q.astype(jnp.float32) if rot is None else q.astype(jnp.float32) @ rot
    attn = extend_attention(qa, cached[0], cached[1], positions, valid)
    x = _in_token_chunks(lambda x, a: llama.layer_output(lp, cfg, x, a, axis_name=plan.axis_name),
                         plan.prefill_token_chunk, x, attn.astype(q.dtype))
    # the selector's summaries: the appended tokens folded in as decode steps fold them
    pos_valid = jnp.where(valid, positions, INVALID)

    def fold_all(own):
        return tuple(plan.selector.fold(plan, tuple(own), layer, lp, h, q, tok_kv, pos_valid))

    if plan.num_dense:  # dense layers select nothing: decoding leaves their summaries alone
        own = jax.lax.cond(plan.is_dense(layer), tuple, fold_all, tuple(own))
    else:
        own = fold_all(own)
    if plan.lagged:  # the first decode step's pages, chosen with the last appended query
        ahead = _first_step_pages(plan, own, ahead, layer, lp, h, q, count - 1, start + count)
    return x, kv, selectors.join(own, shift, ahead), dense


def embed_prompt(plan: Plan, params, tokens):
    """tokens [B, T] -> x [B, T, d], committed to its device as the layers' outputs are, so
    :func:`prefill_layer` compiles one program for every layer. Compiled per model and token
    shape, not per plan: cache configurations that share a model share this program."""
    x = _embed(plan.model, params, tokens)
    return jax.device_put(x, x.sharding)


@functools.partial(jax.jit, static_argnames=("model",))
def _embed(model, params, tokens):
    return llama.embed(params, model, tokens)


def first_token(plan: Plan, params, x, lengths, sampling: Sampling, key, with_logprob: bool = False):
    """Sample the first new token from the prompt's last position. x [B, T, d] -> [B]
    (and, ``with_logprob``, its log-probability under the model [B] float32). Compiled per
    model, mesh axis and shapes, not per plan (the cache configuration does not enter)."""
    return _first_token(plan.model, plan.axis_name, params, x, lengths, sampling, key,
                        with_logprob=with_logprob)


@functools.partial(jax.jit, static_argnames=("model", "axis_name", "with_logprob"))
def _first_token(model, axis_name, params, x, lengths, sampling: Sampling, key,
                 with_logprob: bool = False):
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)   # [B, 1, d]
    logits = llama.final_logits(params, model, last)[:, 0]
    tok = agree(sample(logits, sampling, key), axis_name)
    if not with_logprob:
        return tok
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return tok, jnp.take_along_axis(lsm, tok[:, None], axis=1)[:, 0]
