"""The two-stage selector's second stage alone (issue 27's cost): ``candidate_mass`` per layer,
the XLA reference against the Pallas kernel (tile tokens x num_warps sweep), at the 128k decode
shapes of ``ab_step.py``: Qwen-like B=8 (64-token pages, 12 / 2 heads, head dim 128, 28
layers, 8x 32 candidates) and 8B-like B=1 (16-token pages, 32 / 8 heads, 32 layers, 8x 128
candidates), the key copy int8 with the selector's own allocation (``Rescore.init``'s layers).

Each variant runs chained in one jitted loop over the layers (``_meta.time_chained``, 8 calls
per iteration, which spreads the loop's own ~10 us per iteration), so
the figure is device time per layer, launches included, as inside the decode step. The
kernel's masses are checked against the reference first (max relative difference, and how
many of the top-k pages the two choose alike).

    PYTHONPATH=. python3 benchmarks/probes/candidate_mass_gpu.py --out DIR   # H200, ~1 min
    PYTHONPATH=. python3 benchmarks/probes/candidate_mass_gpu.py --quick --out /tmp/cm
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import _meta  # noqa: E402

from jaxkv.kernels import candidate_mass as cm  # noqa: E402
from jaxkv.spec import alloc_rows  # noqa: E402

# name -> (L, B, H, G, Np, ps, D, C, k)
SHAPES = {
    "qwen_b8": (28, 8, 2, 6, 2048, 64, 128, 256, 32),
    "8b_b1": (32, 1, 8, 4, 8192, 16, 128, 1024, 128),
}
QUICK = {"tiny": (2, 2, 2, 3, 16, 16, 32, 8, 2)}


def case(shape, seed=0):
    L, B, H, G, Np, ps, D, C, _ = shape
    rng = np.random.default_rng(seed)
    La = alloc_rows(L, B * H * Np * ps * D, 1)
    keys = jax.random.randint(jax.random.key(seed), (La, B, H, Np, ps, D), -127, 128, jnp.int8)
    scales = jax.random.uniform(jax.random.key(seed + 1), (La, B, H, Np, ps)) * 0.02
    q = jnp.asarray(rng.normal(size=(B, H * G, D)), jnp.float32)
    pos = jnp.full((B,), Np * ps - 5, jnp.int32)
    cand = np.stack([np.stack([rng.permutation(Np)[:C] for _ in range(H)]) for _ in range(B)])
    return q, keys, scales, jnp.asarray(cand, jnp.int32), pos


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    shapes = QUICK if a.quick else SHAPES
    rows = []
    for name, shape in shapes.items():
        L, B, H, G, Np, ps, D, C, k = shape
        # the kernel's tile: block_c candidates of ps tokens
        tiles = (16, 32) if a.quick else (64, 128, 256, 512)
        variants = [("xla", {})] + [(f"pallas_t{t}_w{w}", dict(block_c=max(1, t // ps),
                                                                num_warps=w))
                                   for t in tiles for w in (4, 8)]
        q, keys, scales, cand, pos = case(shape)
        ref = np.asarray(jax.jit(cm.candidate_mass_reference)(q, keys, scales, 1, cand, pos))
        ref_top = np.sort(np.argsort(-ref, axis=-1)[..., :k], axis=-1)
        for vname, kw in variants:
            fn = (cm.candidate_mass_reference if vname == "xla" else
                  (lambda *x, kw=kw: cm.candidate_mass_pallas(*x, **kw)))
            row = dict(shape=name, variant=vname, L=L, B=B, H=H, G=G, Np=Np, ps=ps, D=D, C=C)
            try:
                got = np.asarray(jax.jit(fn)(q, keys, scales, 1, cand, pos))
                top = np.sort(np.argsort(-got, axis=-1)[..., :k], axis=-1)
                row["max_rel_diff"] = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))
                row["top_k_same"] = float(np.mean(top == ref_top))

                def body(i, c, q, keys, scales, cand, pos, fn=fn):
                    m = fn(q + c * 1e-30, keys, scales, i % L, cand, pos)
                    return c + jnp.max(m)

                t = _meta.time_chained(body, jnp.float32(0), (q, keys, scales, cand, pos),
                                       iters=2 if a.quick else 8, reps=a.reps, unroll=4 if a.quick else 8)
                row["us_per_layer"] = t * 1e6
                row["gb_read_per_layer"] = B * H * C * ps * (D + 4) / 1e9
            except Exception as e:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del keys, scales
    meta = _meta.write_rows(a.out, "candidate_mass_gpu.json", rows)
    print(f"\n{meta}")
    print(f"{'shape':8} {'variant':16} {'us/layer':>9} {'GB/s':>7} {'max rel':>9} {'top-k same':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['variant']:16} ERROR {r['error'][:80]}")
            continue
        gbs = r["gb_read_per_layer"] / (r["us_per_layer"] * 1e-6)
        print(f"{r['shape']:8} {r['variant']:16} {r['us_per_layer']:9.1f} {gbs:7.0f} "
              f"{r['max_rel_diff']:9.2e} {r['top_k_same']:10.4f}")


if __name__ == "__main__":
    main()
