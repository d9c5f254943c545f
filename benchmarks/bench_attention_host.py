"""Sparse attention with missed pages read in place from the pinned host tier: time per layer
against the same selection served wholly from the device pool.

The engine's in-place schedule reads a step's missed pages straight from pinned host memory
inside the attention kernel. This measures what that costs per layer at the decode shapes
(8B-like B=1: 8 KV heads, 32 query heads; Qwen-like B=8 and B=16 (``--shapes``): 2 KV heads,
12 query heads; 32 selected 64-token pages per head, bf16) for 0-4 missed entries per layer,
and a few kernel tunings. Each figure is one jitted, chained ``fori_loop`` (``_meta.time_chained``).

    PYTHONPATH=. python3 benchmarks/bench_attention_host.py --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # noqa: E402
from jaxkv.kernels import sparse_attention as sa  # noqa: E402
from jaxkv.kernels.sparse_attention import AttentionTuning  # noqa: E402

SHAPES = {"8b-b1": dict(B=1, H=8, G=4), "qwen-b8": dict(B=8, H=2, G=6),
          "qwen-b16": dict(B=16, H=2, G=6)}
FULL = dict(D=128, ps=64, K=32, pool_rows=2048, host_gib=2.0, n_sets=16, iters=64, reps=3,
            unroll=16, misses=(0, 1, 4), warps=(None,))
QUICK = dict(D=16, ps=16, K=4, pool_rows=32, host_gib=2 ** -12, n_sets=2, iters=2, reps=1,
             unroll=2, misses=(0, 1), warps=(None,))


def run(out_dir, quick=False, shapes=("8b-b1", "qwen-b8")):
    c = QUICK if quick else FULL
    D, ps, K = c["D"], c["ps"], c["K"]
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    points = []
    for shape in shapes:
        s = SHAPES[shape]
        B, H, G = s["B"], s["H"], s["G"]
        if quick:
            H, G = 2, 2
        R = 2 * H * ps * D
        n_host = max(64, int(c["host_gib"] * 2**30 // (R * 2)))
        pool = jax.random.normal(jax.random.PRNGKey(0), (c["pool_rows"], R), jnp.bfloat16)
        host = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (n_host, R), jnp.bfloat16),
                              host_sh)
        q0 = jax.random.normal(jax.random.PRNGKey(2), (B, H * G, D), jnp.bfloat16)
        lens = jnp.full((B,), 8 * K * ps, jnp.int32)
        shp = (c["n_sets"], B, H, K)
        rows0 = rng.integers(0, c["pool_rows"], shp).astype(np.int32)
        pidx = jnp.asarray(np.stack([[[rng.permutation(8 * K)[:K] for _ in range(H)]
                                      for _ in range(B)] for _ in range(c["n_sets"])]), jnp.int32)
        for m in c["misses"]:
            rows = rows0.copy()
            hrows = np.full(shp, -1, np.int32)
            for j in range(c["n_sets"]):  # m missed entries per set, at random positions
                flat = rng.permutation(B * H * K)[:m]
                idx = np.unravel_index(flat, (B, H, K))
                rows[(j,) + idx] = -1
                hrows[(j,) + idx] = rng.integers(0, n_host, m)
            args = (pool, host, jnp.asarray(rows), jnp.asarray(hrows), pidx, lens)
            for with_host in ((False, True) if m == 0 else (True,)):
                for w in c["warps"]:
                    tuning = AttentionTuning(num_warps=w)

                    def body(i, q, pool, host, rows, hrows, pidx, lens):
                        j = i % c["n_sets"]
                        extra = dict(host=host, host_rows=hrows[j]) if with_host else {}
                        out, _ = sa.sparse_paged_attention(
                            q, pool, rows[j], pidx[j], lens, page_size=ps, num_kv_heads=H,
                            tuning=tuning, implementation="pallas", **extra)
                        return out
                    t = _meta.time_chained(body, q0, args, c["iters"], c["reps"], c["unroll"],
                                           warmups=2)
                    r = dict(shape=shape, B=B, H=H, G=G, K=K, misses=m, host_operand=with_host,
                             num_warps=w or 4, us=t * 1e6)
                    points.append(r)
                    print(f"  {shape:8s} misses {m}  host operand {str(with_host):5s}  warps "
                          f"{w or 4}: {t * 1e6:7.2f} us", flush=True)
    res = dict(benchmark="bench_attention_host", device=str(dev.device_kind),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, quick=quick, settings=c,
               points=points)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_attention_host.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"\n{'shape':8s} {'misses':>6s} {'host':>5s} {'warps':>5s} {'us':>8s}")
    for r in points:
        print(f"{r['shape']:8s} {r['misses']:6d} {str(r['host_operand']):>5s} {r['num_warps']:5d} "
              f"{r['us']:8.2f}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="8b-b1,qwen-b8", type=_meta.names_of(SHAPES, "shapes"),
                    help=f"comma-separated, of {sorted(SHAPES)}")
    a = ap.parse_args()
    run(a.out, quick=a.quick, shapes=tuple(a.shapes))


if __name__ == "__main__":
    main()
