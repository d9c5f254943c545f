"""User-facing configuration: how to cache (static) and how to sample (traced).

:class:`CacheConfig` is frozen and hashable: it fixes shapes and code paths, so changing
it recompiles. :class:`Sampling` is a pytree of arrays: changing its values never does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import validation

Mode = Literal["host", "resident"]
Selector = Literal["quest_rescore8", "quest", "quest_rescore", "quest_rescore_exact", "indexer",
                   "dense", "oracle"]
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8")
IMPLEMENTATIONS = ("pallas", "xla")
BOUNDS_DTYPES = ("int8", "float")  # CacheConfig.bounds_dtype: how Quest's page bounds are stored


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Performance settings of the compiled programs: static (part of the jit key, so a new
    value recompiles), and none of them changes a result beyond float rounding (where a field
    says so, a near-tie may then pick another page). The defaults are the measured best
    on the H200 (docs/decisions.md has the figures); benchmarks vary them, users rarely need to.

    Attributes:
      compiler_options: XLA options of the compiled decode round, as (name, value) pairs. The
        default orders the round's CUDA graph by buffer dependencies so independent kernels may
        overlap (a faster step: docs/decisions.md). Options this XLA rejects are dropped
        with a warning; the CPU backend accepts and ignores this one.
      topk_method: top-k of the scored selectors (Quest, indexer, the oracle, the two-stage
        selectors' first stage, where "auto" is the full-row Pallas top-k for rows of up to
        4096 pages with the Pallas implementation (and see ``first_stage_kernel_min_rows``),
        else XLA's "sort"): "auto" or one of
        ``jaxkv.kernels.dense_select.TOPK_METHODS``. A first stage in pieces
        (``CacheConfig.candidate_pieces``) with "pallas" (or "auto" taking the kernel) runs
        one program per piece that reads and masks the row itself.
      topk_cmax_min_pages: with "auto" and the Pallas implementation, rows of at least this
        many pages take the chunk-maxima top-k ("pallas_cmax": the scores kernel writes chunk
        maxima, the top-k kernel reads only those and the chosen chunks); None: never.
      ensure_method: the LRU ensure's form, "auto" | "dense" | "sort" | "pallas" (identical
        results; ``jaxkv.lru``).
      ensure_dense_max_elems: "auto" takes the sort-free compare-matrix form up to this many
        compare elements per layer (R*R + S*S + R*S + Q*S), the sort form above. ``None``:
        the measured threshold (2**20 on the GPU or with the Pallas implementation, 2048
        with XLA elsewhere: ``jaxkv.lru``).
      ensure_pallas_max: "auto" with the Pallas implementation runs the compare-matrix form as
        one Pallas kernel when R, S and Q are at most this (above 128 the kernel's matrices
        spill registers).
      rescore_method: the second stage of the two-stage selectors (``quest_rescore*``),
        "auto" (``CacheConfig.implementation``'s choice: the kernel on the GPU, the blocked
        formulation elsewhere) | "pallas" | "xla" (the reference; the same masses to
        rounding; ``jaxkv.kernels.candidate_mass``).
      first_stage_kernel_min_rows: with "auto" and the Pallas implementation, the two-stage
        selectors' first stage also takes the full-row top-k kernel for rows of 4097-16384
        pages when a layer has at least this many rows (requests x KV heads): one program
        per row, so fewer rows leave the GPU idle (Qwen-like B=8 at 128k in 16-token pages,
        16 rows: the step 10% shorter; 8B-like B=1, 8 rows: a tie; docs/decisions.md).
        None: never.
      rescore_select_method: the two-stage selectors' final choice after the Pallas second
        stage: "auto" (the kernel with the Pallas implementation for at most
        ``rescore_select_kernel_max`` candidates, else XLA) | "pallas" (one kernel from the
        second stage's page statistics to the chosen pages) | "xla" (the masses, a top-k and
        a sort in XLA). The same pages; after the XLA second stage the choice is XLA's
        (``jaxkv.kernels.candidate_select``).
      rescore_select_kernel_max: candidates per KV head up to which "auto" takes the final
        choice kernel (one program per request and KV head: faster than XLA's top-k and sort
        at 256 and, with 8 warps, 512 candidates, Qwen-like B=8 and 8B-like B=1; slower at
        1024, 8B-like B=1; docs/decisions.md).
      rescore_select_warps: the final choice kernel's warps per program. ``None``: 4 below
        512 candidates, 8 from 512 (``jaxkv.kernels.candidate_select.default_warps``). At
        ``CacheConfig()``'s 512 candidates (128k, one H100) the step with 8 warps is 1.220x
        Quest's against 1.375x with 4 and 1.342x with XLA's form (Qwen-like B=8), 1.133x
        against 1.230x and 1.177x (8B-like B=1).
      materialize_qk: each sparse layer's query and new K/V row pass an
        ``optimization_barrier`` before the selector and the cache write read them, so XLA
        computes their projections once instead of fusing a copy of the product into each
        consumer (the same values). ``None``: for the two-stage selectors, whose int8 key copy
        and second stage add consumers (Qwen-like B=8, 128k, blocks of four: 189 -> 139
        GEMM kernels per step, the step 5-6% shorter; Quest's step unchanged:
        docs/decisions.md).
    """

    compiler_options: tuple = (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),)
    topk_method: str = "auto"
    topk_cmax_min_pages: int | None = 2048
    ensure_method: str = "auto"
    ensure_dense_max_elems: int | None = None
    ensure_pallas_max: int = 128
    rescore_method: str = "auto"
    first_stage_kernel_min_rows: int | None = 16
    rescore_select_method: str = "auto"
    rescore_select_kernel_max: int = 512
    rescore_select_warps: int | None = None
    materialize_qk: bool | None = None

    def __post_init__(self):
        opts = self.compiler_options
        if not isinstance(opts, (tuple, list)) or not all(
                isinstance(o, (tuple, list)) and len(o) == 2 and isinstance(o[0], str) for o in opts):
            raise ValueError("Tuning.compiler_options must be (name, value) pairs, e.g. "
                             f"(('xla_gpu_autotune_level', 0),), got {opts!r}")
        # Python values: XLA takes str / bool / int / float (np.bool_(True) it rejects), and
        # equal values share _accepted_options' cache entry (2 and np.int64(2) hash alike)
        opts = tuple((name, validation.scalar_value(value)) for name, value in opts)
        for name, value in opts:
            if not isinstance(value, (str, bool, int, float)):
                raise ValueError(f"Tuning.compiler_options: the value of {name!r} must be a str, "
                                 f"bool, int or float (as XLA takes it), got "
                                 f"{type(value).__name__} {value!r}")
        object.__setattr__(self, "compiler_options", opts)
        topk = ("auto", "sort", "rounds", "chunked", "radix", "pallas", "pallas_cmax")
        if self.topk_method not in topk:
            raise ValueError(f"Tuning.topk_method must be one of {topk}, got {self.topk_method!r}")
        if self.ensure_method not in ("auto", "dense", "sort", "pallas"):
            raise ValueError("Tuning.ensure_method must be 'auto', 'dense', 'sort' or 'pallas', "
                             f"got {self.ensure_method!r}")
        if self.rescore_method not in ("auto", "pallas", "xla"):
            raise ValueError("Tuning.rescore_method must be 'auto', 'pallas' or 'xla', "
                             f"got {self.rescore_method!r}")
        if self.rescore_select_method not in ("auto", "pallas", "xla"):
            raise ValueError("Tuning.rescore_select_method must be 'auto', 'pallas' or 'xla', "
                             f"got {self.rescore_select_method!r}")
        if self.topk_cmax_min_pages is not None:
            _as_int("topk_cmax_min_pages", self.topk_cmax_min_pages, 1, "Tuning")
        if self.first_stage_kernel_min_rows is not None:
            _as_int("first_stage_kernel_min_rows", self.first_stage_kernel_min_rows, 1, "Tuning")
        if self.ensure_dense_max_elems is not None:
            _as_int("ensure_dense_max_elems", self.ensure_dense_max_elems, 0, "Tuning")
        _as_int("ensure_pallas_max", self.ensure_pallas_max, 0, "Tuning")
        _as_int("rescore_select_kernel_max", self.rescore_select_kernel_max, 0, "Tuning")
        if self.rescore_select_warps is not None:
            w = _as_int("rescore_select_warps", self.rescore_select_warps, 1, "Tuning")
            if w & (w - 1):
                raise ValueError("Tuning.rescore_select_warps must be None or a power of two "
                                 f"(Triton's warps per program), got {w}")
            object.__setattr__(self, "rescore_select_warps", w)
        if self.materialize_qk is not None:
            if not isinstance(self.materialize_qk, (bool, np.bool_)):
                raise ValueError("Tuning.materialize_qk must be None (the selector's choice) or "
                                 f"a bool, got {self.materialize_qk!r}")
            object.__setattr__(self, "materialize_qk", bool(self.materialize_qk))


def _as_int(name: str, v, minimum: int, owner: str = "CacheConfig"):
    """v as a Python int >= minimum (numpy ints accepted, bools and floats refused)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def _dense_layers(v):
    """CacheConfig.dense_layers as an int >= 0 or a tuple of distinct ints (a list or any
    iterable of ints accepted; the layer count checks the range, ``jaxkv.api``). 0-d arrays
    (numpy or jax), as the value or as items, are their value."""
    v = validation.scalar_value(v)
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return _as_int("dense_layers", v, 0)
    fix = ("pass an int N (the first N layers) or a tuple of layer indices, "
           "e.g. dense_layers=(0, 1, -1)")
    if isinstance(v, (str, bytes, float, bool, np.bool_)) or not hasattr(v, "__iter__"):
        raise ValueError(f"CacheConfig.dense_layers must be an int or a tuple of ints, got {v!r}: "
                         f"{fix}")
    items = tuple(validation.scalar_value(i) for i in v)
    for i in items:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"CacheConfig.dense_layers holds {i!r}, not a layer index: {fix}")
    items = tuple(int(i) for i in items)
    if len(set(items)) != len(items):
        raise ValueError(f"CacheConfig.dense_layers names a layer twice: {items!r}")
    return items


def dense_layer_set(dense, num_layers: int) -> tuple[int, ...]:
    """``CacheConfig.dense_layers`` of a model with ``num_layers`` layers as ascending layer
    indices; a ValueError names a layer out of range or named twice."""
    if isinstance(dense, int):
        if dense > num_layers:
            raise ValueError(f"CacheConfig.dense_layers ({dense}) exceeds the model's "
                             f"{num_layers} layers: lower dense_layers")
        return tuple(range(dense))
    bad = [i for i in dense if not -num_layers <= i < num_layers]
    if bad:
        raise ValueError(f"CacheConfig.dense_layers names layer(s) {bad} of a model with "
                         f"{num_layers} layers: use indices in [-{num_layers}, {num_layers})")
    layers = sorted({i % num_layers for i in dense})
    if len(layers) != len(dense):
        raise ValueError(f"CacheConfig.dense_layers {dense!r} names a layer twice "
                         f"(negative indices count from the end of the {num_layers} layers)")
    return tuple(layers)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """How generate() keeps and reads the KV cache.

    Attributes:
      mode: "host" (full KV in pinned host memory, device pool as LRU cache) or
        "resident" (every page on device; the baseline). One switch, same math.
      selector: a registered page selector (``jaxkv.selectors``): "quest_rescore8" (the
        default: Quest's bound picks ``candidate_pages``, an int8 copy of the keys on the
        device re-ranks them by attention mass; near-lossless at the default budget),
        "quest" (the bound alone: the cheapest step, no key copy, lossy at small budgets),
        "quest_rescore" (4x candidates), "indexer", "dense" (every valid page), "oracle"
        (exact attention mass per page from a full copy of the keys; resident only, for
        measuring what a selector could keep) or "quest_rescore_exact" (the second stage on
        the keys as stored, for measuring what the int8 copy costs). Of dense's RULER
        retrievals at 1024 tokens, SmolLM2-135M keeps 97.7% with "quest_rescore8" (float32
        KV itself 98.4%) against 74% with "quest"; Qwen2.5-Coder-0.5B at 8k-32k 94% against
        71% (BENCHMARKS.md).
      page_size: tokens per page (power of two). Larger pages make the step cheaper (fewer
        bounds to score) and keep fewer retrievals at the same budget: 1024 tokens in 64-token
        pages keep 96.9% of dense's RULER retrievals on SmolLM2-135M and 87.3% on
        Qwen2.5-Coder-0.5B at 8k-32k, against 97.7% and 93.7% in 16-token pages; 8-token
        pages (``selected_pages=128``) keep 93.2% of Qwen's at 16k-32k against 91.4%, and
        98.0% of SmolLM2's against 97.7%, for a 1.20x longer step at Qwen-like B=8
        (docs/decisions.md).
      selected_pages: k, pages selected per request, layer and KV head per step
        (ignored by "dense"). Default 64: 1024 tokens of the default 16-token pages.
      candidate_pages: the two-stage selectors' first-stage pages per request, layer and KV
        head: Quest's bound picks this many, the key copy re-ranks them down to
        ``selected_pages`` (``jaxkv.selectors.rescore``). ``None``: the selector's own multiple
        of ``selected_pages`` (4x "quest_rescore", 8x "quest_rescore8"), for "quest_rescore8"
        at least 8192 tokens' pages (the default's 512 of 16 tokens at every smaller budget:
        at 512 tokens RULER keeps 96.0% of dense's retrievals on SmolLM2-135M against 93.1%
        with 256, and 88.6% against 82.4% on Qwen2.5-Coder-0.5B at 16k-32k, for at most 1.03x
        the step). The re-ranking reads every candidate's keys, so its cost grows with this
        number, not with ``selected_pages`` (docs/decisions.md).
      candidate_block: pages per block of the two-stage selectors' first stage: Quest's
        bound is kept per block of this many pages and picks whole blocks
        (``candidate_pages / candidate_block`` of them), so the first stage reads that many
        times fewer bounds and its top-k ranks that many times fewer entries. 1 (the
        default): per page. Blocks of four make the step cheaper (128k, 1024 tokens, 8B-like
        B=1: 1.126x Quest's step against 1.409x per page with the row's top-k, 5c24972; the
        default's pieces bring per page to 1.160x, 64fdc58) but lose retrievals where the
        first stage chooses: RULER on Qwen2.5-Coder-0.5B at 1024 tokens keeps 87% / 79% of
        dense's at 16k / 32k against 94% / 88% per page (docs/decisions.md).
      candidate_pieces: the two-stage selectors' first stage in this many strided pieces of
        each row (page ``p`` in piece ``p % candidate_pieces``): the top ``candidate_pages /
        candidate_pieces`` of each piece are the candidates, instead of the row's top
        ``candidate_pages``. The top-k then runs one program per piece instead of one per
        row (a request's KV head), which fills the GPU on long rows; the candidates differ
        from the row's top ones only where a piece holds more than its share of them, and the
        second stage re-ranks them. ``None`` (the default): pieces of
        ``rescore.PIECE_SHARE`` (64) candidates each, as many as divide the candidates
        (8 for 512, 1 up to 127; 1 with ``Tuning.topk_method="pallas_cmax"``, which ranks
        whole rows); 1: the row's top. Must divide the candidates. At 128k and
        1024 tokens the default's 8 pieces make the step 1.16x Quest's at 8B-like B=1 and
        1.32x at Qwen-like B=8, against 1.40x / 1.67x for the row's top, and RULER on
        Qwen2.5-Coder-0.5B keeps the same retrievals (docs/decisions.md).
      pool_pages: device slots per layer in "host" mode. ``None``: enough for the
        worst-case working set of a step (no drops).
      sink_pages / recent_pages: pages pinned in the pool (never evicted); the selectors
        always include the sink pages and the current page.
      max_context: tokens per sequence the cache holds (prompt + generated). ``None``: the
        next power of two >= longest prompt + max_new_tokens (at least 256), so calls in
        the same bucket share one compilation.
      strict: raise after a call if any selection was dropped (pool too small) or a request
        was cut at the context's capacity (``truncated_requests``).
      kv_dtype: the dtype K and V are stored in, in the host tier and the device pool (None =
        the model's dtype). "float32" / "bfloat16" / "float16" store them as they are (a
        dtype other than the model's is converted on write; attention multiplies in the wider
        of the two). "int8" / "float8_e4m3fn" / "float8_e5m2" quantize them to one byte
        per value with one scale byte per (token, KV head, K or V) at the end of each page
        row (``jaxkv.kernels.kv_quant``; a power of two for fp8, a quarter power of two for
        int8): half the bytes of bf16 in the host tier, the
        pool and over PCIe; attention dequantizes inside its kernel. The prefill attention
        uses the prompt's unquantized K/V, decode reads what is stored; the selector's
        summaries stay in the model's dtype. int8 is the more accurate of the three (about 7
        bits relative to each vector's largest element against fp8 e4m3's 3 mantissa bits; see
        BENCHMARKS.md for retrievals kept) and needs no fp8 support in the GPU; fp8 needs
        compute capability >= 8.9 (H100, H200, L40S) or the CPU, where it decodes about 3x
        (resident) to 6x (host tier) slower than int8 (XLA:CPU emulates fp8 arithmetic).
      kv_key_shift: with a quantized ``kv_dtype``, store each key minus its request's mean key
        (per layer and KV head, the mean over the prompt, fixed at the prefill and kept with
        a continued context). Exact: a query's scores all move by the same ``q . mean``,
        which the softmax cancels; the keys' common component (a K bias) is then not
        quantized. ``None`` (default): on for models with a K bias (qwen2), off otherwise.
        Of the bf16 cache's RULER retrievals, Qwen2.5-Coder-0.5B keeps 98.9% with int8 and
        the shift against 96.2% without (fp8: 97.0% against 92.6%); SmolLM2-135M keeps
        97.4% with int8 and the shift against 98.3% without (fp8: 93.1% against 94.5%;
        int8 with the power-of-two scales it had then; BENCHMARKS.md). Ignored for other
        dtypes.
      kv_key_rotation: with a quantized ``kv_dtype``, store each key (after the shift)
        rotated by the normalized Hadamard matrix of the head dimension, and rotate the
        decode queries alike: exact (``(q R) . (k R) = q . k``); the rotation spreads a key's
        large channels over all of them. ``None`` (default): on for fp8 keys that are not
        shifted (``kv_key_shift`` off), off otherwise. fp8 keeps 3 mantissa bits per element,
        so a query's large channels meeting a key's large channels carry most of the score's
        rounding error; spread out, it averages: SmolLM2-135M (no K bias) keeps 95.6% of the
        bf16 cache's RULER retrievals with rotated fp8 keys against 92.4% (dense; 94.9%
        against 91.5% with quest_rescore8 at 1024 tokens). int8 (one scale per vector) gains
        no retrievals from it (97.7% against 97.9%), nor do shifted fp8 keys in the CPU probe
        (Qwen2.5-Coder-0.5B's key error 5.5% shifted, 6.1% shifted and rotated). It costs
        0.3-0.6% of a Qwen-like B=8 step (BENCHMARKS.md). Ignored for other dtypes.
      bounds_dtype: how Quest's page bounds (kmax / kmin, which the Quest selectors' first
        stage reads every step) are stored. "int8": int8 with one float32 scale per page and
        KV head (a power of two), rounded outward (max up, min down) so a page's score stays
        an upper bound, of the keys less the request's mean prompt key per layer and KV head
        (every page's score moves alike: no selection changes, but a common component of the
        keys no longer sets every page's scale): half the bytes the scores kernel reads.
        "float": in ``kv_dtype`` (the model's dtype for a quantized or unset ``kv_dtype``).
        ``None`` (default): "int8" for the two-stage selectors (``quest_rescore8``,
        ``quest_rescore``, ``quest_rescore_exact``), whose bounds only shortlist candidates
        for the second stage; "float" for ``quest``, whose bounds make the final choice (int8
        there is not measured on RULER). Measured for ``quest_rescore8`` (one H100, 128k, 1024
        tokens): the step is 1.098x Quest's at Qwen-like B=8 instead of 1.183x, 1.072x
        instead of 1.105x at 8B-like B=1; RULER on Qwen2.5-Coder-0.5B at 16k / 32k keeps
        512 of dense's 561 retrievals against 513 with float bounds (lost 5, gained 4); the
        device state at Qwen-like B=8 is 0.9 GiB smaller (BENCHMARKS.md). Quest selectors
        only.
      prefill_chunk: query tokens per chunk of the "xla" prefill attention (bounds its memory;
        the CPU's "blocked" form and the flash-attention implementations on the GPU do not
        read it).
      prefill_token_chunk: tokens per piece of a prefill layer's per-token work (norms,
        projections, MLP), run one piece after another; bounds the activation memory of long
        prompts (the MLP's float32 products take ~230 KiB per token at the 8B-like shape).
        Prompt buckets up to this length run in one piece. ``None``: 131072 on the GPU, 512
        elsewhere (XLA:CPU's matrix products run ~1.3x faster on pieces whose products stay in
        cache), at least ``page_size``.
      round_steps: decode steps per compiled round (stream granularity).
      implementation: kernel implementation ("pallas", "xla" or None = per backend; with None
        the GPU prefill attention is cuDNN's flash attention where it applies).
      schedule: host mode only. "step" (default): attention reads the pages a layer misses
        straight from the pinned host tier (zero-copy, inside the attention kernel), and one
        LRU ensure for all layers at the start of the next step installs the previous step's
        selections into pool slots (one fetch launch). Nothing is ever dropped from
        attention; ``overflow`` counts pages that found no slot to stay in. "scratch": as
        "step", but each layer first copies its misses into per-layer scratch rows of the
        pool (one fetch launch per layer) and attention reads only device memory. "layer": a
        full LRU ensure per layer before its attention (misses beyond the pool are dropped
        from attention and counted).
      reuse: keep fetched pages in the pool for later steps. False (schedule "step" or
        "scratch") is the no-cache baseline: every selected page is read from the host every
        step.
      dense_layers: the layers that attend densely to every page: an int N for the first N
        (Quest keeps its first 2 dense), or a tuple of layer indices, negative ones counted
        from the end as in Python, e.g. ``(3, 5, -2, -1)`` for the layers whose attention is
        most diffuse (``benchmarks/probes/layer_budget.py`` ranks them). In "host" mode their
        K/V are also kept fully on device.
      unroll_layers: unroll the per-token layer loop (None: on GPU, where a loop iteration
        costs a host round trip, ~10 us on the H200 (docs/decisions.md); off elsewhere, for
        compile time).
      selection_lag: 0 (default): each step's pages are chosen with that step's own queries
        (exact selection). 1: they are chosen one step ahead, with the previous token's
        queries (the prompt's last token for the first step), plus the step's own page,
        always included; the selector's work then does not sit between a layer's query and
        its attention, so it can run beside the rest of the step. An approximation: it
        changes which pages are read (about 1 in 9 on real text: docs/decisions.md), never
        the pages the sinks / current page rule forces. Every selector that scores pages
        (the two-stage ones, Quest, the indexer, the oracle); "dense" refuses it.
      tuning: :class:`Tuning`, performance settings that never change results.
    """

    mode: Mode = "host"
    selector: Selector = "quest_rescore8"
    page_size: int = 16
    selected_pages: int = 64
    candidate_pages: int | None = None
    candidate_block: int = 1
    candidate_pieces: int | None = None
    pool_pages: int | None = None
    sink_pages: int = 1
    recent_pages: int = 1
    max_context: int | None = None
    strict: bool = False
    kv_dtype: str | None = None
    kv_key_shift: bool | None = None
    kv_key_rotation: bool | None = None
    bounds_dtype: str | None = None
    prefill_chunk: int = 2048
    prefill_token_chunk: int | None = None
    round_steps: int = 64
    implementation: str | None = None
    schedule: Literal["step", "scratch", "layer"] = "step"
    reuse: bool = True
    unroll_layers: bool | None = None
    dense_layers: int | tuple[int, ...] = 0
    selection_lag: int = 0
    tuning: Tuning = Tuning()

    @property
    def bounds_int8(self) -> bool:
        """Whether Quest's page bounds are stored in int8 (``bounds_dtype``, ``None`` resolved
        by the selector: int8 for the two-stage selectors)."""
        if self.bounds_dtype is not None:
            return self.bounds_dtype == "int8"
        from jaxkv import selectors  # the registry (imports the kernels: not at module level)
        return selectors.get(self.selector).two_stage

    def __post_init__(self):
        if not isinstance(self.tuning, Tuning):
            raise ValueError(f"CacheConfig.tuning must be a jaxkv.Tuning, got {self.tuning!r}")
        object.__setattr__(self, "dense_layers", _dense_layers(self.dense_layers))
        if self.schedule not in ("step", "scratch", "layer"):
            raise ValueError("CacheConfig.schedule must be 'step', 'scratch' or 'layer', got "
                             f"{self.schedule!r}")
        if not self.reuse and self.schedule == "layer":
            raise ValueError("CacheConfig(reuse=False) (no-cache baseline) needs schedule='step' "
                             "or 'scratch'")
        object.__setattr__(self, "selection_lag", _as_int("selection_lag", self.selection_lag, 0))
        if self.selection_lag > 1:
            raise ValueError(f"CacheConfig.selection_lag must be 0 (exact) or 1 (pages chosen "
                             f"with the previous token's queries), got {self.selection_lag}")
        from jaxkv import selectors  # the registry (imports the kernels: not at module level)
        if self.selector not in selectors.names():
            raise ValueError(f"CacheConfig.selector must be one of {selectors.names()}, "
                             f"got {self.selector!r}")
        if self.mode == "host" and not selectors.get(self.selector).host_tier:
            raise ValueError(f"CacheConfig.selector={self.selector!r} keeps a full copy of the "
                             "keys on device and runs resident only: set mode='resident'")
        if self.candidate_pages is not None:
            object.__setattr__(self, "candidate_pages",
                               _as_int("candidate_pages", self.candidate_pages, 1))
            if not selectors.get(self.selector).two_stage:
                two = [n for n in selectors.names() if selectors.get(n).two_stage]
                raise ValueError(f"CacheConfig.candidate_pages is the first stage of a two-stage "
                                 f"selector ({two}); selector={self.selector!r} has none: leave "
                                 "candidate_pages=None")
        for name, what in (("candidate_block", "groups"), ("candidate_pieces", "splits")):
            if name == "candidate_pieces" and self.candidate_pieces is None:
                continue  # the selector's choice (``Rescore.first_stage_pieces``)
            object.__setattr__(self, name, _as_int(name, getattr(self, name), 1))
            if getattr(self, name) > 1 and not selectors.get(self.selector).two_stage:
                two = [n for n in selectors.names() if selectors.get(n).two_stage]
                raise ValueError(f"CacheConfig.{name} {what} the first stage of a two-stage "
                                 f"selector ({two}); selector={self.selector!r} has none: "
                                 f"leave {name}=1")
        if self.selection_lag and not selectors.get(self.selector).scored:
            raise ValueError(f"CacheConfig.selection_lag=1 needs a scored selector (the "
                             f"{self.selector!r} selector reads every page): set selection_lag=0")
        if self.mode not in ("host", "resident"):
            raise ValueError(f"CacheConfig.mode must be 'host' or 'resident', got {self.mode!r}")
        for name, lo in (("page_size", 1), ("selected_pages", 1), ("prefill_chunk", 1),
                         ("round_steps", 1), ("sink_pages", 0), ("recent_pages", 0)):
            object.__setattr__(self, name, _as_int(name, getattr(self, name), lo))
        for name in ("pool_pages", "max_context", "prefill_token_chunk"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _as_int(name, getattr(self, name), 1))
        ps = self.page_size
        if ps & (ps - 1):
            raise ValueError(f"CacheConfig.page_size must be a power of two, got {ps!r}: "
                             f"use {1 << (ps.bit_length() - 1)} or {1 << ps.bit_length()}")
        if self.candidate_pages is not None and self.candidate_pages < self.selected_pages:
            raise ValueError(f"CacheConfig.candidate_pages ({self.candidate_pages}) must be at "
                             f"least selected_pages ({self.selected_pages}): the second stage "
                             "keeps selected_pages of the candidates")
        if self.selected_pages < self.sink_pages + 1:
            raise ValueError(
                f"selected_pages ({self.selected_pages}) must cover the sink pages "
                f"({self.sink_pages}) and the current page: raise selected_pages")
        if self.max_context is not None and self.max_context % ps:
            lo, hi = self.max_context // ps * ps, -(-self.max_context // ps) * ps
            raise ValueError(f"CacheConfig.max_context ({self.max_context}) is not a multiple of page_size "
                             f"({ps}): use {hi}" + (f" or {lo}" if lo else ""))
        if self.kv_dtype is not None and not isinstance(self.kv_dtype, str):
            try:  # a dtype object (np.dtype, jnp.int8, ml_dtypes' fp8): its name
                object.__setattr__(self, "kv_dtype", np.dtype(self.kv_dtype).name)
            except TypeError:
                pass  # refused below, naming the value
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"CacheConfig.kv_dtype must be one of {KV_DTYPES} or None (the "
                             f"model's), got {self.kv_dtype!r}")
        if self.bounds_dtype is not None and self.bounds_dtype not in BOUNDS_DTYPES:
            raise ValueError(f"CacheConfig.bounds_dtype must be one of {BOUNDS_DTYPES} or None "
                             f"(int8 for the two-stage selectors, float for quest), got "
                             f"{self.bounds_dtype!r}")
        if self.bounds_dtype is not None and not isinstance(selectors.get(self.selector),
                                                            selectors.quest.Quest):
            quest = [n for n in selectors.names()
                     if isinstance(selectors.get(n), selectors.quest.Quest)]
            raise ValueError(f"CacheConfig.bounds_dtype sets how Quest's page bounds are stored "
                             f"(selectors {quest}); selector={self.selector!r} keeps none: "
                             "leave bounds_dtype=None")
        if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"CacheConfig.implementation must be 'pallas', 'xla' or None, "
                             f"got {self.implementation!r}")
        optional = tuple(n for n in ("unroll_layers", "kv_key_shift", "kv_key_rotation")
                         if getattr(self, n) is not None)
        for name in ("strict", "reuse") + optional:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                opt = "" if name in ("strict", "reuse") else "None or "
                raise ValueError(f"CacheConfig.{name} must be {opt}a bool, got "
                                 f"{getattr(self, name)!r}")
        for name in ("prefill_chunk", "prefill_token_chunk"):
            pc = getattr(self, name)
            if pc is not None and (pc & (pc - 1) or pc < ps):
                raise ValueError(f"CacheConfig.{name} must be a power of two >= page_size ({ps}), "
                                 f"got {pc}: set {name}={max(ps, 1 << (pc - 1).bit_length())}")


def _sampling_number(name: str, v, *, integer: bool = False):
    """A concrete Sampling value as a Python float (int for ``integer``); traced values and
    device arrays of the right kind pass through (jit re-builds Sampling from them)."""
    if isinstance(v, jax.core.Tracer):
        return v
    v = validation.scalar_value(v)
    kind = "an int" if integer else "a number"
    if isinstance(v, (bool, np.bool_)) or v is None or isinstance(v, (str, bytes)) or \
            not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"Sampling.{name} must be {kind}, got {v!r} ({type(v).__name__})")
    if integer:
        if isinstance(v, (float, np.floating)):
            raise ValueError(f"Sampling.{name}: top_k must be an int >= 0 (0 = off), got {v!r}"
                             + (f": pass {int(v)}" if float(v).is_integer() else ""))
        return int(v)
    try:
        f = float(v)
    except OverflowError:   # an int beyond float64 (2**1100): finite, and beyond float32 too
        f = None
    with np.errstate(over="ignore", under="ignore"):
        v32 = math.inf if f is None else float(np.float32(f))
    if (f is None or math.isfinite(f)) and not math.isfinite(v32):
        raise ValueError(f"Sampling.{name}: {v!r} overflows float32, in which it is held "
                         f"(at most {float(np.finfo(np.float32).max):.4g})")
    return v32   # the value the sampler sees, so the checks below hold for it


@dataclasses.dataclass(frozen=True, eq=False)
class Sampling:
    """Sampling parameters, traced (new values never recompile): ``Sampling(temperature=0.7,
    top_p=0.9)``. Values are checked when built (a bad one raises naming the field) and held
    as 0-d arrays, so a Sampling is a pytree jit traces.

    temperature: 0 = greedy. top_k: keep the k most likely tokens (0 = off). top_p: keep the
    smallest set of tokens whose probability reaches p (1 = off). min_p: keep the tokens
    whose probability is at least ``min_p`` times the most likely one's (0 = off). The
    filters apply after the temperature.
    """

    temperature: jax.Array = 0.0
    top_k: jax.Array = 0
    top_p: jax.Array = 1.0
    min_p: jax.Array = 0.0

    def __post_init__(self):
        t = _sampling_number("temperature", self.temperature)
        k = _sampling_number("top_k", self.top_k, integer=True)
        p = _sampling_number("top_p", self.top_p)
        m = _sampling_number("min_p", self.min_p)
        if not isinstance(t, jax.core.Tracer) and not (math.isfinite(t) and t >= 0):
            raise ValueError(f"Sampling.temperature: temperature must be a finite number >= 0 "
                             f"(0 = greedy), got {t}")
        if not isinstance(k, jax.core.Tracer) and not 0 <= k < 2**31:
            raise ValueError(f"Sampling.top_k: top_k must be an int >= 0 and < 2**31 (0 = off), "
                             f"got {k!r}")
        if not isinstance(p, jax.core.Tracer) and not 0 < p <= 1:
            raise ValueError(f"Sampling.top_p: top_p must be in (0, 1] (1 = off), got {p}"
                             + (" (in float32)" if p == 0 and self.top_p != 0 else ""))
        if not isinstance(m, jax.core.Tracer) and not 0 <= m <= 1:
            raise ValueError(f"Sampling.min_p: min_p must be in [0, 1] (0 = off), got {m}")
        for name, v, dt in (("temperature", t, jnp.float32), ("top_k", k, jnp.int32),
                            ("top_p", p, jnp.float32), ("min_p", m, jnp.float32)):
            object.__setattr__(self, name, v if isinstance(v, jax.core.Tracer) else jnp.asarray(v, dt))

    @classmethod
    def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> "Sampling":
        """The same as the constructor, with ``validation.check_sampling_args``' messages
        (which name the argument and the fix)."""
        temperature, top_k, top_p = (validation.scalar_value(v)
                                     for v in (temperature, top_k, top_p))
        validation.check_sampling_args(temperature, top_k, top_p)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)

    def __repr__(self):
        def show(v):  # a float32 as its shortest repr (0.7, not 0.699999988079071)
            return v if isinstance(v, jax.core.Tracer) else str(np.asarray(v))
        vals = ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in dataclasses.fields(self))
        return f"Sampling({vals})"


def _sampling_flatten(s: Sampling):
    return (s.temperature, s.top_k, s.top_p, s.min_p), None


def _sampling_unflatten(_, leaves) -> Sampling:
    s = object.__new__(Sampling)  # leaves may be tracers or placeholders: no validation
    for f, v in zip(("temperature", "top_k", "top_p", "min_p"), leaves):
        object.__setattr__(s, f, v)
    return s


jax.tree_util.register_pytree_node(Sampling, _sampling_flatten, _sampling_unflatten)


def greedy() -> Sampling:
    return Sampling.make()
