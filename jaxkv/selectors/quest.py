"""Quest: per page and KV head the elementwise max / min of the post-RoPE keys; a page's
score is an upper bound of the query's dot product with its keys
(``jaxkv.kernels.quest``). Summaries ``(kmax, kmin)`` [L, B, Np, H, D] in
``plan.summary_dtype`` (the KV dtype; the model's when the KV is quantized)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kernels import quest as kernels
from jaxkv.selectors.base import Selector, fold_pages, register


def _select_kw(plan) -> dict:
    t = plan.cache.tuning
    return dict(k=plan.k, page_size=plan.page_size, num_sink_pages=plan.cache.sink_pages,
                implementation=plan.cache.implementation, topk_method=t.topk_method,
                cmax_min_pages=t.topk_cmax_min_pages)


@register
class Quest(Selector):
    name = "quest"
    selects_all_layers = True

    def bound_blocks(self, plan) -> tuple[int, int]:
        """(blocks per sequence, tokens per block) of the ``(kmax, kmin)`` summaries: one
        block per page."""
        return plan.pages_per_seq, plan.page_size

    def init(self, plan) -> tuple:
        m = plan.model
        shape = (m.num_layers, plan.batch, self.bound_blocks(plan)[0], m.num_kv_heads,
                 m.head_dim)
        dt = jnp.dtype(plan.summary_dtype)
        return jnp.full(shape, -jnp.inf, dt), jnp.full(shape, jnp.inf, dt)

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        bs = self.bound_blocks(plan)[1]
        if k.shape[1] % bs:  # a prompt of whole pages, not of whole blocks
            k = jnp.pad(k, ((0, 0), (0, -k.shape[1] % bs), (0, 0), (0, 0)))
        kmax, kmin = kernels.quest_summarize(k, bs, lengths)
        n = kmax.shape[1]
        return (summaries[0].at[layer, :, :n].set(kmax.astype(summaries[0].dtype)),
                summaries[1].at[layer, :, :n].set(kmin.astype(summaries[1].dtype)))

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        kmax, kmin, pages = kernels.quest_update_select(
            q, summaries[0], summaries[1], layer, seq_lens, kv_new, positions,
            **_select_kw(plan))
        return (kmax, kmin), pages

    def fold(self, plan, summaries, layer, layer_params, h, q, kv_new, positions):
        k = kv_new[:, :, 0]                                                 # [B, T, H, D]
        ps = self.bound_blocks(plan)[1]
        return (fold_pages(summaries[0], layer, k, positions, ps, "max"),
                fold_pages(summaries[1], layer, k, positions, ps, "min"))

    def first_pages(self, plan, summaries, layer, layer_params, h_last, q_last, lengths):
        seq_lens = jnp.asarray(lengths, jnp.int32) + 1
        return kernels.quest_select(q_last, summaries[0], summaries[1], layer, seq_lens,
                                    **_select_kw(plan))

    def update_select_all_layers(self, plan, summaries, q, kv_new, positions):
        kmax, kmin = summaries
        L, B = kmax.shape[:2]
        flat = lambda a: a.reshape((1, L * B) + a.shape[2:])  # noqa: E731 - layers as requests
        seq_lens = jnp.maximum(positions + 2, 1).reshape(L * B)
        kmax2, kmin2, pages = kernels.quest_update_select(
            q.reshape((L * B,) + q.shape[2:]), flat(kmax), flat(kmin), jnp.int32(0), seq_lens,
            kv_new.reshape((L * B,) + kv_new.shape[2:]), positions.reshape(L * B),
            **_select_kw(plan))
        return (kmax2.reshape(kmax.shape), kmin2.reshape(kmin.shape)), pages.reshape(
            (L, B) + pages.shape[1:])
