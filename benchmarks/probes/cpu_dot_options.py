"""XLA:CPU matrix products under its compiler options, next to numpy and torch (issue 34).

The CPU prefill and decode spend most of their time in matrix products: the projections of a
512-token prefill piece, the attention tiles, and in decoding matrix-vector products over
every weight (the LM head alone is 113 MB in float32 for SmolLM2). This probe times those
shapes (float32, SmolLM2-135M's sizes) compiled with XLA:CPU's default and with the options
that route dots to other libraries (XNNPACK, oneDNN), interleaved in one process, checks the
results against the default, and times numpy's and (if importable) torch's product of the
same operands.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/cpu_dot_options.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # name: (operand shapes, einsum)
    "prefill qkv [512,576]x[576,960]": ((512, 576), (576, 960), "td,de->te"),
    "prefill gate_up [512,576]x[576,3072]": ((512, 576), (576, 3072), "td,de->te"),
    "prefill down [512,1536]x[1536,576]": ((512, 1536), (1536, 576), "td,de->te"),
    "attention tile 9x[512,64]x[64,512]": ((9, 512, 64), (9, 512, 64), "hqd,hkd->hqk"),
    "decode gate_up [1,576]x[576,3072]": ((1, 576), (576, 3072), "td,de->te"),
    "decode lm head [1,576]x[49152,576]^T": ((1, 576), (49152, 576), "td,vd->tv"),
}
OPTIONS = {
    "default": {},
    "xnnpack": {"xla_cpu_use_xnnpack": True},
    "onednn": {"xla_cpu_use_onednn": True},
    "onednn custom call": {"xla_cpu_experimental_onednn_custom_call": True},
}


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for name, (sa, sb, eq) in SHAPES.items():
        a_np = rng.standard_normal(sa, dtype=np.float32)
        b_np = rng.standard_normal(sb, dtype=np.float32)
        x, w = jnp.asarray(a_np), jnp.asarray(b_np)
        flops = 2 * np.prod(sa) * (sb[-1] if eq.endswith("te") else sb[-2])
        f = lambda x, w, eq=eq: jnp.einsum(eq, x, w)  # noqa: E731
        ref = None
        row = {"shape": name, "gflop": float(flops / 1e9)}
        for opt, kw in OPTIONS.items():
            try:
                c = jax.jit(f).lower(x, w).compile(kw or None)
            except Exception as e:  # noqa: BLE001 - an option this XLA rejects
                row[opt] = f"rejected: {str(e)[:80]}"
                continue
            y = np.asarray(c(x, w))
            ref = y if ref is None else ref
            dt = _time(lambda: c(x, w).block_until_ready(), a.reps)
            row[opt] = {"ms": dt * 1e3, "gflops": flops / dt / 1e9,
                        "max_rel_err": float(np.abs(y - ref).max() / np.abs(ref).max())}
        np_eq = eq
        dt = _time(lambda: np.einsum(np_eq, a_np, b_np, optimize=True), a.reps)
        row["numpy"] = {"ms": dt * 1e3, "gflops": flops / dt / 1e9}
        try:
            import torch
            ta, tb = torch.from_numpy(a_np), torch.from_numpy(b_np)
            with torch.inference_mode():
                dt = _time(lambda: torch.einsum(eq, ta, tb), a.reps)
            row["torch"] = {"ms": dt * 1e3, "gflops": flops / dt / 1e9}
        except ImportError:
            pass
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = list(OPTIONS) + ["numpy"] + (["torch"] if any("torch" in r for r in rows) else [])
    print(f"\nGFLOP/s (best of {a.reps}); jax {jax.__version__}, load {os.getloadavg()[0]:.2f}")
    print("| shape | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]['gflops']:.1f}" if isinstance(r.get(c), dict) else "-" for c in cols]
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cpu_dot_options.json"), "w") as fh:
            json.dump({"jax": jax.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
