"""Two-stage selection: Quest's upper bound picks ``candidates`` x k pages per KV head, then
the candidates are scored by the attention mass the query puts on their tokens, from a
device copy of every key, and the best k are kept.

The first stage is cheap and has a high recall at a wider budget (its candidates come in
any order); the second is exact up to
the key copy's precision and reads only the candidates' keys. The key copy lives with the
summaries on the device (int8 with a scale per token and KV head, or the KV dtype), so the
selector works with the host tier as well as resident. Its device bytes per token are
``num_kv_heads * (head_dim + 4)`` per layer with int8 keys: a quarter of the logical K+V at
bf16 plus the scales.

With blocks of r > 1 pages (``CacheConfig.candidate_block``; 1, per page, by default) the
first stage bounds blocks of r pages instead of pages (Quest's summaries and scores over
blocks of ``r * page_size`` tokens) and picks ``candidate_pages / r`` blocks, whose pages are
the candidates: r times fewer bounds to read and a top-k over r times fewer entries, but a
looser bound, so fewer of the pages the attention needs among the candidates.

Summaries: Quest's ``(kmax, kmin)`` [L, B, Np / r, H, D], then ``keys`` [L, B, H, Np, ps, D]
(int8 or the KV dtype) and ``scales`` [L, B, H, Np, ps] float32 (ones for the KV dtype):
head-major, so one KV head's candidate pages are contiguous rows of the copy. The second
stage is ``jaxkv.kernels.candidate_mass`` (``Tuning.rescore_method``); the final choice is a
top-k over the candidates only, never over the whole row: after the Pallas second stage one
kernel from its page statistics (``jaxkv.kernels.candidate_select``,
``Tuning.rescore_select_method``), else XLA's top-k (``top_candidates``).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jaxkv.kernels import _common
from jaxkv.kernels import candidate_mass as mass_kernels
from jaxkv.kernels import candidate_select as select_kernels
from jaxkv.kernels import dense_select
from jaxkv.kernels import quest as quest_kernels
from jaxkv.kernels import topk as topk_kernels
from jaxkv.kernels.candidate_select import top_candidates
from jaxkv.selectors.base import register
from jaxkv.selectors.quest import Quest, _select_kw
from jaxkv.spec import alloc_rows


def quantize(k, bits: int):
    """k [..., D] -> (values, scale [...]): int8 with a symmetric scale per vector when
    ``bits == 8``, else k itself and ones."""
    if bits != 8:
        return k, jnp.ones(k.shape[:-1], jnp.float32)
    kf = k.astype(jnp.float32)
    scale = jnp.max(jnp.abs(kf), axis=-1) / 127.0
    q = jnp.round(kf / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def scatter_keys(keys, scales, layer, k, positions):
    """The key copy ``keys`` [L, B, H, Np, ps, D] (int8, or the KV dtype) and its ``scales``
    [L, B, H, Np, ps] with ``k`` [B, ..., H, D] quantized (:func:`quantize`) and stored at
    ``positions`` [B, ...] (a decode step's [B], a continued turn's [B, T]) of layer
    ``layer``, in place (two scatters); a negative position, or one past the pages, writes
    nothing."""
    Np, ps = keys.shape[3:5]
    vals, scale = quantize(k, 8 if keys.dtype == jnp.int8 else 16)
    lead, H = positions.ndim, k.shape[-2]
    b = jnp.arange(positions.shape[0])[(slice(None),) + (None,) * lead]
    hh = jnp.arange(H)[(None,) * lead]
    page = jnp.where(positions >= 0, positions // ps, Np)[..., None]  # Np: dropped
    slot = (positions % ps)[..., None]
    keys = keys.at[layer, b, hh, page, slot].set(vals.astype(keys.dtype), mode="drop")
    return keys, scales.at[layer, b, hh, page, slot].set(scale.astype(scales.dtype),
                                                        mode="drop")


# The widest rows the first stage's full-row kernel was measured on past
# ``dense_select.PALLAS_TOPK_MAX_COLUMNS`` (``Tuning.first_stage_kernel_min_rows``): the
# kernel pads a row to a power of two, and 128k tokens in 16-token pages plus the decode
# room (8212 pages) pad to this.
FIRST_STAGE_KERNEL_MAX_PAGES = 16384


def first_stage_takes_kernel(tuning, implementation, pages: int, picks: int, rows: int) -> bool:
    """Whether the first stage's "auto" top-k runs the full-row Pallas kernel for ``rows``
    rows (requests x KV heads) of ``pages`` pages and ``picks`` candidates: where
    ``select_top_pages``' "auto" takes it (up to 4096 pages), and past that, up to
    ``FIRST_STAGE_KERNEL_MAX_PAGES``, for at least ``Tuning.first_stage_kernel_min_rows``
    rows, which fill the GPU's programs (one per row): Qwen-like B=8, 16 rows of 8212 pages,
    512 picks, the step 1.643x Quest's against 1.825x with XLA's sort; on 8 rows (8B-like
    B=1) the two tie (docs/decisions.md)."""
    if dense_select.takes_topk_kernel(pages, picks, implementation):
        return True
    least = tuning.first_stage_kernel_min_rows
    return (least is not None and rows >= least and pages <= FIRST_STAGE_KERNEL_MAX_PAGES
            and _common.implementation_name(implementation) == "pallas"
            and topk_kernels.fits_full_row(pages, picks))


# Candidates per piece of ``CacheConfig(candidate_pieces=None)``: the first stage's top-k in
# as many strided pieces of a row as leave each piece this many of the candidates.
PIECE_SHARE = 64


def final_choice_method(tuning, implementation, candidates: int):
    """The final choice's implementation after the Pallas second stage:
    ``Tuning.rescore_select_method``, whose "auto" takes the kernel (the implementation's
    choice) for at most ``Tuning.rescore_select_kernel_max`` candidates, XLA above."""
    method = tuning.rescore_select_method
    if method != "auto":
        return method
    return implementation if candidates <= tuning.rescore_select_kernel_max else "xla"


@register
class Rescore(Quest):
    name = "quest_rescore"
    selects_all_layers = False
    two_stage = True
    #: First-stage pages per KV head, as a multiple of the budget k, unless
    #: ``CacheConfig.candidate_pages`` sets their number.
    candidates = 4
    #: The fewest tokens the first stage passes when ``CacheConfig.candidate_pages`` is None,
    #: in whole pages (0: the multiple alone).
    min_candidate_tokens = 0
    #: Precision of the key copy: 8 (int8, a scale per token and KV head) or 16 (KV dtype).
    key_bits = 8

    def init(self, plan) -> tuple:
        m = plan.model
        dt = jnp.int8 if self.key_bits == 8 else jnp.dtype(plan.summary_dtype)
        per_layer = (plan.batch, m.num_kv_heads, plan.pages_per_seq, plan.page_size)
        # An int8 copy of 2-4 GiB gets unused layers at its end (spec.alloc_rows: the Pallas
        # second stage's 32-bit offsets); the scales keep the same leading shape.
        layers = alloc_rows(m.num_layers, math.prod(per_layer) * m.head_dim,
                            jnp.dtype(dt).itemsize)
        shape = (layers,) + per_layer
        return super().init(plan) + (jnp.zeros(shape + (m.head_dim,), dt),
                                     jnp.zeros(shape, jnp.float32))

    def fill(self, plan, summaries, layer, layer_params, h, k, positions, lengths):
        nb = self.n_bounds(plan)
        qsumm = super().fill(plan, summaries[:nb], layer, layer_params, h, k, positions, lengths)
        B, T, H, D = k.shape
        ps = plan.page_size
        kt = jnp.moveaxis(k.reshape(B, T // ps, ps, H, D), 3, 1)        # [B, H, T/ps, ps, D]
        vals, scale = quantize(kt, self.key_bits)
        keys = summaries[nb].at[layer, :, :, :T // ps].set(vals.astype(summaries[nb].dtype))
        scales = summaries[nb + 1].at[layer, :, :, :T // ps].set(scale)
        return qsumm + (keys, scales)

    def bound_blocks(self, plan) -> tuple[int, int]:
        """Quest's bounds per block of ``CacheConfig.candidate_block`` pages: (blocks per
        sequence, tokens per block)."""
        r = plan.cache.candidate_block
        return -(-plan.pages_per_seq // r), plan.page_size * r

    def default_candidates(self, k: int, page_size: int) -> int:
        """First-stage pages of ``CacheConfig(candidate_pages=None)`` for a budget of ``k``
        pages: ``candidates * k``, and at least ``min_candidate_tokens`` in whole pages."""
        return max(self.candidates * k, -(-self.min_candidate_tokens // page_size))

    def candidate_count(self, plan) -> int:
        """First-stage pages per request, layer and KV head (at most the row's pages)."""
        n = plan.cache.candidate_pages or self.default_candidates(plan.k, plan.page_size)
        return min(n, plan.pages_per_seq)

    def _block_pages(self, plan, blocks, seq_lens):
        """The pages of the first stage's blocks [B, H, Cb] (-1 padded): [B, H, Cb * r], -1
        for padding and for pages past the sequence."""
        r = plan.cache.candidate_block
        if r == 1:
            return blocks
        pages = blocks[..., None] * r + jnp.arange(r, dtype=blocks.dtype)
        n_valid = dense_select.num_valid_pages(seq_lens, plan.page_size, plan.pages_per_seq)
        ok = (blocks[..., None] >= 0) & (pages < n_valid[:, None, None, None])
        return jnp.where(ok, pages, -1).reshape(blocks.shape[:-1] + (-1,))

    def covers_row(self, plan) -> bool:
        """Whether every page of the row is a candidate (short contexts: ``candidate_count``
        reaches ``pages_per_seq``). The first stage then has nothing to choose: its scores and
        top-k are skipped, the candidates are the valid pages in page order, and the XLA
        second stage reads the key copy without a gather. When the budget ``plan.k`` holds
        every page too, the second stage is skipped as well: every valid page is selected."""
        return self.candidate_count(plan) >= plan.pages_per_seq

    def _every_page(self, plan, seq_lens, heads: int):
        """Candidates [B, H, Np]: page ``p`` where it holds a token of the sequence, else -1
        (the dense selection)."""
        return dense_select.dense_select(seq_lens, num_pages=plan.pages_per_seq,
                                         num_kv_heads=heads, page_size=plan.page_size)

    def _first_stage_kw(self, plan) -> dict:
        """Quest's selection of the candidates, unordered (the second stage re-ranks them).
        "auto": the full-row Pallas top-k where :func:`first_stage_takes_kernel` says so
        (the Pallas implementation, rows of at most 4096 pages, or of 16384 when there are
        enough rows; for these k a single stage of 2-bit radix passes: the step 7.7% faster
        than with XLA's top-k at Qwen-like B=8, 2048 pages; docs/decisions.md), else XLA's
        top-k ("sort", no ascending sort). The chunk-maxima kernel is built for budgets and slows
        down at 4-8x the budget."""
        t = plan.cache.tuning.topk_method
        blocks, block_tokens = self.bound_blocks(plan)
        C, sink = self.first_stage_blocks(plan, plan.cache.candidate_block)
        S = self.first_stage_pieces(plan)
        if t == "auto":  # with pieces: rows of a piece's pages, a program per piece
            kernel = first_stage_takes_kernel(plan.cache.tuning, plan.cache.implementation,
                                              -(-blocks // S), C // S,
                                              plan.batch * plan.model.num_kv_heads * S)
            t = "pallas" if kernel else "sort"
        return dict(_select_kw(plan), k=C, page_size=block_tokens, topk_method=t,
                    num_sink_pages=sink, ordered=False, pieces=S)

    def first_stage_pieces(self, plan) -> int:
        """``CacheConfig.candidate_pieces``, or for ``None`` the most pieces (a power of two)
        that divide the first stage's candidates and leave each ``PIECE_SHARE`` of them; one
        with ``Tuning.topk_method="pallas_cmax"``, which ranks whole rows."""
        S = plan.cache.candidate_pieces
        if S is not None:
            return S
        if plan.cache.tuning.topk_method == "pallas_cmax":
            return 1
        C, _ = self.first_stage_blocks(plan, plan.cache.candidate_block)
        S = 1
        while C % (2 * S) == 0 and C // (2 * S) >= PIECE_SHARE:
            S *= 2
        return S

    def first_stage_blocks(self, plan, r: int) -> tuple[int, int]:
        """(blocks the first stage picks, of them the sink pages' blocks) with blocks of r
        pages; it picks the sink blocks and the current one, so it needs one block more."""
        return -(-self.candidate_count(plan) // r), -(-plan.cache.sink_pages // r)

    def check_plan(self, plan) -> None:
        """Raise (naming the largest that works) if ``CacheConfig.candidate_block`` leaves
        the first stage too few blocks for the sink blocks and the current one: blocks near
        the candidate count leave one block (candidate_pages 16 in blocks of 16)."""
        r = plan.cache.candidate_block
        if self.covers_row(plan):   # no first stage: nothing to pick
            return
        S = self.first_stage_pieces(plan)
        if S > 1 and plan.cache.tuning.topk_method == "pallas_cmax":
            raise ValueError(
                f"Tuning.topk_method='pallas_cmax' ranks whole rows, but "
                f"CacheConfig.candidate_pieces={S} splits the first stage's rows: set "
                f"candidate_pieces=1 (or None) or another topk_method")
        if S > 1:
            C, sink = self.first_stage_blocks(plan, r)
            try:
                dense_select.check_pieces(C, S, sink)
            except ValueError as e:
                ok = [x for x in range(1, S) if C % x == 0 and C // x >= -(-sink // x) + 1]
                raise ValueError(
                    f"CacheConfig.candidate_pieces ({S}) does not split the first stage's {C} "
                    f"candidate(s): {e}; candidate_pieces={max(ok)} works here") from None

        def fits(x):
            blocks, sink = self.first_stage_blocks(plan, x)
            return blocks >= sink + 1

        if not fits(r):
            n = self.candidate_count(plan)
            C, sink = self.first_stage_blocks(plan, r)
            # a divisor: blocks round up, so another size reads more candidate pages (16
            # candidates in blocks of 15 read 30); 1 fits as candidates > sink pages
            best = max(x for x in range(1, n) if n % x == 0 and fits(x))
            raise ValueError(
                f"CacheConfig.candidate_block ({r}) groups the {n} candidate pages into {C} "
                f"block(s), but the first stage needs {sink + 1} (the sink pages' {sink} and "
                f"the current page's): the largest candidate_block that divides the "
                f"candidates and works here is {best} (or raise candidate_pages)")

    def _rescore(self, plan, summaries, layer, q, cand, positions, seq_lens):
        tuning, impl = plan.cache.tuning, plan.cache.implementation
        keys, scales = self._key_copy(plan, summaries)
        pick = dict(k=plan.k, page_size=plan.page_size, num_pages=plan.pages_per_seq,
                    num_sink_pages=plan.cache.sink_pages)
        stage2 = impl if tuning.rescore_method == "auto" else tuning.rescore_method
        if (_common.resolve(mass_kernels.OP, stage2) is mass_kernels.candidate_mass_pallas
                and mass_kernels.kernel_takes(keys)):
            # The kernel's page statistics go to the final choice as they are.
            m, l = mass_kernels.page_stats_pallas(q, keys, scales, layer, cand, positions)
            final = final_choice_method(tuning, impl, cand.shape[-1])
            return select_kernels.candidate_select(
                m, l, cand, seq_lens, G=q.shape[1] // keys.shape[2], implementation=final,
                num_warps=tuning.rescore_select_warps, **pick)
        mass = mass_kernels.candidate_mass(q, keys, scales, layer, cand, positions,
                                           implementation=stage2, in_order=self.covers_row(plan))
        return top_candidates(mass, cand, seq_lens, **pick)

    def _key_copy(self, plan, summaries):
        """(keys, scales): the key copy, after Quest's bounds in the summaries."""
        nb = self.n_bounds(plan)
        return summaries[nb], summaries[nb + 1]

    def update_select(self, plan, summaries, layer, layer_params, h, q, kv_new, positions, *,
                      ahead=False):
        seq_lens = jnp.maximum(positions + 1 + int(ahead), 1)
        k_new = kv_new if kv_new.ndim == 3 else kv_new[:, 0]                # [B, H, D]
        if self.covers_row(plan):
            # the summaries stay current: a kept context may continue under a longer row
            bounds = self._update_bounds(plan, summaries, layer, kv_new, positions)
            cand = self._every_page(plan, seq_lens, k_new.shape[1])
        else:
            bounds, cand = self._update_select_bounds(plan, summaries, layer, q, seq_lens,
                                                      kv_new, positions,
                                                      **self._first_stage_kw(plan))
            cand = self._block_pages(plan, cand, seq_lens)
        summ = tuple(bounds) + self._store_keys(plan, summaries, layer, k_new, positions)
        if plan.k >= plan.pages_per_seq:  # the budget holds every page: nothing to re-rank
            return summ, cand
        return summ, self._rescore(plan, summ, layer, q, cand, positions, seq_lens)

    def fold(self, plan, summaries, layer, layer_params, h, q, kv_new, positions):
        nb = self.n_bounds(plan)
        qsumm = super().fold(plan, summaries[:nb], layer, layer_params, h, q, kv_new, positions)
        return qsumm + self._store_keys(plan, summaries, layer, kv_new[:, :, 0], positions)

    def _store_keys(self, plan, summaries, layer, k, positions):
        """(keys, scales): the key copy with k [B, ..., H, D] quantized and stored at
        positions [B, ...] (a decode step's [B], a turn's [B, T]; -1: dropped)."""
        return scatter_keys(*self._key_copy(plan, summaries), layer, k, positions)

    def first_pages(self, plan, summaries, layer, layer_params, h_last, q_last, lengths):
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.covers_row(plan):
            cand = self._every_page(plan, lengths + 1, self._key_copy(plan, summaries)[0].shape[2])
            if plan.k >= plan.pages_per_seq:  # the budget holds every page
                return cand
        else:
            cand = quest_kernels.quest_select(q_last, summaries[0], summaries[1], layer,
                                              lengths + 1, **self._scale_kw(plan, summaries),
                                              **self._first_stage_kw(plan))
            cand = self._block_pages(plan, cand, lengths + 1)
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
    """The first stage keeps 8x the budget, and at least 8192 tokens' pages: ``CacheConfig()``'s
    own 512 candidates of 16 tokens at every smaller budget. At 512 tokens in 16-token pages
    (256 pages by the multiple) RULER keeps 96.0% of dense's retrievals on SmolLM2-135M
    against 93.1%, and 88.6% against 82.4% on Qwen2.5-Coder-0.5B at 16k-32k, for a step
    1.03x as long at Qwen-like B=8 and none longer at 8B-like B=1 (docs/decisions.md)."""
    name = "quest_rescore8"
    candidates = 8
    min_candidate_tokens = 8192
