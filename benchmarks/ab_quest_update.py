"""Same-process A/B of the Quest summary update inside the whole decode step.

    PYTHONPATH=. python3 benchmarks/ab_quest_update.py --out DIR [--quick] [--pairs 6]

"separate": ``quest_update``'s XLA scatters, then the scores + chunk-maxima kernel;
"fused": the update inside that kernel (``quest_update_select``, ``quest.FUSE_UPDATE``).
Both run resident sparse decoding (config b of bench_decode) at the Qwen-like B=8 128k shape,
each from its own state, measured alternately (ABBA, ``--pairs`` times, two rounds each) after
a warm-up round: the figure is the median per-pair step-time ratio. ``quest.FUSE_UPDATE`` is
read when a round is traced, so each variant gets its own plan (they differ only in the
length of the unused stop-token list) and compiles once.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # noqa: E402
import bench_decode as bd  # noqa: E402
from jaxkv import CacheConfig, engine, synthetic  # noqa: E402
from pallas_kernels import _common, quest  # noqa: E402
from pallas_kernels import dense_select as ds  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--pairs", type=int, default=6)
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    if a.quick:  # tiny model; the chunk-maxima top-k (and so the fused kernel) at any size
        shape, B, ctx, st = "tiny", 2, 256, bd.Settings(**bd.QUICK)
        cfg = bd.configs.tiny()
        ds.PALLAS_CMAX_MIN_COLUMNS = 1
    else:
        shape, B, ctx, st = "qwen1.5b", 8, 131072, bd.Settings(page_size=64)
        cfg = bd.model_config(shape)
    ps, k = st.page_size, st.k
    max_ctx = -(-(ctx + st.round_steps * (2 * a.pairs + 4)) // ps) * ps
    params = bd.llama.init_params(cfg, st.seed) if a.quick else bd.get_params(shape, st.seed)
    real = bd.load_overlap(bd.RESULTS / bd.OVERLAP_FILE)
    target = float(real["mean"]) if real else bd.DEFAULT_OVERLAP
    sal, sim = synthetic.calibrate_salience(target, model=cfg, page_size=ps, num_pages=ctx // ps,
                                            k=k, selector="quest", sink_pages=1, steps=16,
                                            seed=st.seed)
    synth = synthetic.Synthetic(salience=float(sal))
    lengths = [ctx] * B
    # The same kernels for both (Pallas; interpret mode off the GPU). The plans differ only
    # in the length of the (unused) stop-token list, so each variant has its own compiled round.
    impl = None if gpu else "pallas"
    impls = {"fused": 4, "separate": 5}
    plans, states, runs, traced = {}, {}, {}, {}
    for name, num_stop in impls.items():
        cache = CacheConfig(mode="resident", selector="quest", page_size=ps, selected_pages=k,
                            round_steps=st.round_steps, max_context=max_ctx, implementation=impl)
        plans[name] = engine.Plan(model=cfg, cache=cache, batch=B, prompt_len=max_ctx,
                                  max_context=max_ctx, num_stop=num_stop)
        states[name] = bd.build_state(None, plans[name], lengths, synth=synth, seed=st.seed,
                                      chunk_bytes=st.chunk_bytes)
        runs[name] = []
    reg = _common._REGISTRY[quest.OP_UPDATE_CMAX]
    for name in impls:  # warm-up: trace (with this variant's FUSE_UPDATE) and compile
        quest.FUSE_UPDATE = name == "fused"
        calls = []
        orig = dict(reg)
        for key, fn in orig.items():
            reg[key] = (lambda *x, fn=fn, **kw: calls.append(1) or fn(*x, **kw))
        try:
            rec, states[name] = bd.run_decode(name, plans[name], params, states[name], st, rounds=1)
        finally:
            reg.update(orig)
        traced[name] = len(calls)
    quest.FUSE_UPDATE = True
    for i in range(a.pairs):
        for name in (("fused", "separate") if i % 2 == 0 else ("separate", "fused")):
            rec, states[name] = bd.run_decode(name, plans[name], params, states[name], st,
                                              rounds=2, warmup=False)
            runs[name].append(rec["step_ms"])
            print(f"  {name:9s} {rec['step_ms']:.3f} ms/step ({rec['num_compilations']} compiles)",
                  flush=True)
    ratios = [s / f for f, s in zip(runs["fused"], runs["separate"])]
    out = dict(benchmark="ab_quest_update", device=bd._device_str(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, quick=a.quick,
               shape=shape, batch=B, context=ctx, page_size=ps, selected_pages=k,
               salience=float(sal), simulated_overlap=float(sim), pairs=a.pairs,
               fused_step_ms=runs["fused"], separate_step_ms=runs["separate"],
               ratios_separate_over_fused=ratios, median_ratio=statistics.median(ratios),
               fused_median_ms=statistics.median(runs["fused"]),
               separate_median_ms=statistics.median(runs["separate"]),
               fused_kernel_traced=traced,
               note="config b (resident sparse); ratio = separate step / fused step per pair, "
                    "ABBA; fused_kernel_traced = calls of the fused op while tracing each round")
    os.makedirs(a.out, exist_ok=True)
    Path(a.out, "ab_quest_update.json").write_text(json.dumps(out, indent=1))
    print(f"\nA/B Quest update ({shape} B={B} ctx={ctx}, {a.pairs} pairs): fused "
          f"{out['fused_median_ms']:.3f} ms, separate {out['separate_median_ms']:.3f} ms per step;"
          f" separate/fused median {out['median_ratio']:.3f} (min {min(ratios):.3f}, max "
          f"{max(ratios):.3f}); fused op traced {traced}")


if __name__ == "__main__":
    main()
