"""Micro-benchmarks behind the decode-step layout choices (8B-like shapes, bf16).

    PYTHONPATH=. python3 benchmarks/probes/micro_step.py --out DIR [--quick]

1. Weight layout: an unrolled 8-layer chain of x @ W[l] with W stacked [L, d, n] (XLA slices
   each layer, which may copy) against one array per layer.
2. Projections: separate q/k/v (and gate/up) dots against fused wqkv / w_gate_up.
3. Top-k of Quest scores [B*H, N] -> 32: lax.top_k, rounds of 16, chunked, argsort.
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
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import _meta  # noqa: E402
from jaxkv.kernels import dense_select  # noqa: E402


def chain(ws_get, L, steps):
    """steps x L chained matvecs, x [B, d] -> the us per matvec-set."""
    def run(x, ws):
        def body(_, x):
            for l in range(L):
                ys = [x @ w for w in ws_get(ws, l)]
                x = x + sum(y[:, :1] for y in ys).astype(x.dtype) * 1e-3
            return x
        return lax.fori_loop(0, steps, body, x)
    return jax.jit(run)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    q = a.quick
    L, d, f, hq, hk, D = (2, 64, 128, 4, 2, 16) if q else (8, 4096, 14336, 32, 8, 128)
    steps = 2 if q else 20
    rows = []
    key = jax.random.key(0)
    for B in ([1] if q else [1, 8]):
        x = jax.random.normal(key, (B, d), jnp.bfloat16)
        shapes = {"q": hq * D, "k": hk * D, "v": hk * D, "gate": f, "up": f}
        st = {n: jax.random.normal(key, (L, d, m), jnp.bfloat16) * 0.01 for n, m in shapes.items()}
        per = {n: [st[n][l] + 0 for l in range(L)] for n in shapes}
        jax.block_until_ready(per)
        fused_qkv = jnp.concatenate([st["q"], st["k"], st["v"]], axis=-1)
        fused_gu = jnp.concatenate([st["gate"], st["up"]], axis=-1)
        per_qkv = [fused_qkv[l] + 0 for l in range(L)]
        per_gu = [fused_gu[l] + 0 for l in range(L)]
        variants = {
            "stacked_separate": (lambda ws, l: [ws[n][l] for n in shapes], st),
            "perlayer_separate": (lambda ws, l: [ws[n][l] for n in shapes], per),
            "stacked_fused": (lambda ws, l: [ws[0][l], ws[1][l]], (fused_qkv, fused_gu)),
            "perlayer_fused": (lambda ws, l: [ws[0][l], ws[1][l]], (per_qkv, per_gu)),
        }
        nbytes = sum(L * d * m * 2 for m in shapes.values())
        for name, (get, ws) in variants.items():
            t = _meta.time_calls(chain(get, L, steps), (x, ws), 20) / steps
            rows.append(dict(part="weights", B=B, variant=name, us_per_layer=t / L * 1e6,
                             hbm_gbs=nbytes / t / 1e9))
        del st, per, fused_qkv, fused_gu, per_qkv, per_gu
    for n in ([64] if q else [512, 2048, 16384]):
        s = jax.random.normal(key, (8, n), jnp.float32)
        for method in ["sort", "rounds", "chunked", "argsort"]:
            if method == "argsort":
                fn = lambda s: jnp.argsort(-s, axis=-1)[:, :32]  # noqa: E731
            else:
                fn = lambda s, m=method: dense_select._topk_indices(s, 32, m)[1]  # noqa: E731

            def loop(s, fn=fn):
                def body(i, c):
                    return c + fn(s + c[0, 0].astype(s.dtype) * 1e-9)[0, 0]
                return lax.fori_loop(0, 50, body, jnp.zeros((1, 1), jnp.int32))
            t = _meta.time_calls(jax.jit(loop), (s,), 20) / 50
            rows.append(dict(part="topk", N=n, variant=method, us=t * 1e6))
    print(f"{'part':8s} {'shape':8s} {'variant':20s} {'us':>9s} {'GB/s':>7s}")
    for r in rows:
        shape = f"B={r['B']}" if "B" in r else f"N={r['N']}"
        us = r.get("us_per_layer", r.get("us"))
        print(f"{r['part']:8s} {shape:8s} {r['variant']:20s} {us:9.1f} {r.get('hbm_gbs', 0):7.0f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "micro_step.json"), "w") as fh:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                           commit=_meta.commit(), date=datetime.date.today().isoformat(),
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
