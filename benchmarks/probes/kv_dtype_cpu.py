"""Decode speed on the CPU by KV dtype (the model's, int8, fp8): SmolLM2-135M, float32, a
~1.1k-token prompt, resident dense decoding and the host tier with Quest. Per token = (time
of 36 new tokens - time of 4) / 32, the median of --reps pairs after a warm-up call (compiled).

fp8 is the case it watches: XLA:CPU has no fp8 data movement of its own and widens an fp8
array around every gather, scatter or dynamic update of it, so jaxkv's XLA paths move fp8
page rows as bytes (``kv_quant.bits``).

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/kv_dtype_cpu.py [--out DIR]
        [--dtypes none int8 float8_e4m3fn] [--modes resident host]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _meta  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import CacheConfig  # noqa: E402

CACHES = {"resident": dict(mode="resident", selector="dense"),
          "host": dict(mode="host", selector="quest", page_size=16, selected_pages=16)}


def per_token_ms(model, prompt, cache, reps):
    model.generate(prompt, max_new_tokens=4, cache=cache)            # compiles
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=4, cache=cache)
        t4 = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=36, cache=cache)
        ts.append((time.perf_counter() - t0 - t4) / 32 * 1e3)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/kv_dtype_cpu")
    ap.add_argument("--dtypes", nargs="+", default=["none", "int8", "float8_e4m3fn"])
    ap.add_argument("--modes", nargs="+", default=list(CACHES), choices=list(CACHES))
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    model = jaxkv.load()
    prompt = "The quick brown fox jumps over the lazy dog. " * 120
    rows = []
    for mode in a.modes:
        for dt in a.dtypes:
            kv = None if dt == "none" else dt
            ms = per_token_ms(model, prompt, CacheConfig(kv_dtype=kv, **CACHES[mode]), a.reps)
            rows.append(dict(mode=mode, kv_dtype=dt, ms_per_token=round(ms, 1)))
            print(f"{mode:9s} {dt:14s} {ms:8.1f} ms per token", flush=True)
    meta = _meta.write_rows(a.out, "kv_dtype_cpu.json", rows)
    print(f"wrote {a.out}/kv_dtype_cpu.json ({meta['commit']}, {meta['device']})")


if __name__ == "__main__":
    main()
