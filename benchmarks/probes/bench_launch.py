"""What one more kernel costs in a compiled decode step: chains of tiny dependent kernels.

    PYTHONPATH=. python3 benchmarks/probes/bench_launch.py --out DIR [--quick]

The Qwen-like B=8 decode step runs ~17 kernels per layer (4 weight products, 5 Pallas kernels,
the rest XLA fusions), most of them far from any bandwidth or compute limit. So the step is
bounded by the per-kernel floor times the kernel count, not by bytes. This script measures
that floor: one jitted program of ``--kernels`` chained kernels on an [8, 1024] f32 array,

* ``xla``: XLA fusions (``x * a + b``, kept apart by optimization barriers);
* ``pallas``: a tiny Pallas (Triton) kernel, 8 programs;
* ``mixed``: the two alternating (the decode step's pattern),

each compiled with programmatic dependent launch (``xla_gpu_enable_pdl``, Hopper: a kernel
may start while its predecessor drains) on and off, inside the program's CUDA graph.
Reports microseconds per kernel (program time / kernels) and checks every chain's result.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import _meta  # noqa: E402
from jaxkv.kernels import _common  # noqa: E402

KINDS = ("xla", "pallas", "mixed")
ROWS, COLS = 8, 1024


def _scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.0001 + 0.5


def pallas_step(x):
    """One Pallas kernel: ``x * 1.0001 + 0.5``, one program per row."""
    spec = pl.BlockSpec((1, COLS), lambda i: (i, 0))
    return pl.pallas_call(_scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0],), in_specs=[spec], out_specs=spec,
                          interpret=_common.interpret_mode(), name="tiny_kernel")(x)


def xla_step(x):
    """One XLA fusion: the same arithmetic, kept out of its neighbours' fusions."""
    return jax.lax.optimization_barrier(x * 1.0001 + 0.5)


def chain(kind: str, n: int):
    def f(x):
        for i in range(n):
            use_pallas = kind == "pallas" or (kind == "mixed" and i % 2)
            x = pallas_step(x) if use_pallas else xla_step(x)
        return x
    return f


def expected(x0: np.ndarray, n: int) -> np.ndarray:
    x = x0.astype(np.float32)
    for _ in range(n):
        x = x * np.float32(1.0001) + np.float32(0.5)
    return x


def measure(kind: str, n: int, pdl: bool, reps: int) -> dict:
    x = jnp.ones((ROWS, COLS), jnp.float32)
    compiled = jax.jit(chain(kind, n)).lower(x).compile({"xla_gpu_enable_pdl": pdl})
    y = np.asarray(compiled(x))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return dict(kind=kind, pdl=pdl, kernels=n, us_per_kernel=statistics.median(ts) / n * 1e6,
                correct=bool(np.allclose(y, expected(np.ones((ROWS, COLS)), n), rtol=1e-5)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a few kernels (CPU smoke test)")
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    n, reps = (4, 2) if a.quick else (a.kernels, a.reps)
    rows = []
    for kind in KINDS:
        for pdl in (True, False):
            rows.append(measure(kind, n, pdl, reps))
            r = rows[-1]
            print(f"{kind:7s} pdl={str(pdl):5s} {r['us_per_kernel']:7.3f} us/kernel "
                  f"correct={r['correct']}", flush=True)
    out = dict(benchmark="bench_launch", device=str(jax.devices()[0].device_kind),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, quick=a.quick,
               shape=[ROWS, COLS], rows=rows,
               note="us_per_kernel = median program time / kernels; every kernel depends on "
                    "the previous one; pdl = xla_gpu_enable_pdl")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_launch.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\nkind     PDL on   PDL off  (us per kernel)")
    by = {(r["kind"], r["pdl"]): r["us_per_kernel"] for r in rows}
    for kind in KINDS:
        print(f"{kind:7s} {by[(kind, True)]:7.3f}  {by[(kind, False)]:7.3f}")


if __name__ == "__main__":
    main()
