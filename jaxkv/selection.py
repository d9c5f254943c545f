"""Selector dispatch for the decode loop: page summaries (build, update) and page selection.

Summaries live on device, one entry per (layer, request, page), passed whole with a traced
layer index: quest keeps ``(kmax, kmin)`` [L, B, Np, H, D]; the indexer keeps the per-page
sum of index keys [L, B, Np, dI] (f32); dense keeps nothing.

Lagged selection (``CacheConfig.selection_lag=1``): the tuple ends with one more array,
``ahead`` [L, B, H, k] int32, the pages each layer attends to at the next step, chosen with
this step's queries (see :func:`update_and_select`'s ``ahead``; the prefill fills it with
:func:`select_after_prefill`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.models import llama
from jaxkv.kernels import dense_select, indexer, quest


def init_summaries(selector: str, num_layers: int, batch: int, num_pages: int,
                   num_kv_heads: int, head_dim: int, dtype, index_dim: int = 0,
                   ahead_pages: int = 0):
    """Empty summaries for ``selector`` (a tuple of arrays; () for dense). ``ahead_pages``
    k > 0 (lagged selection) appends ``ahead`` [L, B, H, k] int32, all -1 (no page)."""
    shape = (num_layers, batch, num_pages)
    ahead = ((jnp.full((num_layers, batch, num_kv_heads, ahead_pages), -1, jnp.int32),)
             if ahead_pages else ())
    if selector == "quest":
        return (jnp.full(shape + (num_kv_heads, head_dim), -jnp.inf, dtype),
                jnp.full(shape + (num_kv_heads, head_dim), jnp.inf, dtype)) + ahead
    if selector == "indexer":
        return (jnp.zeros(shape + (index_dim,), jnp.float32),) + ahead
    return ()


def split_ahead(summaries, lagged: bool):
    """(the selector's own summaries, ``ahead`` or None): the lagged selection's pages are the
    tuple's last array when ``lagged``."""
    return (tuple(summaries[:-1]), summaries[-1]) if lagged else (tuple(summaries), None)


def summarize_prefill(selector: str, summaries, layer, lp, cfg, h, k, positions, lengths, page_size):
    """Fill layer ``layer``'s summaries from a prompt: k [B, T, H, D], h [B, T, d], lengths [B]."""
    if selector == "quest":
        kmax, kmin = quest.quest_summarize(k, page_size, lengths)
        n = kmax.shape[1]
        return (summaries[0].at[layer, :, :n].set(kmax.astype(summaries[0].dtype)),
                summaries[1].at[layer, :, :n].set(kmin.astype(summaries[1].dtype)))
    if selector == "indexer":
        _, _, k_idx = llama.indexer_inputs(lp, cfg, h, positions)
        keys = indexer.indexer_summarize(k_idx, page_size, lengths)
        n = keys.shape[1]
        return (summaries[0].at[layer, :, :n].set(keys.astype(jnp.float32)),)
    return summaries


def update_and_select(selector: str, summaries, layer, lp, cfg, h, q, k_new, positions, *,
                      num_pages, k, page_size, num_sink_pages, implementation=None,
                      ahead: bool = False):
    """Decode step for one layer: fold the new token into the summaries, then select pages.

    h [B, 1, d] normed hidden state, q [B, Hq, D], k_new [B, H, D] or the new token's stacked
    K/V [B, 2, H, D] (Quest reads its K in place), positions [B] (position
    of the new token, -1 = inactive request). Returns (summaries, pages [B, H, k'] int32),
    within-sequence page indices, -1 padded (k' = num_pages for dense). ``ahead``: select
    for the next token (position + 1) with this query: the next token's page is the forced
    last page, the rest scored as now (lagged selection).
    """
    seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
    H = k_new.shape[-2]
    if selector == "quest":
        kmax, kmin, pages = quest.quest_update_select(
            q, summaries[0], summaries[1], layer, seq_lens, k_new, positions, k=k,
            page_size=page_size, num_sink_pages=num_sink_pages, implementation=implementation)
        return (kmax, kmin), pages
    if selector == "indexer":
        pos2 = jnp.maximum(positions, 0)[:, None]
        q_idx, w, k_idx = llama.indexer_inputs(lp, cfg, h, pos2)
        keys = indexer.indexer_update(summaries[0], layer, k_idx[:, 0], positions,
                                      page_size=page_size)
        return (keys,), _indexer_pages(q_idx, w, keys, layer, seq_lens, H, k=k,
                                       page_size=page_size, num_sink_pages=num_sink_pages,
                                       implementation=implementation)
    return summaries, dense_select.dense_select(seq_lens, num_pages=num_pages, num_kv_heads=H,
                                                page_size=page_size)


def _indexer_pages(q_idx, w, keys, layer, seq_lens, num_kv_heads: int, **select_kw):
    """The indexer's pages [B, H, k] (one selection shared by the H KV heads) from its query
    q_idx [B, 1, H_I, dI] and weights w [B, 1, H_I]."""
    pages = indexer.indexer_select(q_idx[:, 0], w[:, 0], keys, layer, seq_lens, **select_kw)
    return jnp.broadcast_to(pages[:, None, :], (pages.shape[0], num_kv_heads, pages.shape[1]))


def select_after_prefill(selector: str, summaries, layer, lp, cfg, h_last, q_last, lengths, *,
                         k, page_size, num_sink_pages, implementation=None):
    """Lagged selection's first pages: what the prompt's last query selects for the first
    decode token (position ``lengths``), from the prefill's summaries (without ``ahead``).

    h_last [B, 1, d] the last prompt token's normed hidden state, q_last [B, Hq, D] its
    query, lengths [B] prompt lengths. Returns pages [B, H, k] int32 (-1 padded)."""
    seq_lens = jnp.asarray(lengths, jnp.int32) + 1
    H = cfg.num_kv_heads
    if selector == "quest":
        return quest.quest_select(q_last, summaries[0], summaries[1], layer, seq_lens, k=k,
                                  page_size=page_size, num_sink_pages=num_sink_pages,
                                  implementation=implementation)
    if selector == "indexer":
        pos = jnp.maximum(jnp.asarray(lengths, jnp.int32) - 1, 0)[:, None]
        q_idx, w, _ = llama.indexer_inputs(lp, cfg, h_last, pos)
        return _indexer_pages(q_idx, w, summaries[0], layer, seq_lens, H, k=k,
                              page_size=page_size, num_sink_pages=num_sink_pages,
                              implementation=implementation)
    raise ValueError(f"lagged selection needs the quest or indexer selector, got {selector!r}")


def quest_update_select_all_layers(summaries, q, kv_new, positions, *, k, page_size,
                                   num_sink_pages, implementation=None):
    """Lagged Quest for every layer at once, after the step's layers: fold each layer's new
    key into its summaries and choose the next step's pages, in one launch per kernel
    instead of one per layer (the layers' selections are independent of one another).

    summaries (kmax, kmin) [L, B, Np, H, D]; q [L, B, Hq, D] each layer's query; kv_new
    [L, B, 2, H, D] each layer's new K/V row (K read); positions [L, B] int32 the new token's
    position (-1 = no update and no selection wanted: inactive request or a dense layer).
    Returns ((kmax, kmin), ahead [L, B, H, k] int32): the pages for position + 1."""
    kmax, kmin = summaries
    L, B = kmax.shape[:2]
    flat = lambda a: a.reshape((1, L * B) + a.shape[2:])  # noqa: E731 - layers as requests
    seq_lens = jnp.maximum(positions + 2, 1).reshape(L * B)
    kmax2, kmin2, pages = quest.quest_update_select(
        q.reshape((L * B,) + q.shape[2:]), flat(kmax), flat(kmin), jnp.int32(0), seq_lens,
        kv_new.reshape((L * B,) + kv_new.shape[2:]), positions.reshape(L * B), k=k,
        page_size=page_size, num_sink_pages=num_sink_pages, implementation=implementation)
    return (kmax2.reshape(kmax.shape), kmin2.reshape(kmin.shape)), pages.reshape(
        (L, B) + pages.shape[1:])
