"""What ``generate``'s NaN / Inf check of the params costs (``validation.check_params_finite``):
median wall time of the check on random weights of a benchmark shape, and the bytes it reads.

    PYTHONPATH=. python3 benchmarks/probes/params_check_cost.py [--shape 8b] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode_lib as bd  # noqa: E402
from jaxkv import validation  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=("8b", "qwen1.5b", "tiny"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    params = (bd.llama.init_params(bd.configs.tiny(), 0) if a.shape == "tiny"
              else bd.get_params(a.shape, 0))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    t0 = time.perf_counter()
    validation.check_params_finite(params)
    first = time.perf_counter() - t0
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        validation.check_params_finite(params)
        times.append(time.perf_counter() - t0)
    res = dict(shape=a.shape, device=str(jax.devices()[0]), jax=jax.__version__,
               param_bytes=nbytes, first_call_s=first, median_s=statistics.median(times),
               gb_per_s=nbytes / statistics.median(times) / 1e9)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"params_check_{a.shape}.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(f"params check, {a.shape} ({nbytes / 2**30:.1f} GiB): first call {first * 1e3:.1f} ms "
          f"(compiles), then {res['median_s'] * 1e3:.2f} ms ({res['gb_per_s']:.0f} GB/s)")


if __name__ == "__main__":
    main()
