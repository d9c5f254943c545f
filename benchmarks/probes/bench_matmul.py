"""Decode-shaped weight matmuls: how fast does one layer's set of projections read its weights?

    PYTHONPATH=. python3 benchmarks/probes/bench_matmul.py --out DIR [--quick]

A decode step at small batch is a chain of matrix-vector-like products (M = batch rows) whose
cost is reading the weights. In the per-kernel trace of the Qwen-like B=8 step (113 GEMMs per
step) XLA's Triton GEMM fusions read at ~3.0 TB/s against the ~4 TB/s a large copy reaches.
This script times a chain of ``layers`` layers, each ``x @ wqkv``, ``@ wo``, ``@ w_gate_up``,
``@ w_down`` with the model's shapes (distinct weights per layer, so nothing stays in L2),
plus the ``lm_head`` alone, under several compilations:

* ``xla``: the default (Triton GEMM fusions, autotuned);
* ``cublas``: ``xla_gpu_enable_triton_gemm=False`` (cuBLAS / cuBLASLt);
* ``exhaustive``: XLA's exhaustive Triton tiling search (``--variants``);
* ``autotune0``: no autotuning, XLA's heuristic tilings;

and with the weights stored input-major ``[in, out]`` (the model's layout, ``y = x @ W``) or
output-major ``[out, in]`` (``--layouts io,oi``).

What these figures decided (cuBLAS, output-major weights, the tiling search, no autotuning, and
the kernels measured against XLA's products: a split-K Pallas matmul and the MLP as one Pallas
kernel) is in docs/decisions.md.

``--l2``: each projection alone with its weight read from HBM (a distinct weight per layer) or
from L2 (one shared weight): how much of a product's time the weight read is.

Reports microseconds per layer and the weight-read bandwidth (weight bytes / time).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import _meta  # noqa: E402

# (d_model, q_dim + 2 * kv_dim, q_dim, ffn, vocab) of the two benchmark shapes (models/configs.py)
SHAPES = {
    "qwen1.5b": dict(d=1536, qkv=1536 + 2 * 256, q=1536, f=8960, v=151936, layers=28),
    "8b": dict(d=4096, qkv=4096 + 2 * 1024, q=4096, f=14336, v=128256, layers=32),
}
QUICK = dict(d=64, qkv=128, q=64, f=128, v=256, layers=2)
VARIANTS = {
    "xla": {},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
    # the autotuner over XLA's full Triton tiling space instead of its default shortlist
    "exhaustive": {"xla_gpu_exhaustive_tiling_search": True},
    # no autotuning: XLA's heuristic tilings (the autotuner times candidates on the same
    # buffers again and again, so weights that fit in L2 are timed warm)
    "autotune0": {"xla_gpu_autotune_level": 0},
}
DEFAULT_VARIANTS = "xla,cublas"


def layer_weights(key, s, layers, dtype=jnp.bfloat16, layout="io"):
    """Per-layer weight dicts with the model's fused shapes: ``layout`` "io" stores W
    input-major [in, out] (y = x @ W, the model's layout), "oi" output-major [out, in]
    (y = x @ W.T, each output's weights contiguous)."""
    out = []
    for i in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        shapes = dict(wqkv=(s["d"], s["qkv"]), wo=(s["q"], s["d"]),
                      w_gate_up=(s["d"], 2 * s["f"]), w_down=(s["f"], s["d"]))
        out.append({n: jax.random.normal(k, sh if layout == "io" else sh[::-1], dtype) * 0.02
                    for k, (n, sh) in zip(ks, shapes.items())})
    return out


def chain_fn(mm, s, steps):
    """steps x (all layers) of the four projections, chained through x [M, d] bf16."""
    def run(x, ws):
        def body(_, x):
            for w in ws:
                qkv = mm(x, w["wqkv"])
                o = mm(qkv[:, : s["q"]].astype(x.dtype), w["wo"])
                x = (x.astype(jnp.float32) + o).astype(x.dtype)
                gu = mm(x, w["w_gate_up"])
                a = jax.nn.silu(gu[:, : s["f"]]) * gu[:, s["f"]:]
                x = (x.astype(jnp.float32) + mm(a.astype(x.dtype), w["w_down"])).astype(x.dtype)
            return x
        return jax.lax.fori_loop(0, steps, body, x)
    return run


def head_fn(mm, steps):
    def run(x, w):
        def body(_, x):
            y = mm(x, w)
            return x + (y[:, : x.shape[1]] * 1e-6).astype(x.dtype)
        return jax.lax.fori_loop(0, steps, body, x)
    return run


def xla_mm(x, w):
    """The model's own product (jaxkv.models.llama._matmul): bf16 result, upcast to f32."""
    return jnp.einsum("mi,io->mo", x, w).astype(jnp.float32)


def xla_mm_oi(x, w):
    """The same product with output-major weights [out, in]."""
    return jnp.einsum("mi,oi->mo", x, w).astype(jnp.float32)


MATMULS = {"io": xla_mm, "oi": xla_mm_oi}


def timed(fn, args, options, reps):
    """Median seconds of ``fn(*args)`` compiled with the XLA ``options`` (after a warm-up)."""
    compiled = jax.jit(fn).lower(*args).compile(options or None)
    return _meta.time_calls(compiled, args, reps)


def rel_err(mm, x, mats, options):
    """Largest error of the single products ``x @ w`` (w in ``mats``) compiled with
    ``options``, relative to the default compilation's, scaled by the largest |result|
    (the chained benchmark itself overflows: random weights over 28-32 residual layers)."""
    worst = 0.0
    for w in mats:
        k_in = w.shape[0] if mm is xla_mm else w.shape[1]
        xi = x if x.shape[1] == k_in else jnp.ones((x.shape[0], k_in), x.dtype) * 0.1
        ref = jax.jit(mm)(xi, w)
        got = jax.jit(mm).lower(xi, w).compile(options or None)(xi, w)
        scale = float(jnp.max(jnp.abs(ref))) + 1e-6
        worst = max(worst, float(jnp.max(jnp.abs(got - ref))) / scale)
    return worst


def measure(s, layout, m, opts, steps, reps):
    """One row: the layer chain and the lm_head of shape ``s`` at batch ``m``, weights in
    ``layout``, compiled with the XLA ``opts``."""
    t_c = time.perf_counter()
    mm = MATMULS[layout]
    L = s["layers"]
    ws = layer_weights(jax.random.key(0), s, L, layout=layout)
    hshape = (s["d"], s["v"]) if layout == "io" else (s["v"], s["d"])
    head = jax.random.normal(jax.random.key(1), hshape, jnp.bfloat16) * 0.02
    wbytes = sum(int(w.size) * w.dtype.itemsize for lw in ws for w in lw.values())
    hbytes = int(head.size) * head.dtype.itemsize
    x = (jax.random.normal(jax.random.key(2), (m, s["d"]), jnp.float32) * 0.1).astype(jnp.bfloat16)
    us_layer = timed(chain_fn(mm, s, steps), (x, ws), opts, reps) / steps / L * 1e6
    us_head = timed(head_fn(mm, steps), (x, head), opts, reps) / steps * 1e6
    return dict(batch=m, layout=layout, us_per_layer=us_layer, layer_weight_bytes=wbytes // L,
                layer_tbps=wbytes / L / (us_layer * 1e-6) / 1e12,
                us_lm_head=us_head, lm_head_tbps=hbytes / (us_head * 1e-6) / 1e12,
                us_per_step=us_layer * L + us_head,
                rel_err_vs_xla=rel_err(mm, x, list(ws[0].values()) + [head], opts),
                wall_s=time.perf_counter() - t_c)


def l2_rows(s, m, steps, reps):
    """Each projection alone, chained ``layers`` times per step through x [m, in] bf16, with
    ``distinct`` weights per layer (read from HBM) or one ``shared`` weight (it stays in L2
    when it fits: 50 MB on the H200). An optimization barrier keeps XLA from narrowing a
    product to the columns the next one uses. The gate half of ``w_gate_up`` stands in for it
    (the whole does not fit in L2)."""
    L = s["layers"]
    mats = dict(wqkv=(s["d"], s["qkv"]), wo=(s["q"], s["d"]), w_gate=(s["d"], s["f"]),
                w_down=(s["f"], s["d"]))
    rows = []
    for name, (k_in, n_out) in mats.items():
        ws = [jax.random.normal(jax.random.key(100 + i), (k_in, n_out), jnp.bfloat16) * 0.02
              for i in range(L)]
        x = jnp.ones((m, k_in), jnp.bfloat16) * 0.1
        reps_out = -(-k_in // n_out)

        def run(x, ws, shared):
            def body(_, x):
                for i in range(L):
                    y = jax.lax.optimization_barrier(xla_mm(x, ws[0] if shared else ws[i]))
                    x = jnp.tile(y, (1, reps_out))[:, :k_in].astype(x.dtype)
                return x
            return jax.lax.fori_loop(0, steps, body, x)

        us = {}
        for mode in ("distinct", "shared"):
            us[mode] = timed(lambda x, ws, sh=(mode == "shared"): run(x, ws, sh), (x, ws), {},
                             reps) / steps / L * 1e6
        nbytes = k_in * n_out * 2
        rows.append(dict(matrix=name, shape=[k_in, n_out], batch=m, weight_mb=nbytes / 1e6,
                         us_distinct=us["distinct"], us_shared=us["shared"],
                         shared_over_distinct=us["shared"] / us["distinct"],
                         tbps_distinct=nbytes / (us["distinct"] * 1e-6) / 1e12))
        r = rows[-1]
        print(f"L2 probe {name:7s} {r['weight_mb']:6.1f} MB M={m}: HBM (distinct) "
              f"{r['us_distinct']:6.2f} us ({r['tbps_distinct']:.2f} TB/s), L2 (shared) "
              f"{r['us_shared']:6.2f} us, ratio {r['shared_over_distinct']:.3f}", flush=True)
    return rows


def _write(a, name: str, rows: list, notes: list):
    """``<a.out>/<name>.json`` (when --out is given): run metadata, the rows and notes."""
    if not a.out:
        return
    out = dict(benchmark=name, device=str(jax.devices()[0].device_kind),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, steps=a.steps, reps=a.reps,
               quick=a.quick, rows=rows, notes=notes)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="qwen1.5b,8b", type=_meta.names_of(SHAPES, "shapes"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    type=_meta.names_of(VARIANTS, "variants"), help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--layouts", default="io", type=_meta.names_of(("io", "oi"), "layouts"),
                    help="weight layouts: io (the model's, [in, out]) "
                    "and/or oi ([out, in])")
    ap.add_argument("--l2", action="store_true", help="only the per-projection probe: weights "
                    "from HBM (distinct per layer) vs from L2 (one shared weight), XLA default")
    a = ap.parse_args()
    if a.l2:
        rows = []
        for shape in a.shapes:
            s = QUICK if a.quick else SHAPES[shape]
            for m in [int(b) for b in a.batches.split(",")]:
                rows += [dict(r, shape=shape) for r in l2_rows(s, m, a.steps, a.reps)]
        _write(a, "bench_matmul_l2", rows,
               ["per projection: layers x (x @ W) chained in a jitted fori_loop, x [M, in] bf16; "
                "distinct = a different W per layer, shared = one W; us per product, each with "
                "one small tile/slice fusion; tbps_distinct = W bytes / us_distinct"])
        return
    gpu = jax.default_backend() == "gpu"
    variants = {v: VARIANTS[v] for v in a.variants} if gpu else {"xla": {}}
    rows = []
    for shape in a.shapes:
        s = QUICK if a.quick else SHAPES[shape]
        for layout in a.layouts:
            for m in [int(b) for b in a.batches.split(",")]:
                for name, opts in variants.items():
                    row = measure(s, layout, m, opts, a.steps, a.reps)
                    row.update(shape=shape, variant=name,
                               options={k: str(v) for k, v in opts.items()})
                    rows.append(row)
                    print(f"{shape:9s} {layout} M={m:<2d} {name:7s} "
                          f"layer {row['us_per_layer']:7.2f} us "
                          f"({row['layer_tbps']:.2f} TB/s)  lm_head {row['us_lm_head']:7.2f} us "
                          f"({row['lm_head_tbps']:.2f} TB/s)  step {row['us_per_step']:8.1f} us  "
                          f"err {row['rel_err_vs_xla']:.1e}", flush=True)
    _write(a, "bench_matmul", rows,
           ["chain: per layer x@wqkv, @wo, @w_gate_up, @w_down (bf16, distinct weights per "
            "layer) in a jitted fori_loop; TB/s = weight bytes / time",
            "rel_err_vs_xla: single products x @ w (first layer's weights, lm_head) "
            "compiled with the variant's options against the default compilation"])
    print("\nshape     lay M  variant  us/layer  TB/s  lm_head us  TB/s  step us")
    for r in rows:
        print(f"{r['shape']:9s} {r['layout']}  {r['batch']:<2d} {r['variant']:8s} "
              f"{r['us_per_layer']:8.2f} {r['layer_tbps']:5.2f} {r['us_lm_head']:10.2f} "
              f"{r['lm_head_tbps']:5.2f} {r['us_per_step']:8.1f}")


if __name__ == "__main__":
    main()
