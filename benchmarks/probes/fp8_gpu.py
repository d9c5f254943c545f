"""fp8 vs bf16 KV on one H200 (issue 31): decode tokens/s, host->device bytes per step and hit
rate, host tier and resident, plus a token check (fp8 host tier == fp8 resident).

    PYTHONPATH=. python3 benchmarks/probes/fp8_gpu.py --out DIR
    CPU smoke test (tiny shapes, a minute):  PYTHONPATH=. python3 benchmarks/probes/fp8_gpu.py --quick --out /tmp/fp8

Points, in this order (later ones are skipped once --budget seconds are spent):

1. tokens: ``jaxkv.generate`` on a 4-layer Qwen-like model (Qwen2.5-1.5B heads, random
   weights), two prompts, Quest: fp8 host tier vs fp8 resident must agree token for token;
   the share of tokens equal to the bf16 run is reported (random weights: a rough drift
   figure, not a quality measure; bench_quality.py measures that).
2. 8B-like B=1 at 1M = 1,000,000 tokens, fp8, host tier (2x pool): ~61.5 GiB of pinned host
   memory, under the default 64 GiB cap (2**20 tokens would need 64 GiB of fp8 payload alone,
   over the cap with any headroom). It runs first of the decode points: XLA's pinned-host
   allocator keeps its regions, so the largest tier must come first.
3. 8B-like B=1 and Qwen-like B=8 at 128k: {fp8, bf16} x {host tier (2x pool), resident}.

``--extra-dtypes int8 int8+rot`` adds those KV dtypes to every point of 3, in the same process
(``+rot`` / ``+norot``: ``kv_key_rotation`` on / off; the library's default without either); ``--dtype-1m int8`` runs point 2 in that dtype instead.

Each decode point: synthetic context (benchmarks/synthetic.py, keys calibrated once per point
to the real-text selection overlap), one warm-up round (compile), --rounds timed rounds of 32
steps (decode_lib.run_decode). Writes DIR/fp8_gpu.json; prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import decode_lib as lib  # noqa: E402
import synthetic  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import CacheConfig, engine  # noqa: E402
from jaxkv.models import configs, llama  # noqa: E402

FP8 = "float8_e4m3fn"
BF16 = "bfloat16"
FULL = [  # (shape, batch, context, kv dtypes, modes)
    ("8b", 1, 1_000_000, (FP8,), ("host",)),
    ("8b", 1, 131072, (FP8, BF16), ("host", "resident")),
    ("qwen1.5b", 8, 131072, (FP8, BF16), ("host", "resident")),
]
QUICK = [("tiny", 1, 96, (FP8, BF16), ("host", "resident")),
         ("tiny", 2, 48, (FP8, BF16), ("host", "resident"))]


def token_check(quick: bool, new: int) -> dict:
    """fp8 host == fp8 resident (and agreement with bf16) through generate()."""
    if quick:
        cfg = configs.tiny()
        lens, ps, k = (37, 21), 4, 4
    else:
        cfg = dataclasses.replace(configs.qwen2_5_1_5b(), num_layers=4)
        lens, ps, k = (3000, 1700), 16, 16
    params = llama.init_params(cfg, seed=0)
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in lens]
    out = dict(model=f"{cfg.name} ({cfg.num_layers} layers, random weights)", prompt_tokens=lens,
               new_tokens=new)
    toks = {}
    for name, mode, dt in (("fp8_host", "host", FP8), ("fp8_resident", "resident", FP8),
                           ("bf16_host", "host", BF16)):
        t0 = time.perf_counter()
        r = jaxkv.generate(cfg, params, prompts, max_new_tokens=new, stop_tokens=[],
                           cache=CacheConfig(mode=mode, selector="quest", page_size=ps,
                                             selected_pages=k, kv_dtype=dt))
        toks[name] = r.tokens
        out[f"{name}_s"] = time.perf_counter() - t0
        if mode == "host":
            out[f"{name}_hit_rate"] = r.stats.get("hit_rate")
    out["fp8_host_equals_resident"] = toks["fp8_host"] == toks["fp8_resident"]
    flat = lambda t: [x for row in t for x in row]  # noqa: E731
    a, b = flat(toks["fp8_host"]), flat(toks["bf16_host"])
    out["fp8_vs_bf16_token_agreement"] = float(np.mean([x == y for x, y in zip(a, b)]))
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
             for p, q in zip(toks["fp8_host"], toks["bf16_host"])]
    out["fp8_vs_bf16_first_difference"] = first
    print(f"tokens: fp8 host == fp8 resident: {out['fp8_host_equals_resident']}; fp8 vs bf16 "
          f"agreement {out['fp8_vs_bf16_token_agreement']:.3f} (first difference at {first})",
          flush=True)
    return out


def plan_for(cfg, B, max_ctx, st: lib.Settings, *, mode, kv_dtype):
    """``kv_dtype``: a dtype name, ``+rot`` / ``+norot`` appended for ``kv_key_rotation=True`` /
    ``False`` (without either the library's default)."""
    dt, _, rot = kv_dtype.partition("+")
    cache = CacheConfig(mode="resident", selector=st.selector, page_size=st.page_size,
                        selected_pages=st.k, round_steps=st.round_steps, max_context=max_ctx,
                        kv_dtype=dt, kv_key_rotation={"rot": True, "norot": False}.get(rot))
    mk = lambda c: engine.Plan(model=cfg, cache=c, batch=B, prompt_len=max_ctx,  # noqa: E731
                               max_context=max_ctx, num_stop=4)
    if mode == "resident":
        return mk(cache)
    one_x = mk(dataclasses.replace(cache, mode="host")).pool_pages  # the engine's default pool
    P = B * (max_ctx // st.page_size)
    return mk(dataclasses.replace(cache, mode="host", pool_pages=min(P, 2 * one_x)))


def short(dt: str) -> str:
    dt, plus, rot = dt.partition("+")
    return {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "float8_e5m2": "e5m2"}.get(dt, dt) + plus + rot


def decode_point(shape, B, ctx, dtypes, modes, st: lib.Settings, target, budget, records):
    cfg = lib.model_config(shape)
    max_ctx = -(-(ctx + st.room) // st.page_size) * st.page_size
    lengths = [ctx] * B
    t0 = time.perf_counter()
    sal, sim = synthetic.calibrate_salience(
        target, model=cfg, page_size=st.page_size, num_pages=ctx // st.page_size, k=st.k,
        selector=st.selector, sink_pages=1, steps=16, seed=st.seed)
    synth = synthetic.Synthetic(salience=float(sal))
    print(f"\n== {shape} B={B} context={ctx}: salience {sal:.4g} (overlap {sim:.3f}, "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)
    params = lib.get_params(shape, st.seed)
    for dt in dtypes:
        for mode in modes:
            what = f"{shape} B={B} {ctx} {dt} {mode}"
            if not budget.ok(what, 25):
                continue
            rec = dict(shape=shape, batch=B, context=ctx, kv_dtype=dt, mode=mode)
            try:
                plan = plan_for(cfg, B, max_ctx, st, mode=mode, kv_dtype=dt)
                spec = plan.spec
                rec.update(host_tier_gib=spec.host_bytes / 2**30 if mode == "host" else 0.0,
                           kv_gib=spec.host_bytes / 2**30, page_bytes=spec.page_bytes,
                           pool_pages_per_layer=spec.num_slots if mode == "host" else None)
                t1 = time.perf_counter()
                state = synthetic.build_state(plan, lengths, synth=synth, seed=st.seed,
                                              chunk_bytes=st.chunk_bytes)
                jax.block_until_ready(state)
                rec["fill_s"] = time.perf_counter() - t1
                name = f"{short(dt)}-{mode[:4]}"
                r, state = lib.run_decode(name, plan, params, state, st, rounds=st.timed_rounds)
                rec.update({k: r[k] for k in ("tokens_per_s", "step_ms", "steps", "hit_rate",
                                              "h2d_bytes_per_step", "h2d_gbps_over_step",
                                              "compile_s", "misses_per_layer_step",
                                              "pages_fetched_per_step", "host_reads_per_step")
                            if k in r})
                del state
            except Exception as e:  # noqa: BLE001 - record it, go on with the next point
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
            records.append(rec)


def table(records) -> str:
    head = f"{'point':28s} {'kv':8s} {'mode':8s} {'tok/s':>9s} {'step ms':>8s} {'hit':>6s} " \
           f"{'MB/step':>8s} {'tier GiB':>8s}"
    lines = [head, "-" * len(head)]
    for r in records:
        pt = f"{r['shape']} B={r['batch']} {r['context']}"
        kv = short(r["kv_dtype"])
        if "error" in r:
            lines.append(f"{pt:28s} {kv:8s} {r['mode']:8s} ERROR {r['error'][:60]}")
            continue
        hit = r.get("hit_rate")
        lines.append(f"{pt:28s} {kv:8s} {r['mode']:8s} {r['tokens_per_s']:9.1f} "
                     f"{r['step_ms']:8.3f} {(hit if hit is not None else float('nan')):6.3f} "
                     f"{r['h2d_bytes_per_step'] / 1e6:8.2f} {r['host_tier_gib']:8.2f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--points", default="all", choices=("all", "tokens", "8b", "qwen", "1m"),
                    help="a subset, to split the run over several calls")
    ap.add_argument("--budget", type=float, default=225.0, help="seconds; later points skipped")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds of 32 steps per point")
    ap.add_argument("--new-tokens", type=int, default=48, help="token check: tokens generated")
    ap.add_argument("--extra-dtypes", nargs="*", default=[],
                    help="KV dtypes measured beside fp8 and bf16 at the 128k points (e.g. int8; "
                         "int8+rot / float8_e4m3fn+norot set kv_key_rotation)")
    ap.add_argument("--dtype-1m", default=FP8, help="the KV dtype of the 1M point")
    ap.add_argument("--overlap", type=float, default=None,
                    help="target selection overlap (default: results/selection_overlap.json)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    budget = lib.Budget(a.budget)
    st = lib.Settings(timed_rounds=a.rounds, probe_steps=0)
    if a.quick:
        st = dataclasses.replace(st, **lib.QUICK)
    real = lib.load_overlap(lib.RESULTS / lib.OVERLAP_FILE)
    target = a.overlap if a.overlap is not None else (
        float(real["mean"]) if real else lib.DEFAULT_OVERLAP)
    res = dict(device=lib._device_str(), commit=lib._commit(), jax_version=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               settings=dict(page_size=st.page_size, selected_pages=st.k, round_steps=st.round_steps,
                             timed_rounds=st.timed_rounds, target_overlap=target,
                             host_pool="2x the engine's default (one step's working set)"),
               records=[])
    path = os.path.join(a.out, "fp8_gpu.json")

    def save():
        res["skipped"] = budget.skipped
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    if a.points in ("all", "tokens"):
        try:
            res["tokens"] = token_check(a.quick, 8 if a.quick else a.new_tokens)
        except Exception as e:  # noqa: BLE001
            res["tokens"] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()
        save()
    points = QUICK if a.quick else FULL
    pick = {"all": points, "tokens": [], "1m": [p for p in points if p[2] >= 10**6],
            "8b": [p for p in points if p[0] == "8b" and p[2] < 10**6],
            "qwen": [p for p in points if p[0] == "qwen1.5b"]}[a.points]
    if a.quick and a.points != "tokens":
        pick = points
    for shape, B, ctx, dts, modes in pick:
        if len(dts) > 1:
            dts = tuple(a.extra_dtypes) + dts
        elif ctx >= 10**6:
            dts = (a.dtype_1m,)
        if not budget.ok(f"{shape} B={B} {ctx}", 40):
            continue
        decode_point(shape, B, ctx, dts, modes, st, target, budget, res["records"])
        save()
    save()
    tok = res.get("tokens", {})
    print(f"\nwrote {path} ({budget.elapsed():.0f} s)")
    if "fp8_host_equals_resident" in tok:
        print(f"tokens fp8 host == fp8 resident: {tok['fp8_host_equals_resident']}; fp8 vs bf16 "
              f"agreement {tok['fp8_vs_bf16_token_agreement']:.3f}")
    print(table(res["records"]))


if __name__ == "__main__":
    main()
