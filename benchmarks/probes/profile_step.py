"""Decode step time of jaxkv's compiled round for a few cache configurations (one shape).

PYTHONPATH=. python3 benchmarks/probes/profile_step.py --model llama3-8b --layers 32 --context 32768
Builds the cache by a real prefill of random tokens, then times ``engine.decode_round``
(warm-up round first, so compile time is excluded) and prints ms per step and tokens/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ (trace_summary)

from jaxkv import CacheConfig, Sampling, compile_stats, engine
from jaxkv.api import make_plan
from jaxkv.models import configs, llama


def build_state(plan, params, prompts, seed=0):
    B, T = plan.batch, plan.prompt_len
    toks = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    kv, summ = engine.init_kv(plan), engine.init_summaries(plan)
    x = engine.embed_prompt(plan, params, jnp.asarray(toks))
    for layer in range(plan.model.num_layers):
        x, kv, summ, _ = engine.prefill_layer(plan, params["layers"][layer], jnp.int32(layer), x, lengths, kv, summ)
    key = jax.random.key(seed)
    first = engine.first_token(plan, params, x, lengths, Sampling.make(), key)
    return engine.start_state(plan, kv, summ, lengths, first, key)


def time_config(cfg, params, prompts, cache, steps, rounds, dump=None, trace=None):
    plan = make_plan(cfg, dataclasses.replace(cache, round_steps=steps), [len(p) for p in prompts],
                     steps * (rounds + 2), num_stop=4)
    t0 = time.perf_counter()
    c0 = compile_stats.snapshot()
    state = build_state(plan, params, prompts)
    jax.block_until_ready(state.last_token)
    t_prefill = time.perf_counter() - t0
    stop = jnp.full((4,), -1, jnp.int32)
    max_new = jnp.int32(10**6)
    if dump:
        hlo = engine.lower_decode_round(plan, params, state, Sampling.make(), stop,
                                        max_new).compile().as_text()
        with open(dump, "w") as f:
            f.write(hlo)
        import re
        kinds = {}
        for line in hlo.splitlines():
            m = re.search(r"= \S+ (fusion|custom-call|while|conditional|copy|sort|scatter|gather)\(", line)
            if m:
                kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
        print("HLO op counts (all computations):", kinds, flush=True)
    state, buf, n = engine.decode_round(plan, params, state, Sampling.make(), stop, max_new)
    jax.block_until_ready(buf)
    comp = compile_stats.since(c0)
    c_before = state.kv.counters.as_dict(plan.spec)
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        state, buf, n = engine.decode_round(plan, params, state, Sampling.make(), stop, max_new)
        jax.block_until_ready(buf)
        ts.append((time.perf_counter() - t) / int(n))
    c_after = state.kv.counters.as_dict(plan.spec)
    step = float(np.median(ts))
    kernels = None
    if trace:
        import trace_summary
        with jax.profiler.trace(trace, create_perfetto_trace=True):
            state, buf, n = engine.decode_round(plan, params, state, Sampling.make(), stop, max_new)
            jax.block_until_ready(buf)
        kernels = trace_summary.summarise(trace, steps=int(n), top=30)
        trace_summary.print_summary(kernels)
    hits = c_after["hits"] - c_before["hits"]
    misses = c_after["misses"] - c_before["misses"]
    return dict(mode=cache.mode, selector=cache.selector, unroll=plan.layer_unroll,
                pool_pages=plan.pool_pages, step_ms=step * 1e3,
                tokens_per_s=plan.batch / step, prefill_s=t_prefill,
                compile_s=comp["time_s"], compiles=comp["count"],
                hit_rate=hits / max(1, hits + misses),
                dropped=c_after["dropped"] - c_before["dropped"], kernels=kernels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048, help="selected tokens per KV head")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="resident-dense,resident-quest,host-quest-2x")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump-hlo", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--trace", action="store_true", help="profile one round, print the kernel table")
    a = ap.parse_args()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    over = {"max_position": max(a.context * 2, 8192)}
    if a.layers:
        over["num_layers"] = a.layers
    cfg = configs.get_config(a.model, **over)
    params = llama.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, a.context - 8 * i)) for i in range(a.batch)]
    k = a.budget // a.page_size
    sel = cfg.num_kv_heads * k + 2
    rows = []
    for name in a.configs.split(","):
        parts = name.split("-")
        mode, selector = parts[0], parts[1]
        cache = CacheConfig(mode=mode, selector=selector, page_size=a.page_size, selected_pages=k,
                            prefill_chunk=1024)
        for f in parts[2:]:
            if f.endswith("x"):
                cache = dataclasses.replace(cache, pool_pages=int(float(f[:-1]) * sel * a.batch))
            elif f == "loop":
                cache = dataclasses.replace(cache, unroll_layers=False)
            elif f == "layer":
                cache = dataclasses.replace(cache, schedule="layer")
            elif f == "nocache":
                cache = dataclasses.replace(cache, reuse=False)
        dump = os.path.join(a.out, f"hlo_{name}.txt") if (a.dump_hlo and a.out) else None
        trace = os.path.join(a.out or "/tmp", f"trace_{name}") if a.trace else None
        r = time_config(cfg, params, prompts, cache, a.steps, a.rounds, dump, trace)
        r["name"] = name
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{cfg.name} L={cfg.num_layers} context {a.context} batch {a.batch} page {a.page_size} "
          f"budget {a.budget}")
    print(f"{'config':24s} {'ms/step':>8s} {'tok/s':>8s} {'hit':>6s} {'compile s':>9s}")
    for r in rows:
        print(f"{r['name']:24s} {r['step_ms']:8.2f} {r['tokens_per_s']:8.1f} {r['hit_rate']:6.3f} "
              f"{r['compile_s']:9.1f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"profile_step{a.tag}.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__,
                           xla_flags=os.environ.get("XLA_FLAGS", ""),
                           commit=os.environ.get("JAXKV_COMMIT", "unknown"), args=vars(a), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
