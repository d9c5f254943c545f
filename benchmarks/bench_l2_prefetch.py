"""Does reading a layer's weights into L2 during its attention make its matmuls faster?

    PYTHONPATH=. python3 benchmarks/bench_l2_prefetch.py --out DIR [--quick]

At decode batch <= 8 the weight matmuls stream their weights from HBM, while the attention
path between them (selection, top-k, attention: a chain of short kernels) leaves HBM mostly
idle. ``pallas_kernels.l2_prefetch`` reads the first bytes of the next matmuls' weights into L2
(``evict_last``) in a kernel that depends only on the layer's keys, so the round's concurrent
CUDA graph can run it beside that chain. This script times the Qwen-like layer (28 distinct
layers of random weights, d = 1536, F = 8960, B = 8) in one compiled program with the engine's
round options, in two modes:

* ``serial``: per layer the prefetch, then the output projection and the MLP (``layer_output``):
  what the warm L2 saves in the matmuls net of the prefetch's own time;
* ``window``: per layer ``attention_inputs``, then a stand-in attention path (``--chain`` tiny
  dependent Pallas kernels and a read of ``--stream-mb`` MB, the scores' and attention's
  traffic, which competes for L2), the prefetch beside it, then ``layer_output``.

Variants prefetch all of ``wo`` and the first 0 / 16 / 32 MiB / all of ``w_gate_up``, and the
32 MiB one with 32 / 64 / 128 programs. Every variant's output is compared with the
baseline's (the prefetch is an identity; separately compiled programs may still differ in
the last bits where XLA's autotuner picks other matmul tilings). Reports microseconds per
layer. First, ``--gemm``: one product per layer with its weight cold (HBM), warm (L2), or
read whole by the prefetch kernel just before: what L2 can give XLA's matmul at all.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # noqa: E402
import bench_launch  # noqa: E402
from jaxkv import engine  # noqa: E402
from models import configs, llama  # noqa: E402
from pallas_kernels import l2_prefetch  # noqa: E402

MIB = 1 << 20
ALL = 1 << 40
# name -> (bytes of w_gate_up, programs); wo is prefetched whole whenever a variant prefetches
VARIANTS = {"none": (0, 64), "wo": (0, 64), "wo_gu16": (16 * MIB, 64),
            "wo_gu32": (32 * MIB, 64), "wo_gu_all": (ALL, 64),
            "wo_gu32_p32": (32 * MIB, 32), "wo_gu32_p128": (32 * MIB, 128)}


def program(cfg, params, slabs, variant: str, mode: str, chain: int, passes: int):
    """Compiled ``f(x [B, 1, d], slabs) -> x`` running ``passes`` times over the layers."""
    gu_bytes, programs = VARIANTS[variant]
    pf = () if variant == "none" else (("wo", ALL), ("w_gate_up", gu_bytes))
    pf = tuple((n, b) for n, b in pf if b)

    def f(x, slabs, params):
        B = x.shape[0]
        pos = jnp.full((B, 1), 1000, jnp.int32)
        for p in range(passes):
            for i, lp in enumerate(params["layers"]):
                h, q, k, v = llama.attention_inputs(lp, cfg, x, pos)
                if mode == "window":  # tiny kernels on a carrier, then a read of a slab
                    c = jnp.zeros((bench_launch.ROWS, bench_launch.COLS), jnp.float32)
                    c = c + q[0, 0, 0, 0].astype(jnp.float32)
                    for _ in range(chain):
                        c = bench_launch.pallas_step(c)
                    s = jnp.sum(slabs[(p * len(params["layers"]) + i) % len(slabs)]
                                .astype(jnp.float32) * c[0, 0])
                    attn = q + ((s + c[1, 1]) * 1e-30).astype(q.dtype)
                else:
                    attn = q
                if pf:
                    x = l2_prefetch.l2_prefetch(x, k, tuple(lp[n] for n, _ in pf),
                                                nbytes=tuple(b for _, b in pf),
                                                programs=programs)
                x = llama.layer_output(lp, cfg, x, attn)
        return x

    x = jnp.ones((8, 1, cfg.d_model), cfg.dtype)
    return jax.jit(f).lower(x, slabs, params).compile(dict(engine.ROUND_COMPILER_OPTIONS) or None)


def _median_s(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return ts


def measure(cfg, params, slabs, variant, mode, chain, passes, reps):
    compiled = program(cfg, params, slabs, variant, mode, chain, passes)
    x0 = (jax.random.normal(jax.random.key(1), (8, 1, cfg.d_model)) * 0.1).astype(cfg.dtype)
    y = np.asarray(compiled(x0, slabs, params).astype(jnp.float32))
    ts = _median_s(lambda: compiled(x0, slabs, params), reps)
    n = passes * len(params["layers"])
    return dict(variant=variant, mode=mode, us_per_layer=statistics.median(ts) / n * 1e6,
                us_per_layer_min=min(ts) / n * 1e6), y


def gemm_probe(d: int, n: int, layers: int, reps: int, programs: int) -> list[dict]:
    """One [8, d] x [d, n] bf16 product per layer, chained: ``cold`` with ``layers`` distinct
    weights (HBM), ``warm`` with one weight (L2 after the first), ``prefetched``: each distinct
    weight read whole by l2_prefetch first, ``prefetch_only``: the prefetches alone."""
    ws = tuple(jax.random.normal(jax.random.key(100 + i), (d, n)).astype(jnp.bfloat16)
               for i in range(layers))
    x0 = jnp.ones((8, d), jnp.bfloat16)

    def chain(kind):
        def f(x, ws):
            for i in range(layers):
                w = ws[0] if kind == "warm" else ws[i]
                if kind in ("prefetched", "prefetch_only"):
                    x = l2_prefetch.l2_prefetch(x, x, (w,), nbytes=ALL, programs=programs)
                if kind != "prefetch_only":
                    x = (x @ w)[:, :d] * 0.01
            return x
        return jax.jit(f).lower(x0, ws).compile(dict(engine.ROUND_COMPILER_OPTIONS) or None)

    rows = []
    for kind in ("cold", "warm", "prefetched", "prefetch_only"):
        c = chain(kind)
        ts = _median_s(lambda: c(x0, ws), reps)
        us = statistics.median(ts) / layers * 1e6
        rows.append(dict(mode="gemm", variant=kind, d=d, n=n, weight_mb=d * n * 2 / MIB,
                         programs=programs, us_per_layer=us, us_per_layer_min=min(ts) / layers * 1e6,
                         gbps=d * n * 2 / us / 1e3))
        print(f"gemm    {kind:13s} {us:8.2f} us/product  {rows[-1]['gbps']:7.0f} GB/s of weights",
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default="serial,window")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--stream-mb", type=float, default=34.0)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gemm", default="1536x8192", help="d x n of the gemm probe ('' = skip)")
    ap.add_argument("--programs", type=int, default=128, help="prefetch grid of the gemm probe")
    a = ap.parse_args()
    if a.quick:
        cfg, reps, passes, stream = configs.tiny(num_layers=2), 2, 1, 0.25
    else:
        cfg, reps, passes, stream = configs.qwen2_5_1_5b(), a.reps, a.passes, a.stream_mb
    params = llama.init_params(cfg, 0)
    slab_elems = int(stream * MIB) // 2
    slabs = tuple(jax.random.normal(jax.random.key(10 + i), (slab_elems,)).astype(jnp.bfloat16)
                  for i in range(4))
    names = a.variants.split(",")
    rows, base = [], {}
    if a.gemm:
        d, n = (int(v) for v in a.gemm.split("x"))
        rows += gemm_probe(min(d, 64) if a.quick else d, min(n, 128) if a.quick else n,
                           2 if a.quick else 28, reps, a.programs)
    for mode in [m for m in a.modes.split(",") if m]:
        for name in names:
            r, y = measure(cfg, params, slabs, name, mode, a.chain, passes, reps)
            if name == names[0]:
                base[mode] = y
            r["equal_to_first"] = bool(np.array_equal(y, base[mode], equal_nan=True))
            r["max_rel_diff_to_first"] = float(np.max(np.abs(y - base[mode]))
                                               / max(np.max(np.abs(base[mode])), 1e-30))
            rows.append(r)
            print(f"{mode:7s} {name:13s} {r['us_per_layer']:8.2f} us/layer "
                  f"(min {r['us_per_layer_min']:.2f}) equal={r['equal_to_first']} "
                  f"rel.diff {r['max_rel_diff_to_first']:.1e}", flush=True)
    first = {r["mode"]: r["us_per_layer"] for r in rows
             if r["variant"] in (names[0], "cold")}
    for r in rows:
        r["ratio_to_first"] = r["us_per_layer"] / first[r["mode"]]
    out = dict(benchmark="bench_l2_prefetch", device=str(jax.devices()[0].device_kind),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, quick=a.quick,
               model=cfg.name, batch=8, chain=a.chain, stream_mb=stream, passes=passes,
               reps=reps, round_options=[list(o) for o in engine.ROUND_COMPILER_OPTIONS],
               variants={k: dict(gate_up_bytes=v[0], programs=v[1]) for k, v in VARIANTS.items()},
               rows=rows,
               note="us_per_layer = median program time / (passes * layers); ratio_to_first: "
                    "against the first variant in the same mode")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_l2_prefetch.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\nmode    variant        us/layer  ratio")
    for r in rows:
        print(f"{r['mode']:7s} {r['variant']:13s} {r['us_per_layer']:8.2f}  {r['ratio_to_first']:.3f}")


if __name__ == "__main__":
    main()
