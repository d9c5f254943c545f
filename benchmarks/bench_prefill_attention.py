"""Causal prefill attention per layer: the chunked XLA reference, the Pallas flash-attention
kernel (a few tunings) and cuDNN's flash attention, at the prefill shapes.

Shapes (batch 1, one layer, bf16, ``--shapes``): 8B-like (32 query heads, 8 KV heads, D=128)
and Qwen-like (12 / 2, D=128) at ``--lengths`` prompt tokens (the prompt fills its bucket).
Each figure is the median of ``--reps`` timed calls after a warm-up call (compile excluded);
TFLOP/s counts the causal half of ``4 * Hq * D * T^2``. The error column is the largest
absolute difference to the XLA reference at the first length (bf16).

    PYTHONPATH=. python3 benchmarks/bench_prefill_attention.py --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # noqa: E402
from jaxkv.kernels import prefill_attention as pa  # noqa: E402

SHAPES = {"8b": dict(Hq=32, H=8, D=128), "qwen": dict(Hq=12, H=2, D=128)}
QUICK_SHAPES = {"8b": dict(Hq=4, H=2, D=16), "qwen": dict(Hq=6, H=2, D=16)}
# (name, implementation, tuning)
VARIANTS = [
    ("xla", "xla", {}),  # chunk: the rule of bench_decode's prefill (scores <= 4 GiB)
    ("pallas", "pallas", {}),
    ("pallas_q64_k64", "pallas", dict(block_q=64, block_k=64, num_warps=4)),
    ("pallas_q128_k128", "pallas", dict(block_q=128, block_k=128, num_warps=8)),
    ("pallas_q128_k64_s3", "pallas", dict(block_q=128, block_k=64, num_warps=8, num_stages=3)),
    ("cudnn", "cudnn", {}),
]


def _parse_tokens(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def xla_chunk(Hq: int, T: int) -> int:
    """The reference's query chunk: at most 2048, scores of one chunk at most 4 GiB (f32)."""
    c = max(16, (4 << 30) // (Hq * T * 4))
    return max(16, min(2048, 1 << (c.bit_length() - 1), 1 << (T.bit_length() - 1)))


def run(out_dir, quick=False, shapes=("8b", "qwen"), lengths=("32k", "128k"), reps=3,
        xla_max=131072, variants=None):
    table = QUICK_SHAPES if quick else SHAPES
    variants = [v for v in VARIANTS if variants is None or v[0] in variants]
    if quick:
        variants = [v for v in variants if v[1] != "cudnn"]
    rows = []
    for shape in shapes:
        Hq, H, D = (table[shape][k] for k in ("Hq", "H", "D"))
        refs = None
        for li, Ls in enumerate(lengths):
            T = 64 * (li + 1) if quick else _parse_tokens(Ls)
            key = jax.random.key(T)
            kq, kk, kv = jax.random.split(key, 3)
            q = jax.random.normal(kq, (1, T, Hq, D), jnp.bfloat16)
            k = jax.random.normal(kk, (1, T, H, D), jnp.bfloat16)
            v = jax.random.normal(kv, (1, T, H, D), jnp.bfloat16)
            lens = jnp.asarray([T], jnp.int32)
            flops = 4.0 * Hq * D * T * T / 2
            for name, impl, tuning in variants:
                if impl == "xla" and T > xla_max:
                    continue
                if impl == "xla":
                    tuning = dict(chunk=xla_chunk(Hq, T))
                f = jax.jit(lambda q, k, v, l, impl=impl, tuning=tuning: pa.prefill_attention(
                    q, k, v, l, implementation=impl, **tuning))
                rec = dict(shape=shape, T=T, Hq=Hq, H=H, D=D, variant=name, implementation=impl,
                           tuning=tuning)
                try:
                    out = f(q, k, v, lens)
                    if li == 0:
                        if impl == "xla":
                            refs = out
                        elif refs is not None:
                            rec["max_abs_err_vs_xla"] = float(jnp.max(jnp.abs(
                                out.astype(jnp.float32) - refs.astype(jnp.float32))))
                    del out
                    dt = _meta.time_calls(f, (q, k, v, lens), 1 if quick else reps)
                    rec.update(ms=1e3 * dt, tflops=flops / dt / 1e12)
                    print(f"{shape:5s} T={T:7d} {name:20s} {1e3 * dt:10.2f} ms "
                          f"{flops / dt / 1e12:7.1f} TFLOP/s "
                          f"err {rec.get('max_abs_err_vs_xla', float('nan')):.3g}", flush=True)
                except Exception as e:  # noqa: BLE001  (cuDNN may be missing or refuse a shape)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{shape:5s} T={T:7d} {name:20s} failed: {rec['error']}", flush=True)
                rows.append(rec)
    res = dict(benchmark="bench_prefill_attention", device=str(jax.devices()[0].device_kind),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, quick=quick, reps=reps,
               rows=rows)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_prefill_attention.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"\n{'shape':5s} {'T':>7s} {'variant':20s} {'ms':>10s} {'TFLOP/s':>8s}")
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:5s} {r['T']:7d} {r['variant']:20s} {r['ms']:10.2f} {r['tflops']:8.1f}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--shapes", default="8b,qwen", type=_meta.names_of(SHAPES, "shapes"))
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--xla-max", type=_parse_tokens, default=131072,
                    help="longest prompt timed with the XLA reference")
    ap.add_argument("--variants", default=None, type=_meta.names_of([v[0] for v in VARIANTS],
                                                                     "variants"),
                    help="comma list of VARIANTS names")
    a = ap.parse_args()
    run(a.out, quick=a.quick, shapes=tuple(a.shapes),
        lengths=tuple(a.lengths.split(",")), reps=a.reps, xla_max=a.xla_max,
        variants=a.variants)


if __name__ == "__main__":
    main()
