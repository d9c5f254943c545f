"""Page-selector cost per layer vs context length (Quest, DSA-style indexer), on one device.

Each timing is one jitted ``lax.fori_loop`` whose body selects for layer ``i % L`` of a
``[L, ...]`` metadata array (so nothing is hoisted out of the loop); the figure is wall time
per iteration (median of several runs). Reported separately: scoring only (the Pallas
kernel with masked loads and ``_unmasked`` loads, a few block shapes; ``scores_cmax_*`` =
scores plus chunk maxima, Pallas kernel or XLA reference), top-k only (on precomputed scores:
every top-k method; ``topk_pallas_cmax`` = the kernel on precomputed chunk maxima, with
tunings ``topk_pallas_cmax_c<chunk>_w<warps>`` at the sweep size; ``topk_pallas_cmax_xlamax``
= chunk maxima in XLA + that kernel), the whole selector (``select_pallas_topk`` = Pallas
scores kernel + Pallas top-k kernel, the GPU default; ``select_pallas_chunked`` = XLA top-k;
``select_xla_auto`` = the XLA scores reference + the default top-k; ``select_pallas_cmax`` /
``select_xla_cmax`` = Quest's top-k method "pallas_cmax" with the scores kernel / reference
writing the chunk maxima; ``select_pallas_cmax_unmasked`` the same with unmasked loads), the
decode step's Quest work per layer (``update_select_separate`` = ``quest_update``'s XLA
scatters, then "pallas_cmax"; ``update_select_fused`` = ``quest_update_select``, the update
inside the scores kernel; in this loop XLA copies the summaries after the scatters, which
the decode step does not, so "separate" overstates the step's cost: benchmarks/
ab_step.py measures the step), and an almost empty loop (overhead).
The metadata read time at HBM speed comes from a device copy bandwidth measured in the same
run (one elementwise pass over 1 GiB per loop iteration, read + write).

    PYTHONPATH=. python3 benchmarks/bench_select.py --out DIR [--quick] [--sizes 16384]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.kernels import dense_select as ds
from jaxkv.kernels import indexer, quest, topk

# Sweep-size variants limited so that ``--sizes 16384`` fits in ~90 s on the H200: full-row
# top-k tunings, scores bp16/bp32, topk sort/rounds and select_pallas_sort are not run at the
# sweep size (their figures: docs/decisions.md).
FULL = dict(sizes=(1024, 4096, 16384), L=4, B=1, H=8, G=4, D=128, HI=64, DI=128, ps=64, k=32,
            sinks=1, iters=200, reps=5, copy_mib=1024, sweep_at=16384,
            quest_blocks=((4, 4),),  # default: 8 pages, 4 warps
            # unmasked loads (block_pages, num_warps); (None, 4) = default blocks, every size
            quest_unmasked_blocks=((4, 4), (16, 8)),
            indexer_blocks=((128, 4),),  # default: 64 pages, 4 warps
            # scores + chunk maxima (block_pages, num_warps, unmasked) at the sweep size
            cmax_scores_variants=((4, 4, True), (16, 8, True)),
            # top-k from chunk maxima (chunk, num_warps) at the sweep size; default (16, 8)
            topk_cmax_variants=((16, 4), (16, 16), (32, 8)),
            slow_topk_from=8192)  # topk "sort" / "rounds" only below this many pages
# Qwen2.5-1.5B-like decode step at 128k tokens, batch 8: 2 KV heads, 6 query heads per group
QWEN_B8 = dict(FULL, sizes=(2048,), B=8, H=2, G=6, sweep_at=None)
# the same, sweeping the chunk-maxima top-k's (chunk, num_warps) at 2048 pages (default (8, 8))
QWEN_B8_TOPK = dict(QWEN_B8, sweep_at=2048,
                    topk_cmax_variants=((4, 4), (4, 8), (8, 2), (8, 4), (16, 4), (16, 8),
                                        (32, 4), (32, 8)))
QUICK = dict(sizes=(16,), L=2, B=1, H=2, G=2, D=16, HI=16, DI=16, ps=4, k=8, sinks=1,
             iters=2, reps=1, copy_mib=1, sweep_at=16, quest_blocks=(),
             quest_unmasked_blocks=((4, 4),), indexer_blocks=(),
             cmax_scores_variants=((2, 4, True),), topk_cmax_variants=((2, 4),),
             slow_topk_from=0)


# whole-selector variants (implementation, top-k method) besides select_pallas_topk (the
# default on the GPU, "auto"), at every size: "pallas_cmax" = scores with chunk maxima
# (Pallas kernel or XLA reference) + the top-k kernel reading only maxima and chosen chunks
SELECT_VARIANTS = (("pallas", "chunked"), ("xla", "auto"), ("pallas", "pallas_cmax"),
                   ("xla", "pallas_cmax"))


def _commit() -> str:
    from _meta import commit  # benchmarks/ is on sys.path when the script runs
    return commit()


# Body calls per loop iteration: they spread the loop's ~10 us per-iteration GPU cost
# (docs/decisions.md).
UNROLL = 8


def _time_loop(body, init, iters, reps, args=()):
    """Median seconds per ``body`` call; each ``fori_loop`` iteration makes UNROLL chained
    calls (index ``i * UNROLL + u``), like a decode step's unrolled layer loop.

    The arrays in ``args`` are jit arguments (not baked-in constants); compiled once."""
    unroll = UNROLL
    iters = max(2, iters // unroll)

    from _meta import time_chained  # benchmarks/ is on sys.path when the script runs
    # warm-up: compile
    return time_chained(body, init, args, iters, reps, unroll, warmups=1)


def _hbm_copy_gbps(mib, iters, reps):
    """Device copy bandwidth (bytes read + written per second): the best of a bf16 and an f32
    elementwise pass over a ``mib`` MiB array, ONE pass per loop iteration (no unrolling:
    chained elementwise calls fuse into one kernel that reads and writes once, so an unrolled
    probe reports several times the HBM peak), behind an optimization barrier."""
    from _meta import time_chained  # benchmarks/ is on sys.path when the script runs
    best = 0.0
    for dt in (jnp.bfloat16, jnp.float32):
        n = max(1, mib * 2**20 // jnp.dtype(dt).itemsize)
        t = time_chained(lambda i, x, dt=dt: lax.optimization_barrier(x * dt(0.999) + dt(1)),
                         jnp.ones((n,), dt), (), max(2, iters // 20), reps, 1, warmups=1)
        best = max(best, 2 * n * jnp.dtype(dt).itemsize / t / 1e9)
    return best


def run(out_dir, quick=False, sizes=None, shape="8x128-b1"):
    """Run the benchmark; write ``bench_select.json`` to ``out_dir``; return the record.

    sizes: page counts per sequence (default 1k, 4k, 16k pages of 64 tokens)."""
    c = dict(QUICK if quick else {"qwen-b8": QWEN_B8, "qwen-b8-topk": QWEN_B8_TOPK}.get(shape, FULL))
    if sizes:
        c["sizes"] = tuple(sizes)
    L, B, H, G, D, ps, k, sinks = (c[x] for x in ("L", "B", "H", "G", "D", "ps", "k", "sinks"))
    HI, DI, iters, reps = c["HI"], c["DI"], c["iters"], c["reps"]
    key = jax.random.PRNGKey(0)
    rows = []

    def rec(method, np_, name, sec, meta_bytes=None, **extra):
        r = dict(method=method, n_pages=np_, context_tokens=np_ * ps, name=name,
                 us_per_layer=sec * 1e6, **extra)
        if meta_bytes is not None:
            r["metadata_bytes"] = meta_bytes
        rows.append(r)
        print(f"  {method:8s} {np_:6d} {name:36s} {sec * 1e6:9.2f} us", flush=True)

    gbps = _hbm_copy_gbps(c["copy_mib"], iters, reps)
    print(f"HBM copy {gbps:.0f} GB/s (read + write)", flush=True)
    overhead = _time_loop(lambda i, a: a + (i % L), jnp.zeros((B, H, k), jnp.int32), iters,
                          reps)
    rec("loop", 0, "empty_loop", overhead)

    def time_topk(method_name, np_, scores, seq_lens, top_kw):
        """Top-k alone over precomputed per-layer scores [L, B, (H,) Np]: every method
        ("pallas_cmax" as topk_pallas_cmax_xlamax: chunk maxima in XLA + the kernel), and
        ``topk_pallas_cmax``: the kernel on precomputed chunk maxima (tuning variants
        ``topk_pallas_cmax_c<chunk>_w<warps>`` at the sweep size)."""
        acc0 = jnp.zeros(scores.shape[1:-1] + (top_kw["k"],), jnp.int32)
        for method in ds.TOPK_METHODS[1:]:
            if method in ("sort", "rounds") and np_ >= c["slow_topk_from"]:
                continue

            def body(i, acc, scores, seq_lens, method=method):
                s = lax.dynamic_index_in_dim(scores, i % L, 0, keepdims=False)
                return acc + ds.select_top_pages(s, seq_lens, method=method, **top_kw)
            name = "topk_pallas_cmax_xlamax" if method == "pallas_cmax" else f"topk_{method}"
            rec(method_name, np_, name, _time_loop(body, acc0, iters, reps, (scores, seq_lens)))
        n = scores.shape[-1]
        default = (topk.default_cmax_chunk(n, top_kw["k"]), None)
        for chunk, warps in (default,) + (c["topk_cmax_variants"] if np_ == c["sweep_at"]
                                          else ()):
            cmax = jnp.stack([topk.chunk_max(s, seq_lens, num_pages=top_kw["num_pages"],
                                             page_size=top_kw["page_size"], chunk=chunk)
                              for s in scores])
            fn = functools.partial(topk.select_top_pages_pallas, chunk=chunk, num_warps=warps,
                                   **top_kw)

            def body(i, acc, scores, cmax, seq_lens, fn=fn):
                layer = i % L
                return acc + fn(lax.dynamic_index_in_dim(scores, layer, 0, keepdims=False),
                                seq_lens,
                                chunk_max=lax.dynamic_index_in_dim(cmax, layer, 0,
                                                                   keepdims=False))
            name = ("topk_pallas_cmax" if warps is None
                    else f"topk_pallas_cmax_c{chunk}_w{warps}")
            rec(method_name, np_, name,
                _time_loop(body, acc0, iters, reps, (scores, cmax, seq_lens)), chunk=chunk,
                num_warps=warps)

    for np_ in c["sizes"]:
        seq_lens = jnp.full((B,), np_ * ps - ps // 2, jnp.int32)
        sel_kw = dict(k=k, page_size=ps, num_sink_pages=sinks)
        variants = SELECT_VARIANTS
        top_kw = dict(num_pages=np_, **sel_kw)
        # ---------------------------------------------------------------- Quest
        k1, k2, k3, key = jax.random.split(key, 4)
        q = jax.random.normal(k1, (B, H * G, D), jnp.bfloat16)
        kmax = jax.random.normal(k2, (L, B, np_, H, D), jnp.bfloat16)
        kmin = kmax - jnp.abs(jax.random.normal(k3, kmax.shape, jnp.bfloat16))
        meta = 2 * kmax.size * kmax.dtype.itemsize // L
        read_us = meta / (gbps * 1e9) * 1e6
        rec("quest", np_, "metadata_read_at_hbm_bw", read_us * 1e-6, meta)
        qargs = (q, kmax, kmin, seq_lens)
        sweep = np_ == c["sweep_at"]
        # (block_pages, num_warps, unmasked, eviction_policy)
        blocks = [(None, 4, False, None), (None, 4, True, None)]
        if sweep:
            blocks += [(bp, nw, False, None) for bp, nw in c["quest_blocks"]]
            blocks += [(bp, nw, True, None) for bp, nw in c["quest_unmasked_blocks"]]
            blocks += [(None, 4, True, "evict_first")]
        for bp, nw, um, ev in blocks:
            fn = functools.partial(quest.quest_scores_pallas, page_size=ps, block_pages=bp,
                                   num_warps=nw, unmasked=um, eviction_policy=ev)

            def body(i, acc, q, kmax, kmin, seq_lens, fn=fn):
                return acc + fn(q, kmax, kmin, i % L, seq_lens)[:, :, :k]
            t = _time_loop(body, jnp.zeros((B, H, k), jnp.float32), iters, reps, qargs)
            name = ("scores_pallas" + ("_unmasked" if um else "") + ("_evict" if ev else "")
                    + ("_default" if bp is None else f"_bp{bp}_w{nw}"))
            rec("quest", np_, name, t, meta, block_pages=bp, num_warps=nw, unmasked=um,
                eviction_policy=ev)
        # XLA scores: the registered linear form and the literal formula (the tests' oracle)
        for name, fn in (("scores_xla", quest.quest_scores_xla),
                         ("scores_xla_literal", quest.quest_scores_reference)):
            def body(i, acc, q, kmax, kmin, seq_lens, fn=fn):
                return acc + fn(q, kmax, kmin, i % L, seq_lens, page_size=ps)[:, :, -k:]
            rec("quest", np_, name,
                _time_loop(body, jnp.zeros((B, H, k), jnp.float32), iters, reps, qargs), meta)
        # scores + chunk maxima (the "pallas_cmax" top-k's input): Pallas kernel, XLA reference
        chunk = topk.default_cmax_chunk(np_, k)
        cvars = [("pallas", None, 4, False), ("pallas", None, 4, True), ("xla", None, 4, False)]
        cvars += [("pallas",) + v for v in (c["cmax_scores_variants"] if sweep else ())]
        for impl, bp, nw, um in cvars:
            tuning = dict(block_pages=bp, num_warps=nw, unmasked=um) if impl == "pallas" else {}

            def body(i, acc, q, kmax, kmin, seq_lens, impl=impl, tuning=tuning):
                s, cm = quest.quest_scores_with_chunk_max(q, kmax, kmin, i % L, seq_lens,
                                                          page_size=ps, chunk=chunk,
                                                          implementation=impl, **tuning)
                return acc + s[:, :, :k] + cm[:, :, :k]
            name = ("scores_cmax_xla" if impl == "xla" else "scores_cmax_pallas"
                    + ("_unmasked" if um else "") + ("_default" if bp is None
                                                     else f"_bp{bp}_w{nw}"))
            rec("quest", np_, name,
                _time_loop(body, jnp.zeros((B, H, k), jnp.float32), iters, reps, qargs), meta,
                chunk=chunk, block_pages=bp, num_warps=nw, unmasked=um)
        scores = jnp.stack([quest.quest_scores_pallas(q, kmax, kmin, l, seq_lens, page_size=ps)
                            for l in range(L)])
        time_topk("quest", np_, scores, seq_lens, top_kw)
        for impl, method in (("pallas", "pallas"),) + variants:
            def body(i, acc, q, kmax, kmin, seq_lens, impl=impl, method=method):
                return acc + quest.quest_select(q, kmax, kmin, i % L, seq_lens,
                                                implementation=impl, topk_method=method,
                                                **sel_kw)
            name = "select_pallas_topk" if method == "pallas" else f"select_{impl}_{method}"
            name = name.replace("pallas_cmax", "cmax")
            rec("quest", np_, name,
                _time_loop(body, jnp.zeros((B, H, k), jnp.int32), iters, reps, qargs), meta)

        def body(i, acc, q, kmax, kmin, seq_lens):  # pallas_cmax with unmasked loads
            s, cm = quest.quest_scores_with_chunk_max(q, kmax, kmin, i % L, seq_lens,
                                                      page_size=ps, chunk=chunk,
                                                      implementation="pallas", unmasked=True)
            return acc + topk.select_top_pages_pallas(s, seq_lens, chunk=chunk, chunk_max=cm,
                                                      **top_kw)
        rec("quest", np_, "select_pallas_cmax_unmasked",
            _time_loop(body, jnp.zeros((B, H, k), jnp.int32), iters, reps, qargs), meta)
        # the decode step's whole Quest layer: summary update + selection, the update as XLA
        # scatters before the kernels ("separate") or inside the scores kernel ("fused")
        k_new = jax.random.normal(jax.random.fold_in(key, 7), (B, H, D), jnp.bfloat16)
        for name, fused in (("update_select_separate", False), ("update_select_fused", True)):
            def body(i, c, q, k_new, seq_lens, fused=fused):
                mx, mn, acc = c
                pos = seq_lens - 1
                if fused:
                    mx, mn, sel = quest.quest_update_select(
                        q, mx, mn, i % L, seq_lens, k_new, pos, implementation="pallas",
                        topk_method="pallas_cmax", **sel_kw)
                else:
                    mx, mn = quest.quest_update(mx, mn, i % L, k_new, pos, page_size=ps)
                    sel = quest.quest_select(q, mx, mn, i % L, seq_lens, implementation="pallas",
                                             topk_method="pallas_cmax", **sel_kw)
                return mx, mn, acc + sel
            rec("quest", np_, name,
                _time_loop(body, (kmax, kmin, jnp.zeros((B, H, k), jnp.int32)), iters, reps,
                           (q, k_new, seq_lens)), meta)
        del kmax, kmin, scores
        # ---------------------------------------------------------------- indexer
        k1, k2, k3, key = jax.random.split(key, 4)
        qi = jax.random.normal(k1, (B, HI, DI), jnp.bfloat16)
        w = jax.random.normal(k2, (B, HI), jnp.float32) * HI ** -0.5
        pk = jax.random.normal(k3, (L, B, np_, DI), jnp.float32)
        meta = pk.size * 4 // L
        rec("indexer", np_, "metadata_read_at_hbm_bw", meta / (gbps * 1e9), meta)
        iargs = (qi, w, pk, seq_lens)
        blocks = ((None, 4),) + (c["indexer_blocks"] if np_ == c["sweep_at"] else ())
        for bp, nw in blocks:
            kw = {} if bp is None else dict(block_pages=bp)
            fn = functools.partial(indexer.indexer_scores_pallas, page_size=ps, num_warps=nw,
                                   **kw)

            def body(i, acc, qi, w, pk, seq_lens, fn=fn):
                return acc + fn(qi, w, pk, i % L, seq_lens)[:, :k]
            name = "scores_pallas_default" if bp is None else f"scores_pallas_bp{bp}_w{nw}"
            rec("indexer", np_, name,
                _time_loop(body, jnp.zeros((B, k), jnp.float32), iters, reps, iargs), meta,
                block_pages=bp, num_warps=nw)
        scores = jnp.stack([indexer.indexer_scores_pallas(qi, w, pk, l, seq_lens, page_size=ps)
                            for l in range(L)])
        time_topk("indexer", np_, scores, seq_lens, top_kw)
        for impl, method in (("pallas", "pallas"),) + variants[:3]:
            def body(i, acc, qi, w, pk, seq_lens, impl=impl, method=method):
                return acc + indexer.indexer_select(qi, w, pk, i % L, seq_lens,
                                                    implementation=impl, topk_method=method,
                                                    **sel_kw)
            name = "select_pallas_topk" if method == "pallas" else f"select_{impl}_{method}"
            name = name.replace("pallas_cmax", "cmax_xlamax")
            rec("indexer", np_, name,
                _time_loop(body, jnp.zeros((B, k), jnp.int32), iters, reps, iargs), meta)
        del pk, scores

    dev = jax.devices()[0]
    out = dict(benchmark="bench_select", device=f"{dev.platform}:{dev.device_kind}",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=_commit(),
               jax_version=jax.__version__, quick=quick, shape=shape, hbm_copy_gbps=gbps,
               config={x: v for x, v in c.items()}, results=rows,
               note=f"us_per_layer = wall time per selection call, {UNROLL} chained calls per fori_loop iteration, "
                    "including loop overhead (see empty_loop)")
    os.makedirs(out_dir, exist_ok=True)
    name = "bench_select.json" if shape == "8x128-b1" or quick else f"bench_select_{shape}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(out, f, indent=1, default=str)
    try:  # the plot is a convenience: the JSON is the record
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot_select import plot
        print(plot([(out, out["commit"])], os.path.join(out_dir, name[:-5] + ".png")))
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: {type(e).__name__}: {e})")
    _table(out)
    return out


def _table(out):
    print(f"\nbench_select on {out['device']} (jax {out['jax_version']}), "
          f"HBM copy {out['hbm_copy_gbps']:.0f} GB/s; us per layer")
    rows = out["results"]
    sizes = sorted({r["n_pages"] for r in rows if r["n_pages"]})
    names = []
    for r in rows:
        if r["n_pages"] and (r["method"], r["name"]) not in names:
            names.append((r["method"], r["name"]))
    print(f"{'method':8s} {'what':36s}" + "".join(f"{s:>10d}p" for s in sizes))
    for m, n in names:
        cells = []
        for s in sizes:
            v = [r["us_per_layer"] for r in rows
                 if (r["method"], r["name"], r["n_pages"]) == (m, n, s)]
            cells.append(f"{v[0]:11.1f}" if v else f"{'-':>11s}")
        print(f"{m:8s} {n:36s}" + "".join(cells))
    ov = [r["us_per_layer"] for r in rows if r["name"] == "empty_loop"]
    print(f"(empty loop iteration: {ov[0]:.1f} us)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory for bench_select.json")
    ap.add_argument("--quick", action="store_true", help="tiny smoke test (also runs on CPU)")
    ap.add_argument("--sizes", default="", help="comma-separated page counts, e.g. 1024,16384")
    ap.add_argument("--shape", default="8x128-b1", choices=("8x128-b1", "qwen-b8", "qwen-b8-topk"),
                    help="8x128-b1: B=1, 8 KV heads, G=4 (default); qwen-b8: B=8, 2 KV heads, "
                         "G=6, 2048 pages (the Qwen-like 128k decode step); qwen-b8-topk: the "
                         "same with the sweeps (top-k chunk / warps, scores blocks) at 2048")
    a = ap.parse_args()
    run(a.out, quick=a.quick, sizes=[int(x) for x in a.sizes.split(",") if x], shape=a.shape)


if __name__ == "__main__":
    main()
