"""Dense selection: every valid page (the baseline); no summaries."""
from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kernels import dense_select
from jaxkv.selectors.base import Selector, register


@register
class Dense(Selector):
    name = "dense"
    scored = False

    def init(self, plan) -> tuple:
        return ()

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        return summaries

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        return summaries, dense_select.dense_select(
            seq_lens, num_pages=plan.pages_per_seq, num_kv_heads=kv_new.shape[-2],
            page_size=plan.page_size)
