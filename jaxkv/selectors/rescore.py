"""Two-stage selection: Quest's upper bound picks ``candidates`` x k pages per KV head, then
the candidates are scored by the attention mass the query puts on their tokens, from a
device copy of every key, and the best k are kept.

The first stage is cheap and has a high recall at a wider budget; the second is exact up to
the key copy's precision and reads only the candidates' keys. The key copy lives with the
summaries on the device (int8 with a scale per token and KV head, or the KV dtype), so the
selector works with the host tier as well as resident.

Summaries: Quest's ``(kmax, kmin)`` [L, B, Np, H, D], then ``keys`` [L, B, Np, ps, H, D]
(int8 or the KV dtype) and ``scales`` [L, B, Np, ps, H] float32 (ones for the KV dtype).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kernels import dense_select
from jaxkv.kernels import quest as quest_kernels
from jaxkv.selectors.base import register
from jaxkv.selectors.quest import Quest, _select_kw


def quantize(k, bits: int):
    """k [..., D] -> (values, scale [...]): int8 with a symmetric scale per vector when
    ``bits == 8``, else k itself and ones."""
    if bits != 8:
        return k, jnp.ones(k.shape[:-1], jnp.float32)
    kf = k.astype(jnp.float32)
    scale = jnp.max(jnp.abs(kf), axis=-1) / 127.0
    q = jnp.round(kf / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def candidate_mass(q, keys, scales, cand, positions, page_size):
    """Attention mass on candidate pages. q [B, Hq, D]; keys [B, Np, ps, H, D] (one layer);
    scales [B, Np, ps, H]; cand [B, H, C] pages (-1: none); positions [B]: tokens at indices
    <= positions[b] are valid. Returns [B, H, C] float32: per KV head, the softmax mass over
    the candidates' valid tokens, summed over the group's query heads (-inf for -1)."""
    B, Np, ps, H, D = keys.shape
    G = q.shape[1] // H
    idx = jnp.clip(cand, 0, Np - 1)                                      # [B, H, C]
    kt = jnp.moveaxis(keys, 3, 1)                                        # [B, H, Np, ps, D]
    st = jnp.moveaxis(scales, 3, 1)                                      # [B, H, Np, ps]
    k = jnp.take_along_axis(kt, idx[..., None, None], axis=2)            # [B, H, C, ps, D]
    sc = jnp.take_along_axis(st, idx[..., None], axis=2)                 # [B, H, C, ps]
    kf = k.astype(jnp.float32) * sc[..., None]
    qg = q.reshape(B, H, G, D).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhctd->bhgct", qg, kf) * D ** -0.5
    tok = idx[..., None] * ps + jnp.arange(ps, dtype=jnp.int32)          # [B, H, C, ps]
    valid = (cand[..., None] >= 0) & (tok <= positions[:, None, None, None])
    s = jnp.where(valid[:, :, None], s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=(-2, -1), keepdims=True)
    mass = jnp.sum(jnp.sum(p, axis=-1) / jnp.where(den[..., 0] > 0, den[..., 0], 1.0), axis=2)
    return jnp.where(cand >= 0, mass, -jnp.inf)


@register
class Rescore(Quest):
    name = "quest_rescore"
    selects_all_layers = False
    #: First-stage pages per KV head, as a multiple of the budget k.
    candidates = 4
    #: Precision of the key copy: 8 (int8, a scale per token and KV head) or 16 (KV dtype).
    key_bits = 8

    def init(self, plan) -> tuple:
        m = plan.model
        shape = (m.num_layers, plan.batch, plan.pages_per_seq, plan.page_size, m.num_kv_heads)
        dt = jnp.int8 if self.key_bits == 8 else jnp.dtype(plan.summary_dtype)
        return super().init(plan) + (jnp.zeros(shape + (m.head_dim,), dt),
                                     jnp.zeros(shape, jnp.float32))

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        qsumm = super().fill(plan, summaries[:2], layer, layer_params, h, k, positions, lengths)
        B, T, H, D = k.shape
        ps = plan.page_size
        vals, scale = quantize(k.reshape(B, T // ps, ps, H, D), self.key_bits)
        keys = summaries[2].at[layer, :, :T // ps].set(vals.astype(summaries[2].dtype))
        scales = summaries[3].at[layer, :, :T // ps].set(scale)
        return qsumm + (keys, scales)

    def _candidates_k(self, plan) -> int:
        return min(self.candidates * plan.k, plan.pages_per_seq)

    def _rescore(self, plan, summaries, layer, q, cand, positions, seq_lens):
        keys = jax.lax.dynamic_index_in_dim(summaries[2], layer, 0, keepdims=False)
        scales = jax.lax.dynamic_index_in_dim(summaries[3], layer, 0, keepdims=False)
        mass = candidate_mass(q, keys, scales, cand, positions, plan.page_size)
        B, H, _ = cand.shape
        Np = plan.pages_per_seq
        full = jnp.full((B, H, Np), -jnp.inf, jnp.float32)
        b = jnp.arange(B)[:, None, None]
        h = jnp.arange(H)[None, :, None]
        full = full.at[b, h, jnp.where(cand >= 0, cand, Np)].set(mass, mode="drop")
        return dense_select.select_top_pages(
            full, seq_lens, num_pages=Np, k=plan.k, page_size=plan.page_size,
            num_sink_pages=plan.cache.sink_pages, method=plan.tuning.topk_method,
            implementation=plan.cache.implementation)

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        kw = dict(_select_kw(plan), k=self._candidates_k(plan))
        kmax, kmin, cand = quest_kernels.quest_update_select(
            q, summaries[0], summaries[1], layer, seq_lens, kv_new, positions, **kw)
        ps, Np = plan.page_size, plan.pages_per_seq
        k_new = kv_new if kv_new.ndim == 3 else kv_new[:, 0]
        vals, scale = quantize(k_new, self.key_bits)
        b = jnp.arange(k_new.shape[0])
        page = jnp.where(positions >= 0, positions // ps, Np)  # Np: out of range, dropped
        keys = summaries[2].at[layer, b, page, positions % ps].set(
            vals.astype(summaries[2].dtype), mode="drop")
        scales = summaries[3].at[layer, b, page, positions % ps].set(scale, mode="drop")
        summ = (kmax, kmin, keys, scales)
        return summ, self._rescore(plan, summ, layer, q, cand, positions, seq_lens)

    def first_pages(self, plan, summaries, layer, layer_params, h_last, q_last, lengths):
        lengths = jnp.asarray(lengths, jnp.int32)
        kw = dict(_select_kw(plan), k=self._candidates_k(plan))
        cand = quest_kernels.quest_select(q_last, summaries[0], summaries[1], layer, lengths + 1,
                                          **kw)
        return self._rescore(plan, summaries, layer, q_last, cand, lengths - 1, lengths + 1)

    def update_select_all_layers(self, plan, summaries, q, kv_new, positions):
        raise NotImplementedError("selects per layer")



@register
class RescoreExactKeys(Rescore):
    """The second stage on keys in the KV dtype: how much the int8 copy costs."""
    name = "quest_rescore_exact"
    key_bits = 16


@register
class RescoreWide(Rescore):
    """The first stage keeps 8x the budget: how much of the loss is the first stage's recall."""
    name = "quest_rescore8"
    candidates = 8
