"""Where the first ``jaxkv.generate`` call of a process spends its compile time, by program.

    PYTHONPATH=. python3 benchmarks/probes/first_call.py [--model qwen2_5_1_5b] [--prompt 4096]
        [--out FILE.json]

Random weights of a named config (bf16), one request, host-tier Quest; the first call and a
second call with another prompt of the same bucket (which must compile nothing). Prints the
compilations of each call by program (``jax.monitoring``'s backend-compile events) and the
calls' wall times; with ``--out`` writes them as JSON with the device, jax version and commit.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jaxkv  # noqa: E402
from _meta import commit  # noqa: E402
from jaxkv.models import configs, llama  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_1_5b")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = configs.get_config(a.model, dtype="bfloat16")
    params = llama.init_params(cfg, seed=0)
    cache = jaxkv.CacheConfig(mode="host", selector="quest", page_size=64, selected_pages=16)
    rng = np.random.default_rng(0)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: events.append((kw.get("fun_name"), d))
        if ev.endswith("backend_compile_duration") else None)
    calls = []
    for i in range(2):
        prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, a.prompt - i)]
        n0, t0 = len(events), time.perf_counter()
        res = jaxkv.generate(cfg, params, [prompt], cache=cache, max_new_tokens=a.new, stop_tokens=[])
        wall = time.perf_counter() - t0
        by = collections.defaultdict(lambda: [0, 0.0])
        for name, d in events[n0:]:
            by[name][0] += 1
            by[name][1] += d
        calls.append(dict(wall_s=wall, compile_s=sum(d for _, d in events[n0:]),
                          programs={k: dict(count=c, seconds=s) for k, (c, s) in by.items()},
                          tokens=len(res.tokens[0])))
    for i, c in enumerate(calls):
        print(f"call {i + 1}: {c['wall_s']:.2f} s, compiling {c['compile_s']:.2f} s")
        for k, v in sorted(c["programs"].items(), key=lambda kv: -kv[1]["seconds"])[:8]:
            print(f"  {v['seconds']:7.2f} s  {v['count']:3d}  {k}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(
            device=str(jax.devices()[0]), jax=jax.__version__, commit=commit(),
            date=time.strftime("%Y-%m-%d %H:%M:%S"), model=a.model, prompt=a.prompt,
            cache=repr(cache), calls=calls), indent=1))


if __name__ == "__main__":
    main()
