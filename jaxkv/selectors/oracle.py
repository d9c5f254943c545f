"""Oracle selection, for measurement: the pages that hold the most of the query's exact
attention mass, computed from a full copy of the post-RoPE keys.

It tells how much of dense decoding any page selector can keep at a budget: per request and
KV head, each page's score is the softmax attention mass its tokens receive from the query,
summed over the query heads of the group (the heads share one page set), over every valid
token of the sequence. Pages are then chosen by the shared selection rule (sinks and the
current page forced, ``jaxkv.kernels.dense_select.select_top_pages``).

Summaries ``(keys,)`` [L, B, Np, ps, H, D] in ``plan.summary_dtype``: a second copy of every key, so
the oracle runs resident only (``CacheConfig(mode="resident")``) and costs a full pass over
the context's keys per layer and step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kernels import dense_select
from jaxkv.selectors.base import Selector, register


def attention_mass(q, keys, positions, page_size):
    """Per-page attention mass. q [B, Hq, D]; keys [B, Np, ps, H, D]; positions [B] int32:
    tokens at indices <= positions[b] are valid (-1: none). Returns [B, H, Np] float32: for
    KV head h, sum over its G query heads of the softmax mass on each page's valid tokens."""
    B, Np, ps, H, D = keys.shape
    G = q.shape[1] // H
    qg = q.reshape(B, H, G, D).astype(jnp.float32)
    s = jnp.einsum("bhgd,bpthd->bhgpt", qg, keys.astype(jnp.float32)) * D ** -0.5
    tok = jnp.arange(Np * ps, dtype=jnp.int32).reshape(Np, ps)
    valid = tok[None] <= positions[:, None, None]                       # [B, Np, ps]
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=(-2, -1), keepdims=True)
    mass = jnp.sum(p, axis=-1) / jnp.where(den[..., 0] > 0, den[..., 0], 1.0)  # [B, H, G, Np]
    return jnp.sum(mass, axis=2)


@register
class Oracle(Selector):
    name = "oracle"
    host_tier = False

    def init(self, plan) -> tuple:
        m = plan.model
        shape = (m.num_layers, plan.batch, plan.pages_per_seq, plan.page_size, m.num_kv_heads,
                 m.head_dim)
        return (jnp.zeros(shape, jnp.dtype(plan.summary_dtype)),)

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        B, T, H, D = k.shape
        ps = plan.page_size
        keys = k.reshape(B, T // ps, ps, H, D).astype(summaries[0].dtype)
        return (summaries[0].at[layer, :, :T // ps].set(keys),)

    def _select(self, plan, keys, q, positions, seq_lens):
        t = plan.cache.tuning
        scores = attention_mass(q, keys, positions, plan.page_size)
        return dense_select.select_top_pages(
            scores, seq_lens, num_pages=plan.pages_per_seq, k=plan.k, page_size=plan.page_size,
            num_sink_pages=plan.cache.sink_pages, method=t.topk_method,
            implementation=plan.cache.implementation)

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        k_new = kv_new if kv_new.ndim == 3 else kv_new[:, 0]
        keys = self._store(plan, summaries[0], layer, k_new, positions)
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        layer_keys = jax.lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)
        return (keys,), self._select(plan, layer_keys, q, positions, seq_lens)

    def fold(self, plan, summaries, layer, layer_params, h, q, kv_new, positions):
        return (self._store(plan, summaries[0], layer, kv_new[:, :, 0], positions),)

    @staticmethod
    def _store(plan, keys, layer, k, positions):
        """The key copy with k [B, ..., H, D] stored at positions [B, ...] (-1: dropped)."""
        ps, Np = plan.page_size, plan.pages_per_seq
        b = jnp.arange(positions.shape[0])[(slice(None),) + (None,) * (positions.ndim - 1)]
        page = jnp.where(positions >= 0, positions // ps, Np)  # Np: out of range, dropped
        return keys.at[layer, b, page, positions % ps].set(k.astype(keys.dtype), mode="drop")

    def first_pages(self, plan, summaries, layer, layer_params, h_last, q_last, lengths):
        lengths = jnp.asarray(lengths, jnp.int32)
        layer_keys = jax.lax.dynamic_index_in_dim(summaries[0], layer, 0, keepdims=False)
        return self._select(plan, layer_keys, q_last, lengths - 1, lengths + 1)
