"""Same-process A/B of variants of the whole decode step.

    PYTHONPATH=. python3 benchmarks/ab_step.py --out DIR --variants default,topk_full_row
    PYTHONPATH=. python3 benchmarks/ab_step.py --out DIR --variants default,exhaustive [--config c2]

Run-to-run noise of a decode step on the H200 is a few percent, more than most single changes
gain, so a change is measured against its baseline in one process: each variant gets its own
plan and state (Qwen-like B=8 at 128k, resident sparse "b" or host tier with a 2x pool "c2"),
one warm-up (compile) round, then ``--pairs`` turns in which every variant runs two rounds, the
order reversed every other turn (ABBA for two variants). The figure is, per variant, the median
over turns of its step time divided by the first variant's.

Variants (``VARIANTS``): each one is a set of ``CacheConfig`` fields, ``jaxkv.Tuning`` fields
and XLA compiler options (``Tuning.compiler_options``, added to the default ones); every
variant is a plan of its own, so nothing is read at trace time.

* ``default``: Quest (``selector="quest"``, the baseline of every ratio), default tunings;
* ``exhaustive``: the Triton GEMM autotuner searches its full tiling space; ``autotune0``: no
  autotuning (XLA's heuristic tilings);
* ``pdl_off`` / ``pdl_on`` / ``pdl_launch``: programmatic dependent launch (Hopper) off, on,
  on with early-launch instructions; ``graph_serial`` / ``graph_concurrent``: the CUDA graph's
  kernel ordering (``xla_gpu_command_buffer_scheduling_mode``; the default is concurrent),
  ``graph_xla``: no options at all (``Tuning(compiler_options=())``); ``graph_while``: the
  decode while loop in the CUDA graph too (XLA's WHILE / CONDITIONAL command types added to a
  full list of types; ``graph_list``: that list without them); ``conc_multi_output`` /
  ``conc_heroless`` / ``conc_block_level`` / ``conc_all_triton``: one of XLA's experimental
  fusion passes;
* ``lagged``: ``CacheConfig(selection_lag=1)``: each step attends to the pages chosen with the
  previous token's queries;
* ``ensure_pallas256`` (host tier, c2): the LRU ensure's "auto" takes the one-launch Pallas
  kernel up to 256 requests / slots per layer (``Tuning.ensure_pallas_max``); meaningful at
  ``--batch 1``. ``ensure_dense4m``: "auto" takes the dense form up to 4M compare elements
  per layer (``Tuning.ensure_dense_max_elems``), so Qwen-like B=8 with the 2x pool runs it
  instead of the sort; ``ensure_sort``: the sort form always. ``lagged_*``: the same with
  lagged selection.
* ``topk_full_row``: Quest's top-k reads whole score rows (``Tuning(topk_cmax_min_pages=None)``)
  instead of the chunk maxima.
* ``dense``: the dense selector (every page; resident config only); ``rescore`` /
  ``rescore8``: the two-stage selectors ``quest_rescore`` / ``quest_rescore8`` (Quest picks 4x /
  8x the budget, the int8 key copy re-ranks them); ``lagged_rescore8``: with
  ``selection_lag=1``. ``rescore8_xla`` / ``rescore8_pallas``: ``quest_rescore8`` with its
  second stage in XLA / as the Pallas kernel (``Tuning.rescore_method``);
  ``rescore8_topk_{chunked,cmax,radix,sort,pallas}``: the first stage's top-k method
  (``Tuning.topk_method``; "auto" is the full-row kernel up to 4096 pages, and up to 16384
  with ``Tuning.first_stage_kernel_min_rows`` rows, XLA's sort otherwise; chunked and cmax
  with the second stage's kernel); ``rescore_select_xla`` /
  ``rescore8_select_xla``: the final choice after the kernel in XLA (masses, top-k, sort)
  instead of the ``candidate_select`` kernel (``Tuning.rescore_select_method``);
  ``rescore_topk_sort``: the first stage by XLA's top-k instead of the full-row kernel;
  ``rescore_sort_select_xla``: both (the two-stage selector before the kernels).
  These take the selectors' defaults (the first stage per page, in pieces of 64 candidates),
  but the ``*topk*`` and ``rescore_sort_select_xla`` variants rank the whole row
  (``candidate_pieces=1``): their methods are the row's top-k.
* ``rescore8_block1`` / ``rescore8_block2`` / ``rescore8_block4`` / ``rescore8_block8``:
  ``quest_rescore8`` with the first stage per page / per block of 2 / 4 / 8 pages
  (``CacheConfig.candidate_block``);
  ``rescore8_select_w4``: the final choice's kernel with 4 warps per program instead of the
  default's 8 at ``CacheConfig()``'s 512 candidates (``Tuning.rescore_select_warps``);
  ``rescore8_sel1024`` / ``rescore8_block2_sel1024``: that kernel up to 1024 candidates
  (``Tuning.rescore_select_kernel_max``; 1024 tokens in 8-token pages have 1024), per page /
  with the first stage by blocks of two pages.
* ``rescore8_c512``: ``quest_rescore8`` with 512 first-stage candidates whatever the budget
  (``CacheConfig(candidate_pages=512)``; at 1024 tokens in 16-token pages the default's own).
* ``quest_int8b``: Quest with its page bounds in int8 with a power-of-two scale per page and
  KV head (``CacheConfig.bounds_dtype="int8"``; half the bytes the scores kernel reads);
  ``rescore8_floatb``: ``quest_rescore8`` with its first stage's bounds in the KV dtype
  (``bounds_dtype="float"``; int8 is the two-stage selectors' default).
* ``rescore8_pieces1`` / ``rescore8_pieces4`` / ``rescore8_pieces8`` / ``rescore8_pieces16``:
  ``quest_rescore8`` with the first stage's top-k over the whole row / per strided piece of a
  row, 4 / 8 / 16 pieces (``CacheConfig.candidate_pieces``; the default's ``None`` gives 8 at
  512 candidates).
* ``materialize_qk``: Quest with each layer's query and new K/V row behind an
  ``optimization_barrier`` (``Tuning.materialize_qk=True``); ``rescore8_no_mqk`` /
  ``rescore8_block4_no_mqk``: the two-stage selector per page / in blocks of four without it
  (the default, ``None``, sets it for the two-stage selectors).
* ``dense4``: Quest with layers 3, 5 and the last two dense
  (``CacheConfig(dense_layers=(3, 5, -2, -1))``).

``--budget-tokens`` sets the selected tokens per KV head (default 2048) and
``--candidate-pages`` the two-stage variants' first stage (``CacheConfig.candidate_pages``).

``--shape`` picks the model shape: ``qwen1.5b`` (default; 64-token pages, ``--batch`` requests,
default 8) or ``8b`` (Llama-3-8B-like, 16-token pages, ``--batch`` 1). Each variant holds its
own KV cache: at 128k, four Qwen-like B=8 variants or five 8B-like B=1 ones fit the H200.
``--share-kv`` (resident config "b") gives every variant the same device KV array (filled once
with the same synthetic data; each round's state hands it to the next variant), so only the
selectors' data are per variant: Qwen-like B=8 with Quest, ``rescore8`` and
``rescore8_block4`` then needs 46 GiB instead of 103 and fits an H100. The variants write
their new tokens into the shared rows, which changes no step's work.
``--context`` sets the tokens per request (default 128k; ``1M`` with Qwen-like B=1).

Variants whose options the compiler rejects, or whose round fails to compile or run, are
reported and dropped.

Writes ``ab_step.json`` (with ``--tag``: ``ab_step_<tag>.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # noqa: E402
import decode_lib as bd  # noqa: E402
import synthetic  # noqa: E402
from jaxkv import CacheConfig, Tuning, engine, selectors, validation  # noqa: E402
from jaxkv.kernels import _common, quest  # noqa: E402

_EXH = ("xla_gpu_exhaustive_tiling_search", True)
_CONC = ("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT")
_CMD_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
# name -> (Tuning fields, XLA compiler options added to Tuning's default ones)
VARIANTS = {
    "default": ({}, ()),
    "exhaustive": ({}, (_EXH,)),
    "autotune0": ({}, (("xla_gpu_autotune_level", 0),)),
    # programmatic dependent launch (Hopper): a kernel may start while its predecessor drains
    "pdl_off": ({}, (("xla_gpu_enable_pdl", False),)),
    "pdl_on": ({}, (("xla_gpu_enable_pdl", True),)),
    "pdl_launch": ({}, (("xla_gpu_enable_pdl", True), ("xla_gpu_enable_pdl_launch", True))),
    # how the CUDA graph of the round orders its kernels
    "graph_serial": ({}, (("xla_gpu_command_buffer_scheduling_mode", "SERIALIZE"),)),
    "graph_xla": ({"compiler_options": ()}, ()),
    "graph_concurrent": ({}, (_CONC,)),
    # the decode loop itself inside the CUDA graph (conditional nodes): no host round trip
    # for the loop predicate between steps (graph_list: the same command types without them)
    "graph_list": ({}, (("xla_gpu_enable_command_buffer", _CMD_TYPES),)),
    "graph_while": ({}, (("xla_gpu_enable_command_buffer", _CMD_TYPES + ",WHILE,CONDITIONAL"),)),
    # XLA fusion passes: fewer glue kernels per layer?
    "conc_multi_output": ({}, (("xla_gpu_unsupported_enable_triton_multi_output_fusion",
                                True),)),
    "conc_heroless": ({}, (("xla_gpu_experimental_enable_triton_heroless_priority_fusion",
                            True),)),
    "conc_block_level": ({}, (("xla_gpu_experimental_enable_fusion_block_level_rewriter",
                               True),)),
    "conc_all_triton": ({}, (("xla_gpu_experimental_all_fusions_with_triton", True),)),
    # pages chosen with the previous token's queries (CacheConfig.selection_lag, CACHE_CHANGES)
    "lagged": ({}, ()),
    # the LRU ensure's form and thresholds (host tier)
    "ensure_pallas256": ({"ensure_pallas_max": 256}, ()),
    "lagged_ensure_pallas256": ({"ensure_pallas_max": 256}, ()),
    "ensure_dense4m": ({"ensure_dense_max_elems": 2 ** 22}, ()),
    "lagged_ensure_dense4m": ({"ensure_dense_max_elems": 2 ** 22}, ()),
    "ensure_sort": ({"ensure_method": "sort"}, ()),
    # Quest's top-k over whole score rows instead of chunk maxima
    "topk_full_row": ({"topk_cmax_min_pages": None}, ()),
    # other selectors (CACHE_CHANGES): dense attention, the two-stage rescoring selectors
    "dense": ({}, ()),
    "rescore": ({}, ()),
    "rescore8": ({}, ()),
    "lagged_rescore8": ({}, ()),
    # the second stage's implementation (Tuning.rescore_method) under quest_rescore8
    "rescore8_xla": ({"rescore_method": "xla"}, ()),
    "rescore8_pallas": ({"rescore_method": "pallas"}, ()),
    # ... and its first stage's top-k (Tuning.topk_method)
    "rescore8_topk_chunked": ({"rescore_method": "pallas", "topk_method": "chunked"}, ()),
    "rescore8_topk_cmax": ({"rescore_method": "pallas", "topk_method": "pallas_cmax"}, ()),
    "rescore8_topk_radix": ({"topk_method": "radix"}, ()),
    "rescore8_topk_sort": ({"topk_method": "sort"}, ()),
    "rescore8_topk_pallas": ({"topk_method": "pallas"}, ()),
    # ... and the final choice in XLA (the masses, top-k, sort) instead of one kernel
    # (Tuning.rescore_select_method)
    "rescore_select_xla": ({"rescore_select_method": "xla"}, ()),
    "rescore_topk_sort": ({"topk_method": "sort"}, ()),
    "rescore_sort_select_xla": ({"topk_method": "sort", "rescore_select_method": "xla"}, ()),
    "rescore8_select_xla": ({"rescore_select_method": "xla"}, ()),
    # the first stage's bounds per block of 2 / 4 / 8 pages (CacheConfig.candidate_block)
    "rescore8_block1": ({}, ()),
    "rescore8_block2": ({}, ()),
    "rescore8_block4": ({}, ()),
    "rescore8_block8": ({}, ()),
    # 512 first-stage candidates whatever the budget
    "rescore8_c512": ({}, ()),
    # Quest's bounds in int8 / the two-stage selector's in float (CacheConfig.bounds_dtype)
    "quest_int8b": ({}, ()),
    "rescore8_floatb": ({}, ()),
    # the first stage's top-k per strided piece of a row (CacheConfig.candidate_pieces)
    "rescore8_pieces1": ({}, ()),
    "rescore8_pieces4": ({}, ()),
    "rescore8_pieces8": ({}, ()),
    "rescore8_pieces16": ({}, ()),
    # the final choice's kernel with 4 warps per program (the default from 512 candidates: 8;
    # Tuning.rescore_select_warps)
    "rescore8_select_w4": ({"rescore_select_warps": 4}, ()),
    # ... the kernel up to 1024 candidates (8-token pages at 1024 tokens have 1024), per page
    # and with the first stage by blocks of two pages
    "rescore8_sel1024": ({"rescore_select_kernel_max": 1024}, ()),
    "rescore8_block2_sel1024": ({"rescore_select_kernel_max": 1024}, ()),
    # the query and the new K/V row behind a barrier per layer (Tuning.materialize_qk; None,
    # the default, sets it for the two-stage selectors): Quest with it, the two-stage without
    "materialize_qk": ({"materialize_qk": True}, ()),
    "rescore8_no_mqk": ({"materialize_qk": False}, ()),
    "rescore8_block4_no_mqk": ({"materialize_qk": False}, ()),
    # four layers dense (CacheConfig.dense_layers as a set: the layers that leave out the most
    # attention at a budget on Qwen2.5, benchmarks/probes/layer_budget.py)
    "dense4": ({}, ()),
}
DENSE4 = (3, 5, -2, -1)
# name -> CacheConfig fields a variant changes (the others keep the engine's defaults)
CACHE_CHANGES = {n: {"selection_lag": 1} for n in VARIANTS if n.startswith("lagged")}
CACHE_CHANGES.update(dense={"selector": "dense", "selection_lag": 0},
                     rescore={"selector": "quest_rescore"},
                     rescore8={"selector": "quest_rescore8"},
                     lagged_rescore8={"selector": "quest_rescore8", "selection_lag": 1},
                     rescore8_xla={"selector": "quest_rescore8"},
                     rescore8_pallas={"selector": "quest_rescore8"},
                     rescore8_topk_chunked={"selector": "quest_rescore8", "candidate_pieces": 1},
                     rescore8_topk_cmax={"selector": "quest_rescore8", "candidate_pieces": 1},
                     rescore8_topk_radix={"selector": "quest_rescore8", "candidate_pieces": 1},
                     rescore8_topk_sort={"selector": "quest_rescore8", "candidate_pieces": 1},
                     rescore8_topk_pallas={"selector": "quest_rescore8", "candidate_pieces": 1},
                     rescore_select_xla={"selector": "quest_rescore"},
                     rescore_topk_sort={"selector": "quest_rescore", "candidate_pieces": 1},
                     rescore_sort_select_xla={"selector": "quest_rescore", "candidate_pieces": 1},
                     rescore8_select_xla={"selector": "quest_rescore8"},
                     rescore8_block1={"selector": "quest_rescore8", "candidate_block": 1},
                     rescore8_block2={"selector": "quest_rescore8", "candidate_block": 2},
                     rescore8_block4={"selector": "quest_rescore8", "candidate_block": 4},
                     rescore8_block8={"selector": "quest_rescore8", "candidate_block": 8},
                     rescore8_c512={"selector": "quest_rescore8", "candidate_pages": 512},
                     quest_int8b={"bounds_dtype": "int8"},
                     rescore8_floatb={"selector": "quest_rescore8", "bounds_dtype": "float"},
                     **{f"rescore8_pieces{n}": {"selector": "quest_rescore8",
                                                "candidate_pieces": n} for n in (1, 4, 8, 16)},
                     rescore8_select_w4={"selector": "quest_rescore8"},
                     rescore8_sel1024={"selector": "quest_rescore8"},
                     rescore8_block2_sel1024={"selector": "quest_rescore8", "candidate_block": 2},
                     rescore8_no_mqk={"selector": "quest_rescore8"},
                     rescore8_block4_no_mqk={"selector": "quest_rescore8", "candidate_block": 4},
                     dense4={"dense_layers": DENSE4})


def variant_tuning(name: str, base: Tuning = Tuning()) -> Tuning:
    """The ``Tuning`` of variant ``name``: its fields over ``base``, its XLA options added to
    ``base``'s (an option of the same name replaces the base's)."""
    fields, options = VARIANTS[name]
    tuning = dataclasses.replace(base, **fields)
    opts = dict(tuning.compiler_options)
    opts.update(options)
    return dataclasses.replace(tuning, compiler_options=tuple(opts.items()))


def _accepted(names):
    """The variants whose compiler options this XLA accepts (a tiny program compiled with
    them); the others are reported and dropped."""
    ok = []
    for n in names:
        try:
            jax.jit(lambda x: x + 1).lower(1.0).compile(
                dict(variant_tuning(n).compiler_options) or None)
            ok.append(n)
        except Exception as e:  # noqa: BLE001 - any rejection drops the variant
            print(f"  {n}: compiler options rejected ({type(e).__name__}: {str(e)[:200]})")
    return ok


def _traced_calls(op, fn):
    """Run ``fn()`` counting the calls of the registered op ``op`` while it traces."""
    reg = _common._REGISTRY[op]
    calls, orig = [], dict(reg)
    for key, f in orig.items():
        reg[key] = (lambda *x, f=f, **kw: calls.append(1) or f(*x, **kw))
    try:
        out = fn()
    finally:
        reg.update(orig)
    return out, len(calls)


def _setup(a):
    """(shape, batch, context, Settings, ModelConfig, base Tuning) of the command line."""
    if a.quick:  # tiny model; the chunk-maxima top-k (and so the fused kernel) at any size
        st = bd.Settings(**bd.QUICK)
        return "tiny", 2, 256, st, bd.configs.tiny(), Tuning(topk_cmax_min_pages=1)
    shape, ctx = a.shape, bd.parse_tokens(a.context)
    B = a.batch or (8 if shape == "qwen1.5b" else 1)
    st = bd.Settings(page_size=a.page_size or (64 if shape == "qwen1.5b" else 16))
    if a.budget_tokens:
        st = dataclasses.replace(st, selected_tokens=a.budget_tokens)
    return shape, B, ctx, st, bd.model_config(shape), Tuning()


def _plans(a, names, B, ctx, st, cfg, base_tuning, impl):
    """Each variant's plan: its CacheConfig fields and Tuning over the engine's defaults."""
    ps, k = st.page_size, st.k
    max_ctx = -(-(ctx + st.round_steps * (2 * a.pairs + 4)) // ps) * ps
    cache = CacheConfig(mode="resident", selector="quest", page_size=ps, selected_pages=k,
                        round_steps=st.round_steps, max_context=max_ctx, implementation=impl)
    if a.config == "c2":
        one_x = engine.Plan(model=cfg, cache=dataclasses.replace(cache, mode="host"), batch=B,
                            prompt_len=max_ctx, max_context=max_ctx, num_stop=4).pool_pages
        cache = dataclasses.replace(cache, mode="host",
                                    pool_pages=min(B * (max_ctx // ps), 2 * one_x))
    plans = {}
    for name in names:
        cc = dataclasses.replace(cache, tuning=variant_tuning(name, base_tuning),
                                 **CACHE_CHANGES.get(name, {}))
        if a.candidate_pages and selectors.get(cc.selector).two_stage:
            cc = dataclasses.replace(cc, candidate_pages=a.candidate_pages)
        plans[name] = engine.Plan(model=cfg, batch=B, prompt_len=max_ctx, cache=cc,
                                  max_context=max_ctx, num_stop=4)
    return plans


def _device_need(plans, lengths, params, share_kv: bool) -> int:
    """Device bytes of the weights and the variants' states; with ``share_kv`` the KV cache
    counts once."""
    states = [engine.abstract_state(p, lengths) for p in plans.values()]
    need = validation.nbytes_by_space(params)["device"] + sum(
        validation.nbytes_by_space(s)["device"] for s in states)
    if share_kv:
        need -= (len(states) - 1) * validation.nbytes_by_space(states[0].kv.pool)["device"]
    return need


def _check_fits(plans, lengths, params, share_kv: bool, share: float = 0.9):
    """Stop before allocating when the variants' states (each holds its own cache unless
    ``share_kv``) and the weights need more than ``share`` of the device's memory (the rest:
    the programs' own buffers), naming the fix."""
    need = _device_need(plans, lengths, params, share_kv)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    print(f"  device memory: {need / 2**30:.1f} GiB of weights and {len(plans)} variants' "
          f"states" + (" (one shared KV cache)" if share_kv else "")
          + (f" of {limit / 2**30:.1f} GiB" if limit else ""), flush=True)
    if limit and need > share * limit:
        fix = "pass fewer --variants" + ("" if share_kv else " or --share-kv (config b)")
        raise SystemExit(f"the weights and {len(plans)} variants' states need "
                         f"{need / 2**30:.1f} GiB of the device's {limit / 2**30:.1f} GiB: "
                         f"{fix}")


class _SharedKV:
    """The one device KV array of ``--share-kv``: bound into a variant's state before its
    round, taken back from the state the round returns (the round donates it)."""

    def __init__(self, enabled: bool):
        self.enabled, self.pool = enabled, None

    def bind(self, state):
        if not self.enabled or self.pool is None:
            return state
        return dataclasses.replace(state, kv=dataclasses.replace(state.kv, pool=self.pool))

    def take(self, state):
        if self.enabled:
            self.pool = state.kv.pool
        return state


def lower_only(a, names):
    """``--lower-only``: each variant's decode round lowered for an abstract H200 on this
    machine (:mod:`jaxkv.lowering`; shapes only, nothing allocated or compiled), to find the
    variants that fail the Pallas -> Triton lowering before a GPU session spends time on
    them. Prints one line per variant (the Pallas kernels a round calls, counted along the
    call graph, and what its state and the weights would take);
    exits 1 if any failed."""
    from jaxkv import lowering
    failed = []
    for name in names:
        t0 = time.perf_counter()
        try:
            with lowering.gpu_target():
                shape, B, ctx, st, cfg, base_tuning = _setup(a)
                plan = _plans(a, [name], B, ctx, st, cfg, base_tuning, None)[name]
                params = jax.eval_shape(lambda: bd.llama.init_params(cfg, st.seed))
                state = engine.abstract_state(plan, [ctx] * B)
                text = lowering.lower_round(plan, params, state)
            mem = validation.nbytes_by_space(state)
            print(f"  {name:24s} lowered: {lowering.count_calls(text)} Triton calls per round "
                  f"({time.perf_counter() - t0:.1f} s); state {mem['device'] / 2**30:.1f} GiB "
                  f"device, {mem['host'] / 2**30:.1f} GiB host; weights "
                  f"{validation.nbytes_by_space(params)['device'] / 2**30:.1f} GiB", flush=True)
        except Exception as e:  # noqa: BLE001 - every variant is reported
            failed.append(name)
            print(f"  {name:24s} FAILED ({type(e).__name__}: {str(e)[:300]})", flush=True)
    if failed:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="default,topk_full_row",
                    type=_meta.names_of(VARIANTS, "variants"), help=f"comma-separated, the first is the baseline; of {sorted(VARIANTS)}")
    ap.add_argument("--config", default="b", choices=("b", "c2"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=None,
                    help="requests (default 8 for qwen1.5b, 1 for 8b)")
    ap.add_argument("--shape", default="qwen1.5b", choices=("qwen1.5b", "8b"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens per page (default: 64 for qwen1.5b, 16 for 8b; CacheConfig()'s "
                         "is 16)")
    ap.add_argument("--context", default="128k",
                    help="tokens per request, e.g. 128k or 1M")
    ap.add_argument("--budget-tokens", type=int, default=None,
                    help="selected tokens per KV head (default: decode_lib.Settings', 2048)")
    ap.add_argument("--candidate-pages", type=int, default=None,
                    help="CacheConfig.candidate_pages of the two-stage variants (default: "
                         "their multiple of the budget)")
    ap.add_argument("--lower-only", action="store_true",
                    help="lower each variant's round for an abstract H200 here and exit "
                         "(no GPU needed; catches Triton lowering failures before a GPU run)")
    ap.add_argument("--share-kv", action="store_true",
                    help="config b: one device KV cache for every variant (only the "
                         "selectors' data per variant), so more variants fit the device")
    ap.add_argument("--trace", default="",
                    help="after the turns, profile one more round per variant into this "
                         "directory: device time per kernel in the JSON (``kernels``)")
    a = ap.parse_args()
    if a.pairs < 1:
        ap.error(f"--pairs must be >= 1, got {a.pairs}")
    names = a.variants
    if len(names) < 2 or len(set(names)) != len(names):
        ap.error(f"--variants needs two or more distinct names of {sorted(VARIANTS)}, got {names}")
    if a.share_kv and a.config != "b":
        ap.error("--share-kv shares the resident cache: config b only")
    if a.lower_only:
        return lower_only(a, names)
    gpu = jax.default_backend() == "gpu"
    names = _accepted(names)
    if len(names) < 2:
        raise SystemExit("fewer than two variants left")
    shape, B, ctx, st, cfg, base_tuning = _setup(a)
    ps, k = st.page_size, st.k
    params = bd.llama.init_params(cfg, st.seed) if a.quick else bd.get_params(shape, st.seed)
    # one fill for every variant, calibrated to the first variant's selector's real-text
    # overlap (its own simulation, as bench_decode.py does; Quest's file where that selector
    # has none): with --config c2 the other selectors' pool hits follow from that fill
    sel0 = CACHE_CHANGES.get(names[0], {}).get("selector", "quest")
    real = (bd.load_overlap(bd.RESULTS / bd.overlap_file(sel0))
            or bd.load_overlap(bd.RESULTS / bd.OVERLAP_FILE))
    target = float(real["mean"]) if real else bd.DEFAULT_OVERLAP
    sal, sim = synthetic.calibrate_salience(target, model=cfg, page_size=ps, num_pages=ctx // ps,
                                            k=k, selector=sel0, sink_pages=1, steps=16,
                                            seed=st.seed)
    synth = synthetic.Synthetic(salience=float(sal))
    lengths = [ctx] * B
    st = dataclasses.replace(st, hbm_gbps=bd.hbm_gbps(st.hbm_bytes, st.reps),
                             pcie_gbps=bd.bulk_h2d_gbps(st.bulk_bytes, st.reps))
    impl = None if gpu else "pallas"  # the Pallas kernels (interpret mode off the GPU)
    plans = _plans(a, names, B, ctx, st, cfg, base_tuning, impl)
    if a.share_kv:
        layouts = {n: jax.tree.map(lambda x: (x.shape, x.dtype),
                                   jax.eval_shape(lambda p=p: engine.init_kv(p)))
                   for n, p in plans.items()}
        other = [n for n in names if layouts[n] != layouts[names[0]]]
        if other:
            ap.error(f"--share-kv: {other} store their KV cache unlike {names[0]} (kv_dtype or "
                     "page layout): run them without --share-kv")
    _check_fits(plans, lengths, params, a.share_kv)
    states, runs, traced = {}, {}, {}
    shared = _SharedKV(a.share_kv)
    for name in names:
        kv = shared.bind(states[names[0]]).kv if shared.pool is not None else None
        states[name] = shared.take(synthetic.build_state(
            plans[name], lengths, synth=synth, seed=st.seed, chunk_bytes=st.chunk_bytes, kv=kv))
        runs[name] = []

    def run(name, st_, **kw):
        rec, state = bd.run_decode(name, plans[name], params, shared.bind(states[name]), st_,
                                   **kw)
        states[name] = shared.take(state)
        return rec

    warm = {}
    for name in list(names):  # warm-up: trace and compile
        try:
            rec, traced[name] = _traced_calls(quest.OP_UPDATE_CMAX,
                                              lambda: run(name, st, rounds=1))
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is dropped
            print(f"  {name}: dropped, its round failed ({type(e).__name__}: {str(e)[:300]})")
            if shared.pool is not None and shared.pool.is_deleted():
                raise SystemExit(f"{name}'s round failed after taking the shared KV cache "
                                 "(--share-kv), so the other variants have none: run "
                                 f"without {name} or without --share-kv") from e
            names.remove(name)
            del states[name]
            continue
        warm[name] = dict(compile_s=rec["compile_s"], warmup_round_s=rec["warmup_round_s"])
        print(f"  {name:16s} warm-up {rec['warmup_round_s']:.1f} s "
              f"(compile {rec['compile_s']:.1f} s)", flush=True)
    if len(names) < 2:
        raise SystemExit("fewer than two variants compiled")
    compiles = {n: 0 for n in names}
    floors = {n: None for n in names}
    for i in range(a.pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            rec = run(name, st, rounds=2, warmup=False)
            runs[name].append(rec["step_ms"])
            floors[name] = rec.get("floor_ms")
            compiles[name] += rec["num_compilations"]
            print(f"  {name:16s} {rec['step_ms']:.3f} ms/step ({rec['num_compilations']} compiles)",
                  flush=True)
    kernels = {}
    if a.trace:
        st_trace = dataclasses.replace(st, trace=a.trace)
        for name in names:
            kernels[name] = run(name, st_trace, rounds=1, warmup=False).get("kernels")
    base = names[0]
    ratios = {n: [x / b for x, b in zip(runs[n], runs[base])] for n in names[1:]}
    summary = {n: dict(median_step_ms=statistics.median(runs[n]), step_ms=runs[n],
                       floor_ms=floors[n],
                       fraction_of_roofline=(floors[n] / statistics.median(runs[n])
                                             if floors[n] else None),
                       **({} if n == base else dict(
                           ratios_over_base=ratios[n], median_ratio=statistics.median(ratios[n]),
                           min_ratio=min(ratios[n]), max_ratio=max(ratios[n]))))
               for n in names}
    out = dict(benchmark="ab_step", device=bd._device_str(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, quick=a.quick,
               shape=shape, batch=B, context=ctx, page_size=ps, selected_pages=k,
               hbm_gbps=st.hbm_gbps, pcie_gbps=st.pcie_gbps,
               config=a.config, pool_pages=plans[base].pool_pages if a.config == "c2" else None,
               share_kv=a.share_kv,
               salience=float(sal), simulated_overlap=float(sim), pairs=a.pairs,
               candidate_pages={n: plans[n].selector.candidate_count(plans[n])
                                for n in names if plans[n].selector.two_stage},
               variants={n: dict(tuning={k_: str(v) for k_, v in VARIANTS[n][0].items()},
                                 cache_changes=CACHE_CHANGES.get(n, {}),
                                 compiler_options={k_: str(v) for k_, v in
                                                   plans[n].tuning.compiler_options})
                         for n in names},
               baseline=base, results=summary, warmup=warm, compiles_after_warmup=compiles,
               fused_kernel_traced=traced, kernels=kernels,
               note="ratio = variant step / baseline step per turn (turns alternate the order); "
                    "fused_kernel_traced = calls of the fused Quest op while tracing each round")
    os.makedirs(a.out, exist_ok=True)
    fname = f"ab_step_{a.tag}.json" if a.tag else "ab_step.json"
    Path(a.out, fname).write_text(json.dumps(out, indent=1))
    print(f"\nA/B decode step ({shape} B={B} ctx={ctx}, config {a.config}, {a.pairs} turns), "
          f"ms per step and ratio to {base}:")
    for n in names:
        r = summary[n]
        extra = "" if n == base else (f"  ratio {r['median_ratio']:.3f} "
                                      f"({r['min_ratio']:.3f}-{r['max_ratio']:.3f})")
        roof = (f"  roofline {100 * r['fraction_of_roofline']:.0f}% of {r['floor_ms']:.3f} ms"
                if r["fraction_of_roofline"] else "")
        print(f"  {n:16s} {r['median_step_ms']:.3f}{extra}{roof}  compile {warm[n]['compile_s']:.1f} s"
              f"  fused op traced {traced[n]}  compiles after warm-up {compiles[n]}")


if __name__ == "__main__":
    main()
