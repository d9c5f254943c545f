"""DSA-style lightning indexer at page level: per page the sum of the tokens' index keys;
a page's score is the indexer's weighted ReLU score of the query against it
(``jaxkv.kernels.indexer``). Summaries ``(keys,)`` [L, B, Np, dI] float32. One selection is
shared by the KV heads of a request. Needs a model with indexer weights
(``jaxkv.models.configs.with_indexer``)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kernels import indexer as kernels
from jaxkv.models import llama
from jaxkv.selectors.base import Selector, fold_pages, register


@register
class Indexer(Selector):
    name = "indexer"

    def init(self, plan) -> tuple:
        shape = (plan.model.num_layers, plan.batch, plan.pages_per_seq, plan.model.indexer_dim)
        return (jnp.zeros(shape, jnp.float32),)

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        _, _, k_idx = llama.indexer_inputs(layer_params, plan.model, h, positions)
        keys = kernels.indexer_summarize(k_idx, plan.page_size, lengths)
        n = keys.shape[1]
        return (summaries[0].at[layer, :, :n].set(keys.astype(jnp.float32)),)

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        pos2 = jnp.maximum(positions, 0)[:, None]
        q_idx, w, k_idx = llama.indexer_inputs(layer_params, plan.model, h, pos2)
        keys = kernels.indexer_update(summaries[0], layer, k_idx[:, 0], positions,
                                      page_size=plan.page_size)
        return (keys,), self._pages(plan, q_idx, w, keys, layer, seq_lens)

    def fold(self, plan, summaries, layer, layer_params, h, q, kv_new, positions):
        _, _, k_idx = llama.indexer_inputs(layer_params, plan.model, h,
                                           jnp.maximum(positions, 0))
        return (fold_pages(summaries[0], layer, k_idx, positions, plan.page_size, "add"),)

    def first_pages(self, plan, summaries, layer, layer_params, h_last, q_last, lengths):
        seq_lens = jnp.asarray(lengths, jnp.int32) + 1
        pos = jnp.maximum(jnp.asarray(lengths, jnp.int32) - 1, 0)[:, None]
        q_idx, w, _ = llama.indexer_inputs(layer_params, plan.model, h_last, pos)
        return self._pages(plan, q_idx, w, summaries[0], layer, seq_lens)

    @staticmethod
    def _pages(plan, q_idx, w, keys, layer, seq_lens):
        """[B, H, k]: one selection from q_idx [B, 1, H_I, dI] and w [B, 1, H_I], shared by
        the KV heads."""
        pages = kernels.indexer_select(
            q_idx[:, 0], w[:, 0], keys, layer, seq_lens, k=plan.k, page_size=plan.page_size,
            num_sink_pages=plan.cache.sink_pages, implementation=plan.cache.implementation,
            topk_method=plan.cache.tuning.topk_method)
        H = plan.model.num_kv_heads
        return jnp.broadcast_to(pages[:, None, :], (pages.shape[0], H, pages.shape[1]))
