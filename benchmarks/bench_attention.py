"""Sparse paged decode attention time per layer vs the HBM roofline of the selected bytes.

Points: batch x selected pages (64-token pages, 8 KV heads x 128 dims, 32 query heads, bf16).
Each timing is one jitted ``lax.fori_loop`` whose body runs one layer's attention on a fresh
selection (``block_rows[i % n_sets]``, rows drawn at random from a pool of several GiB so the
L2 cannot hold it; the output feeds the next query); the figure is wall time per iteration,
median of a few runs, including loop overhead (reported separately as ``loop_overhead_us``).
The roofline is the selected K/V bytes at the bandwidth of a large device copy (bytes read +
written) measured in the same run. At each point a few variants (num_splits, pages per inner
iteration, num_warps, num_stages) are swept; the default and the best are reported.
If ``benchmarks/bench_select.py`` has ``run(out_dir, quick)``, it runs at the end.

    PYTHONPATH=. python3 benchmarks/bench_attention.py --out DIR [--quick] [--no-select]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxkv.kernels import sparse_attention as sa  # noqa: E402
from jaxkv.kernels.sparse_attention import AttentionTuning  # noqa: E402

FULL = dict(batches=(1, 8, 32), pages=(32, 64), H=8, G=4, D=128, ps=64, pool_gib=6.0,
            copy_mib=2048, target_s=0.02, min_iters=20, max_iters=400, reps=3, unroll=32,
            l2_mib=256, split_factors=(0.25, 0.5, 1, 2, 4),
            tunings=((2, 4, 3), (1, 8, 3), (2, 8, 3), (1, 4, 2), (1, 4, 4)),  # + the default (1, 4, 3)
            xla_reference=True)
QUICK = dict(batches=(1,), pages=(2,), H=2, G=2, D=16, ps=16, pool_gib=2 ** -10,
             copy_mib=1, target_s=0.0, min_iters=2, max_iters=2, reps=1, unroll=2,
             l2_mib=0, split_factors=(1, 2), tunings=((1, 8, 2),), xla_reference=True)
# The Qwen-like decode shape (2 KV heads x 128, 12 query heads: groups of 6), B=8, 32 pages:
# the attention of the headline decode step (Qwen-like B=8 at 128k), its layers chained as in
# the step (28).
QWEN = dict(FULL, batches=(8,), pages=(32,), H=2, G=6, unroll=28,
            split_factors=(0.125, 0.25, 0.5, 1),
            tunings=((1, 4, 2), (1, 8, 2), (2, 4, 2), (2, 4, 3), (2, 8, 3), (1, 2, 2), (1, 4, 4)))
TARGETS = dict(min_roofline_frac_at_batch_ge_8=0.70, max_us_batch1_32pages=10.0)


def _commit() -> str:
    from _meta import commit  # benchmarks/ is on sys.path when the script runs
    return commit()


def _time_loop(body, init, args, iters, reps, unroll=1):
    """Median seconds per ``body`` call in ``fori_loop(0, iters, ...)``; ``args`` are jit arguments.

    With ``unroll`` > 1 each loop iteration makes ``unroll`` chained calls (call index
    ``i * unroll + u``), so the loop's own per-iteration cost (a host round trip on GPU,
    ~10 us: docs/decisions.md) is spread over ``unroll`` calls, as in a decode step's unrolled
    layer loop.
    """
    from _meta import time_chained  # benchmarks/ is on sys.path when the script runs
    # warm-up: compile, then one more run (XLA:CPU finishes some compilation lazily)
    return time_chained(body, init, args, iters, reps, unroll, warmups=2)


def _hbm_copy_gbps(mib, reps):
    """Device copy bandwidth (bytes read + written per second): the best of a bf16 and an f32
    elementwise pass over a ``mib`` MiB array (the HBM ceiling used for the roofline)."""
    best = 0.0
    for dt in (jnp.bfloat16, jnp.float32):
        n = max(1, mib * 2**20 // jnp.dtype(dt).itemsize)
        t = _time_loop(lambda i, x: x * dt(0.999) + dt(1), jnp.ones((n,), dt), (), 20, reps)
        best = max(best, 2 * n * jnp.dtype(dt).itemsize / t / 1e9)
    return best


def _variants(c, B, K):
    """(name, num_splits, tuning) list: a split sweep around the default, then tunings."""
    default = sa.default_num_splits(B, c["H"], K)
    splits = sorted({max(1, min(K, int(round(default * f)))) for f in c["split_factors"]})
    out = [("default", None, None)]
    out += [(f"S{s}", s, None) for s in splits if s != default]
    return default, out


def run(out_dir, quick=False, with_select=True, shape="8b"):
    """Run the benchmark; write ``bench_attention.json`` (``bench_attention_qwen.json`` for the
    Qwen-like shape) and a plot to ``out_dir``."""
    c = QUICK if quick else (QWEN if shape == "qwen" else FULL)
    H, G, D, ps = c["H"], c["G"], c["D"], c["ps"]
    impl = "pallas"
    R = 2 * H * ps * D
    n_rows = max(64, int(c["pool_gib"] * 2**30 // (R * 2)))
    key = jax.random.PRNGKey(0)
    pool = jax.random.normal(key, (n_rows, R), jnp.bfloat16)
    gbps = _hbm_copy_gbps(c["copy_mib"], c["reps"])
    print(f"HBM copy {gbps:.0f} GB/s (read + write); pool {n_rows} rows x {R * 2 // 1024} KiB "
          f"= {n_rows * R * 2 / 2**30:.2f} GiB", flush=True)
    rng = np.random.default_rng(0)
    points = []
    overheads = {}
    for K in c["pages"]:
        for B in c["batches"]:
            sel_bytes = B * H * K * ps * D * 2 * 2  # K and V, bf16
            roof_s = sel_bytes / (gbps * 1e9)
            iters = int(np.clip(c["target_s"] / max(roof_s, 5e-6) / c["unroll"], c["min_iters"], c["max_iters"]))
            n_sets = int(np.clip(-(-c["l2_mib"] * 2**20 // sel_bytes), 2, 64))
            # Rows at random from the whole pool (rare repeats within a head are harmless here).
            rows = jnp.asarray(rng.integers(0, n_rows, size=(n_sets, B, H, K)), jnp.int32)
            n_pages_seq = 4 * K
            pidx = jnp.asarray(rng.integers(0, n_pages_seq, size=(n_sets, B, H, K)), jnp.int32)
            lens = jnp.full((B,), n_pages_seq * ps, jnp.int32)
            q0 = jax.random.normal(jax.random.PRNGKey(1), (B, H * G, D), jnp.bfloat16)
            args = (pool, rows, pidx, lens)

            def time_variant(S, tuning, implementation=impl):
                def body(i, q, pool, rows, pidx, lens):
                    j = i % n_sets
                    out, _ = sa.sparse_paged_attention(
                        q, pool, rows[j], pidx[j], lens, page_size=ps, num_kv_heads=H,
                        num_splits=S, tuning=tuning, implementation=implementation)
                    return out
                return _time_loop(body, q0, args, iters, c["reps"], c["unroll"])

            def ov_body(i, q, pool, rows, pidx, lens):
                return q + rows[i % n_sets, 0, 0, :1].astype(q.dtype)[None, None] * 0
            overheads[(K, B)] = _time_loop(ov_body, q0, args, iters, c["reps"], c["unroll"])

            default_S, variants = _variants(c, B, K)
            res = []

            def rec(name, S, tuning, t):
                r = dict(name=name, num_splits=S or default_S,
                         pages_per_iter=(tuning or AttentionTuning()).pages_per_iter,
                         num_warps=(tuning or AttentionTuning()).num_warps,
                         num_stages=(tuning or AttentionTuning()).num_stages,
                         us=t * 1e6, roofline_frac=roof_s / t)
                res.append(r)
                print(f"  B={B:3d} K={K:3d} {name:18s} {t * 1e6:9.2f} us  {roof_s / t:6.1%} of roofline",
                      flush=True)
                return r

            for name, S, tuning in variants:
                try:
                    rec(name, S, tuning, time_variant(S, tuning))
                except Exception as e:  # noqa: BLE001  (a variant that fails to compile is reported)
                    print(f"  B={B} K={K} {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            ok = [r for r in res if "us" in r]
            best_S = min(ok, key=lambda r: r["us"])["num_splits"] if ok else default_S
            for ppi, nw, ns in c["tunings"]:
                tuning = AttentionTuning(pages_per_iter=ppi, num_warps=nw, num_stages=ns)
                name = f"S{best_S}_p{ppi}_w{nw}_s{ns}"
                try:
                    rec(name, best_S, tuning, time_variant(best_S, tuning))
                except Exception as e:  # noqa: BLE001
                    print(f"  B={B} K={K} {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            xla_us = None
            if c["xla_reference"]:
                try:
                    xla_us = time_variant(None, None, "xla") * 1e6
                    print(f"  B={B:3d} K={K:3d} {'xla reference':18s} {xla_us:9.2f} us", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  xla reference FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            default = next((r for r in res if r["name"] == "default"), None)
            best = min(res, key=lambda r: r["us"]) if res else None
            points.append(dict(batch=B, pages=K, selected_bytes=sel_bytes, roofline_us=roof_s * 1e6,
                               iters=iters, selection_sets=n_sets, default_num_splits=default_S,
                               default=default, best=best, variants=res, xla_reference_us=xla_us,
                               loop_overhead_us=overheads[(K, B)] * 1e6))

    dev = jax.devices()[0]
    checks = {}
    for p in points:
        if p["best"] is None:
            continue
        if p["batch"] >= 8:
            checks[f"B{p['batch']}_K{p['pages']}_roofline_frac>=0.70"] = dict(
                default=p["default"] and p["default"]["roofline_frac"] >= 0.70,
                best=p["best"]["roofline_frac"] >= 0.70)
        if p["batch"] == 1 and p["pages"] == 32:
            checks["B1_K32_us<=10"] = dict(default=p["default"] and p["default"]["us"] <= 10.0,
                                           best=p["best"]["us"] <= 10.0)
    out = dict(benchmark="bench_attention", device=f"{dev.platform}:{dev.device_kind}",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=_commit(),
               jax_version=jax.__version__, quick=quick, shape=shape,
               hbm_copy_gbps=gbps,
               pool_rows=n_rows, pool_gib=n_rows * R * 2 / 2**30, implementation=impl,
               config={k: v for k, v in c.items()}, targets=TARGETS, checks=checks, points=points,
               note="us = wall time per layer: each fori_loop iteration runs `unroll` chained layers "
                    "(as a decode step's unrolled layer loop: 32 = the 8B-like model's layers), the loop's own cost spread over them; "
                    "(loop_overhead_us: a one-kernel body); roofline_frac = selected K/V bytes at "
                    "the HBM copy bandwidth / us")
    os.makedirs(out_dir, exist_ok=True)
    stem = "bench_attention" + ("_qwen" if shape == "qwen" else "")
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    _plot(out, os.path.join(out_dir, stem + ".png"))
    if with_select:
        _run_select(out_dir, quick)
    _table(out)
    return out


def _run_select(out_dir, quick):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_select.py")
    if not os.path.exists(path):
        return
    try:
        spec = importlib.util.spec_from_file_location("bench_select", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if hasattr(mod, "run"):
            print("\n== bench_select", flush=True)
            mod.run(out_dir, quick)
    except Exception as e:  # noqa: BLE001  (never lose the attention results to it)
        print(f"bench_select FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)


def _plot(out, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    pages = sorted({p["pages"] for p in out["points"]})
    fig, axes = plt.subplots(1, len(pages), figsize=(5 * len(pages), 4), squeeze=False)
    for ax, K in zip(axes[0], pages):
        pts = sorted((p for p in out["points"] if p["pages"] == K and p["best"]), key=lambda p: p["batch"])
        xs = [p["batch"] for p in pts]
        ax.plot(xs, [p["roofline_us"] for p in pts], "k--", label="HBM roofline")
        ax.plot(xs, [p["default"]["us"] if p["default"] else np.nan for p in pts], "o-", label="default")
        ax.plot(xs, [p["best"]["us"] for p in pts], "s-", label="best variant")
        if any(p["xla_reference_us"] for p in pts):
            ax.plot(xs, [p["xla_reference_us"] or np.nan for p in pts], "^:", label="xla reference")
        ax.plot(xs, [p["loop_overhead_us"] for p in pts], ":", color="gray", label="loop overhead")
        ax.set_xscale("log", base=2); ax.set_yscale("log")
        ax.set_xlabel("batch"); ax.set_ylabel("us per layer")
        ax.set_title(f"{K} pages x {out['config']['ps']} tokens")
        ax.legend(fontsize=8)
    fig.suptitle(f"sparse paged attention, {out['device']}, HBM {out['hbm_copy_gbps']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(out):
    print(f"\nbench_attention on {out['device']} (jax {out['jax_version']}), "
          f"HBM copy {out['hbm_copy_gbps']:.0f} GB/s; us per layer (fraction of HBM roofline)")
    print(f"{'B':>4s} {'pages':>5s} {'roofline':>9s} {'default':>16s} {'best':>16s}  {'best variant':20s} "
          f"{'xla':>8s} {'loop':>6s}")
    for p in out["points"]:
        d, b = p["default"], p["best"]
        fmt = lambda r: f"{r['us']:8.1f} ({r['roofline_frac']:4.0%})" if r else f"{'-':>16s}"
        xla = f"{p['xla_reference_us']:8.1f}" if p["xla_reference_us"] else f"{'-':>8s}"
        print(f"{p['batch']:4d} {p['pages']:5d} {p['roofline_us']:9.1f} {fmt(d):>16s} {fmt(b):>16s}  "
              f"{(b['name'] if b else '-'):20s} {xla} {p['loop_overhead_us']:6.1f}")
    for name, v in out["checks"].items():
        print(f"target {name}: default {'PASS' if v['default'] else 'FAIL'}, "
              f"best {'PASS' if v['best'] else 'FAIL'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quick", action="store_true", help="tiny smoke test (also runs on CPU)")
    ap.add_argument("--no-select", action="store_true", help="skip benchmarks/bench_select.py")
    ap.add_argument("--shape", default="8b", choices=("8b", "qwen"),
                    help="8b: 8 KV heads x 128, B 1/8/32, 32/64 pages; qwen: 2 KV heads, groups "
                         "of 6, B=8, 32 pages (the Qwen-like decode step)")
    a = ap.parse_args()
    run(a.out, quick=a.quick, with_select=not a.no_select, shape=a.shape)


if __name__ == "__main__":
    main()
