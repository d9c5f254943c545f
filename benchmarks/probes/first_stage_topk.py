"""The two-stage selector's first stage top-k alone (issue 27's cost): C candidates of a row
of N Quest scores, XLA's top-k ("sort", the first stage's default, unordered) against the
sort-free XLA radix select ("radix": ``dense_select._topk_radix``, 3 scatter-histogram
passes of 11/11/10 bits; "radix_s8x4": 4 passes of 8 bits; "radix_c4x8": 8 passes of 4 bits
counted by a fused compare-and-sum instead of a scatter) and the Pallas radix-select kernel
with its default chunking and single-stage (``chunk=1``), at the 128k decode shapes of
``ab_step.py``: Qwen-like B=8 (2 KV heads, 2048 pages of 64 tokens; 8x / 16x of a 1024-token
budget) and 8B-like B=1 (8 KV heads, 8192 pages of 16 tokens; 8x / 16x), and Qwen-like B=1
at 1M tokens (2 KV heads, 16384 pages of 64 tokens; 8x / 16x), and `CacheConfig()`'s Qwen-like
B=8 (8212 pages of 16 tokens, 512 candidates); the full-row kernel with 32 warps, and the
top-k in 2 / 4 / 8 pieces per row (``_segmented``), and the first stage as the top C / S of
each of S strided pieces of a row, not merged (``pieces{S}``: ``select_top_pages(pieces=S)``,
``CacheConfig.candidate_pieces``; not the row's top C, a cheaper candidate set; ``recall``
is the share of the row's top C it holds). Also the final choice
kernel (``candidate_select``) against its XLA form.

Each variant runs chained in one jitted loop (``_meta.time_chained``, 8 calls per iteration),
so the figure is device time per call, launches included. The pages each variant picks are
checked against XLA's (as sets).

    PYTHONPATH=. python3 benchmarks/probes/first_stage_topk.py --out DIR   # H200, ~1 min
    PYTHONPATH=. python3 benchmarks/probes/first_stage_topk.py --quick --out /tmp/fs
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import _meta  # noqa: E402

from jaxkv.kernels import candidate_select as cs  # noqa: E402
from jaxkv.kernels import dense_select as ds  # noqa: E402
from jaxkv.kernels import topk  # noqa: E402

# name -> (B, H, N, ps, k of the budget, candidate counts, G)
SHAPES = {"qwen_b8": (8, 2, 2048, 64, 16, (128, 256), 6),
          "qwen_b8_p16": (8, 2, 8212, 16, 64, (512,), 6),
          "8b_b1": (1, 8, 8192, 16, 64, (512, 1024), 4),
          "qwen_b1_1m": (1, 2, 16384, 64, 16, (128, 256), 6)}
QUICK = {"tiny": (2, 2, 64, 16, 4, (16, 32), 3)}


def _radix_first_stage(scores, seq_lens, *, k, num_pages, page_size, num_sink_pages,
                       **radix_kw):
    """``select_top_pages(method="radix", ordered=False)`` on [B, H, N] scores with other
    ``_topk_radix`` settings (``radix_kw``): the same masking, then the radix select."""
    n_valid = ds.num_valid_pages(seq_lens, page_size, num_pages)[:, None, None]
    pages = lax.broadcasted_iota(jnp.int32, scores.shape, 2)
    valid = pages < n_valid
    forced = valid & ((pages < num_sink_pages) | (pages == n_valid - 1))
    x = jnp.where(forced, jnp.inf, jnp.where(valid, scores.astype(jnp.float32), -jnp.inf))
    v, i = ds._topk_radix(x.reshape(-1, x.shape[-1]), k, **radix_kw)
    return jnp.where(v == -jnp.inf, -1, i).reshape(scores.shape[:-1] + (k,))


def _segmented(scores, seq_lens, *, k, num_pages, page_size, num_sink_pages, segments,
               merge="pallas"):
    """The first stage's top-k in ``segments`` pieces per row: each piece's top k + 1 by the
    full-row kernel (``B * H * segments`` programs instead of ``B * H``), then the top k of
    the pieces' picks (``merge``: "pallas", the kernel again over the picks' values with a
    forced dummy last slot; "xla": ``lax.top_k``). Every page of a row's top k is in its
    piece's top k, so the union holds the row's top k (ties: lowest page, as the kernel)."""
    B, H, N = scores.shape
    S = segments
    Ns = -(-N // S)
    n_valid = ds.num_valid_pages(seq_lens, page_size, num_pages)[:, None, None]
    pages = lax.broadcasted_iota(jnp.int32, (B, H, Ns * S), 2)
    x = jnp.pad(scores.astype(jnp.float32), ((0, 0), (0, 0), (0, Ns * S - N)))
    valid = pages < n_valid
    forced = valid & ((pages < num_sink_pages) | (pages == n_valid - 1))
    v = jnp.where(forced, jnp.inf, jnp.where(valid, x, -jnp.inf))
    local = topk.select_top_pages_pallas(v.reshape(B, H * S, Ns),
                                         jnp.full((B,), Ns * page_size, jnp.int32),
                                         num_pages=Ns, k=k + 1, page_size=page_size,
                                         num_sink_pages=0)                 # [B, H*S, k+1]
    ids = (local.reshape(B, H, S, k + 1)
           + (jnp.arange(S, dtype=jnp.int32) * Ns)[None, None, :, None]).reshape(B, H, -1)
    vals = jnp.take_along_axis(v, jnp.maximum(ids, 0), axis=2)
    vals = jnp.where(ids >= 0, vals, -jnp.inf)
    if merge == "xla":
        tv, ti = lax.top_k(vals, k)
        out = jnp.take_along_axis(ids, ti, axis=2)
        return jnp.where(tv == -jnp.inf, -1, out)
    M = vals.shape[2] + 1                          # + a dummy last slot (forced by the kernel)
    vals = jnp.concatenate([vals, jnp.full((B, H, 1), jnp.inf)], axis=2)
    slot = topk.select_top_pages_pallas(vals, jnp.full((B,), M, jnp.int32), num_pages=M,
                                        k=k + 1, page_size=1, num_sink_pages=0)[..., :k]
    picked = jnp.take_along_axis(vals, jnp.maximum(slot, 0), axis=2)
    out = jnp.take_along_axis(ids, jnp.maximum(slot, 0), axis=2)
    return jnp.where((slot >= 0) & (picked != -jnp.inf), out, -1)


def _measure(row: dict, result, fn, args, ref, timing: dict) -> dict:
    """``row`` with ``same_pages`` (``result(*args)`` against ``ref``) and ``us``: ``fn`` chained
    through its first argument (``_meta.time_chained``); an error is reported in the row."""
    try:
        row["same_pages"] = bool(np.array_equal(result(*args), ref))

        def body(i, c, first, *rest):
            return c + fn(first + c.astype(first.dtype) * 1e-30, *rest)[0, 0, 0]

        row["us"] = _meta.time_chained(body, jnp.int32(0), args, **timing) * 1e6
    except Exception as e:  # noqa: BLE001 - report and go on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = ap.parse_args()
    rows = []
    timing = dict(iters=2, unroll=2, reps=a.reps) if a.quick else dict(iters=16, unroll=8,
                                                                         reps=a.reps)
    shapes = QUICK if a.quick else {n: SHAPES[n] for n in a.shapes}
    for name, (B, H, N, ps, kb, cands, G) in shapes.items():
        rng = np.random.default_rng(0)
        scores = jnp.asarray(rng.normal(size=(B, H, N)), jnp.float32)
        lens = jnp.full((B,), N * ps - 5, jnp.int32)
        kw = dict(num_pages=N, page_size=ps, num_sink_pages=1)
        for C in cands:
            variants = {
                "sort": functools.partial(ds.select_top_pages, k=C, method="sort", ordered=False,
                                          **kw),
                "radix": functools.partial(ds.select_top_pages, k=C, method="radix",
                                           ordered=False, **kw),
                "radix_s8x4": functools.partial(_radix_first_stage, k=C, digits=(8,) * 4, **kw),
                "radix_c4x8": functools.partial(_radix_first_stage, k=C, digits=(4,) * 8,
                                                histogram="compare", **kw),
                "pallas": functools.partial(topk.select_top_pages_pallas, k=C, **kw),
                "pallas_two_stage": functools.partial(topk.select_top_pages_pallas, k=C,
                                                      chunk=topk._default_chunk(
                                                          topk._common.next_pow2(N), C), **kw),
                "pallas_c1_r4": functools.partial(topk.select_top_pages_pallas, k=C, chunk=1,
                                                  radix_bits=4, **kw),
                "pallas_c1_r2": functools.partial(topk.select_top_pages_pallas, k=C, chunk=1,
                                                  radix_bits=2, **kw),
                "pallas_c1_r2_w32": functools.partial(topk.select_top_pages_pallas, k=C,
                                                      chunk=1, radix_bits=2, num_warps=32,
                                                      **kw),
            }
            for S in (s for s in (2, 4, 8) if -(-N // s) > C):  # a piece holds k + 1
                for merge in ("pallas", "xla"):
                    variants[f"seg{S}_{merge}"] = functools.partial(
                        _segmented, k=C, segments=S, merge=merge, **kw)
            ref = np.sort(np.asarray(variants["sort"](scores, lens)), axis=-1)
            for S in (s for s in (4, 8, 16, 32)
                      if C % s == 0 and C // s >= 2 and -(-N // s) > C // s):
                kw_s = dict(k=C, pieces=S, ordered=False, **kw)
                fn = functools.partial(ds.select_top_pages, method="pallas", **kw_s)
                ref_s = np.sort(np.asarray(ds.select_top_pages(scores, lens, method="sort",
                                                               **kw_s)), axis=-1)
                got = np.asarray(jax.jit(fn)(scores, lens))
                recall = float(np.mean([len(np.intersect1d(g, r)) / C for g, r in
                                        zip(got.reshape(-1, C), ref.reshape(-1, C))]))
                row = dict(shape=name, op="first_stage", variant=f"pieces{S}", B=B, H=H, N=N,
                           C=C, recall=recall)
                rows.append(_measure(row, lambda *x, fn=fn: np.sort(
                    np.asarray(jax.jit(fn)(*x)), axis=-1), fn, (scores, lens), ref_s, timing))
            for vname, fn in variants.items():
                rows.append(_measure(
                    dict(shape=name, op="first_stage", variant=vname, B=B, H=H, N=N, C=C),
                    lambda *x, fn=fn: np.sort(np.asarray(jax.jit(fn)(*x)), axis=-1), fn,
                    (scores, lens), ref, timing))
            # the final choice: k of the C candidates from their page statistics
            cand = jnp.asarray(np.stack([np.stack([rng.permutation(N)[:C] for _ in range(H)])
                                         for _ in range(B)]), jnp.int32)
            m = jnp.asarray(rng.normal(size=(B, H, C, 16)) * 4, jnp.float32)
            l = jnp.asarray(rng.random((B, H, C, 16)) * 60 + 1, jnp.float32)
            skw = dict(G=G, k=kb, **kw)
            ref = np.asarray(cs.candidate_select_reference(m, l, cand, lens, **skw))
            for vname, fn in (("xla", cs.candidate_select_reference),
                              ("pallas", cs.candidate_select_pallas),
                              ("pallas_r2", functools.partial(cs.candidate_select_pallas,
                                                              radix_bits=2)),
                              ("pallas_r2_w8", functools.partial(cs.candidate_select_pallas,
                                                                 radix_bits=2, num_warps=8)),
                              ("pallas_w8", functools.partial(cs.candidate_select_pallas,
                                                              num_warps=8))):
                fn = functools.partial(fn, **skw)
                rows.append(_measure(
                    dict(shape=name, op="final_choice", variant=vname, B=B, H=H, C=C, k=kb),
                    lambda *x, fn=fn: np.asarray(jax.jit(fn)(*x)), fn, (m, l, cand, lens), ref,
                    timing))
    meta = _meta.write_rows(a.out, "first_stage_topk.json", rows)
    print(f"\n{meta}")
    print(f"{'shape':8} {'op':13} {'C':>5} {'variant':13} {'us':>8} same")
    for r in rows:
        us = f"{r['us']:8.2f}" if "us" in r else "   ERROR " + r.get("error", "")[:60]
        rec = f" recall {r['recall']:.3f}" if "recall" in r else ""
        print(f"{r['shape']:8} {r['op']:13} {r['C']:5d} {r['variant']:13} {us} "
              f"{r.get('same_pages')}{rec}")


if __name__ == "__main__":
    main()
