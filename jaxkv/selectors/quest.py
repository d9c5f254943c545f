"""Quest: per page and KV head the elementwise max / min of the post-RoPE keys; a page's
score is an upper bound of the query's dot product with its keys
(``jaxkv.kernels.quest``). Summaries ``(kmax, kmin)`` [L, B, Np, H, D] in
``plan.summary_dtype`` (the KV dtype; the model's when the KV is quantized), or with int8
bounds (``CacheConfig.bounds_int8``, the two-stage selectors' default) int8 followed by their
scale [L, B, Np, H] float32 (one per page and KV head, rounded outward) and the keys' shift
[L, B, H, D] float32 (the mean of the request's prompt keys per layer and KV head, fixed at
the prefill; the bounds are those of the keys less it: ``jaxkv.kernels.quest`` module
docstring)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kernels import quest as kernels
from jaxkv.selectors.base import Selector, fold_pages, key_mean, register


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

    @staticmethod
    def n_bounds(plan) -> int:
        """How many arrays the bounds take: (kmax, kmin), or with int8 bounds (kmax, kmin,
        scale, shift)."""
        return 4 if plan.cache.bounds_int8 else 2

    @staticmethod
    def _scale_kw(plan, summaries, update: bool = False) -> dict:
        """The quantized bounds' keyword arguments of the Quest ops (the shift only where
        a key is folded in: the scores do not depend on it)."""
        if Quest.n_bounds(plan) == 2:
            return {}
        return dict(scale=summaries[2], shift=summaries[3]) if update else dict(
            scale=summaries[2])

    def _update_bounds(self, plan, summaries, layer, k_new, positions):
        """``quest_update`` on the selector's bounds: the updated bounds, as many arrays as
        :meth:`n_bounds` (the shift passed through)."""
        out = kernels.quest_update(summaries[0], summaries[1], layer, k_new, positions,
                                   page_size=self.bound_blocks(plan)[1],
                                   **self._scale_kw(plan, summaries, True))
        return tuple(out) + tuple(summaries[len(out):self.n_bounds(plan)])

    def _update_select_bounds(self, plan, summaries, layer, q, seq_lens, kv_new, positions,
                              **kw):
        """``quest_update_select`` on the selector's bounds: (the updated bounds, as many
        arrays as :meth:`n_bounds`, the shift passed through), pages."""
        out = kernels.quest_update_select(q, summaries[0], summaries[1], layer, seq_lens,
                                          kv_new, positions,
                                          **self._scale_kw(plan, summaries, True), **kw)
        if self.n_bounds(plan) == 2:
            return tuple(out[:2]), out[2]
        return tuple(out[:3]) + (summaries[3],), out[3]

    def init(self, plan) -> tuple:
        m = plan.model
        shape = (m.num_layers, plan.batch, self.bound_blocks(plan)[0], m.num_kv_heads,
                 m.head_dim)
        if self.n_bounds(plan) == 4:  # never-written pages: scale 0 (past the sequence)
            return (jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8),
                    jnp.zeros(shape[:4], jnp.float32),
                    jnp.zeros(shape[:2] + shape[3:], jnp.float32))
        dt = jnp.dtype(plan.summary_dtype)
        return jnp.full(shape, -jnp.inf, dt), jnp.full(shape, jnp.inf, dt)

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        bs = self.bound_blocks(plan)[1]
        if k.shape[1] % bs:  # a prompt of whole pages, not of whole blocks
            k = jnp.pad(k, ((0, 0), (0, -k.shape[1] % bs), (0, 0), (0, 0)))
        if self.n_bounds(plan) == 4:  # the bounds of the keys less their prompt mean
            mu = key_mean(k, jnp.asarray(lengths))                            # [B, H, D]
            kmax, kmin, scale = kernels.quantize_bounds(*kernels.quest_summarize(
                k.astype(jnp.float32) - mu[:, None], bs, lengths))
            n = kmax.shape[1]
            return tuple(a.at[layer, :, :n].set(v)
                         for a, v in zip(summaries[:3], (kmax, kmin, scale))) + (
                summaries[3].at[layer].set(mu),)
        kmax, kmin = kernels.quest_summarize(k, bs, lengths)
        n = kmax.shape[1]
        return (summaries[0].at[layer, :, :n].set(kmax.astype(summaries[0].dtype)),
                summaries[1].at[layer, :, :n].set(kmin.astype(summaries[1].dtype)))

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        return self._update_select_bounds(plan, summaries, layer, q, seq_lens, kv_new,
                                          positions, **_select_kw(plan))

    def fold(self, plan, summaries, layer, layer_params, h, q, kv_new, positions):
        k = kv_new[:, :, 0]                                                 # [B, T, H, D]
        ps = self.bound_blocks(plan)[1]
        if self.n_bounds(plan) == 4:
            return self._fold_int8(plan, summaries, layer, k, positions)
        return (fold_pages(summaries[0], layer, k, positions, ps, "max"),
                fold_pages(summaries[1], layer, k, positions, ps, "min"))

    def _fold_int8(self, plan, summaries, layer, k, positions):
        """int8 bounds with all of a turn's tokens [B, T, H, D] folded at once, bit for bit
        what folding them one by one (:func:`kernels.requantize_row`) gives: a page's scale
        is the power of two of its largest |bound| (the prefill's quantization leaves it so,
        and a token grows the scale only past the page's range, and then to its own), and
        with power-of-two scales rounding outward to a finer grid, then to a coarser one, is
        rounding to the coarser one. So the layer's bounds are dequantized, folded as float
        bounds are, and quantized again; only the pages a token lands on are written."""
        ps = self.bound_blocks(plan)[1]
        kmax, kmin, scale, shift = summaries[:4]
        ks = k.astype(jnp.float32) - shift[layer][:, None]                  # [B, T, H, D]
        mx, mn = kernels.dequantize_bounds(kmax[layer], kmin[layer], scale[layer])
        mx = fold_pages(mx[None], 0, ks, positions, ps, "max")[0]          # [B, Np, H, D]
        mn = fold_pages(mn[None], 0, ks, positions, ps, "min")[0]
        qmx, qmn, qs = kernels.quantize_bounds(mx, mn)
        hit = fold_pages(jnp.zeros((1,) + mx.shape[:2]), 0, jnp.ones(positions.shape),
                         positions, ps, "max")[0] > 0                       # [B, Np] touched
        pick = lambda new, old: jnp.where(  # noqa: E731
            hit.reshape(hit.shape + (1,) * (new.ndim - 2)), new.astype(old.dtype), old)
        return (kmax.at[layer].set(pick(qmx, kmax[layer])),
                kmin.at[layer].set(pick(qmn, kmin[layer])),
                scale.at[layer].set(pick(qs, scale[layer])), shift)

    def first_pages(self, plan, summaries, layer, layer_params, h_last, q_last, lengths):
        seq_lens = jnp.asarray(lengths, jnp.int32) + 1
        return kernels.quest_select(q_last, summaries[0], summaries[1], layer, seq_lens,
                                    **self._scale_kw(plan, summaries), **_select_kw(plan))

    def update_select_all_layers(self, plan, summaries, q, kv_new, positions):
        L, B = summaries[0].shape[:2]
        flat = lambda a: a.reshape((1, L * B) + a.shape[2:])  # noqa: E731 - layers as requests
        seq_lens = jnp.maximum(positions + 2, 1).reshape(L * B)
        bounds, pages = self._update_select_bounds(
            plan, tuple(flat(a) for a in summaries), jnp.int32(0),
            q.reshape((L * B,) + q.shape[2:]), seq_lens,
            kv_new.reshape((L * B,) + kv_new.shape[2:]), positions.reshape(L * B),
            **_select_kw(plan))
        return (tuple(a.reshape(s.shape) for a, s in zip(bounds, summaries)),
                pages.reshape((L, B) + pages.shape[1:]))
