"""The per-step LRU ensure of the decode engine's host tier, alone, on a realistic stream.

    PYTHONPATH=. python3 benchmarks/bench_ensure.py --out DIR [--quick] [--batch 8]

Shape: the Qwen-like decode engine at batch B (28 layers, 2 KV heads x 32 selected pages per
request, 2048 pages per request, the 2x pool: B * 130 slots per layer (``--slots-per-request``),
2 pinned pages per request). Each step every (layer, request, head) keeps its selection but
for a share ``1 - overlap`` of pages drawn anew (``--overlap``, default 0.885: Quest's
step-to-step overlap on real text, docs/decisions.md), so the ensure sees the engine's
misses and evictions. Variants: ``auto`` (``lru.ensure``'s default method), ``dense``,
``sort``, ``pallas`` (the one-launch kernel; sizes over its cap are skipped) and
``pallas_w<n>`` (the kernel with ``n`` warps). The figure is the time per step of a jitted
``fori_loop`` over the stream (median of ``--reps`` runs), and the hits / misses / dropped
per step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # noqa: E402
from bench_fetch import _ensure_fn  # noqa: E402
from jaxkv import lru  # noqa: E402


def stream(rng, T, L, B, H, k, Np, overlap, Q):
    """Requests [T, L, B * H * k] (request b's pages are b * Np + page) and protect
    [L, B * Q] (each request's first page and one recent page)."""
    sel = np.stack([rng.permutation(Np)[:k] for _ in range(L * B * H)]).reshape(L, B, H, k)
    out = []
    for _ in range(T):
        new = rng.integers(0, Np, sel.shape)
        sel = np.where(rng.random(sel.shape) < overlap, sel, new)
        out.append(sel + (np.arange(B) * Np)[None, :, None, None])
    prot = np.stack([np.arange(B) * Np, np.arange(B) * Np + Np - 1], axis=1)  # [B, Q=2]
    prot = np.broadcast_to(prot[:, :Q].reshape(-1), (L, B * Q))
    return (jnp.asarray(np.stack(out).reshape(T, L, -1), jnp.int32),
            jnp.asarray(prot, jnp.int32))


def ensure_fn(name):
    """(pt, so, lu, req, prot, step) -> lru.EnsureResult for variant ``name``: a method, or
    ``pallas_w<n>`` (the kernel with ``n`` warps), as bench_fetch's ensure variants."""
    method, *rest = name.split("_")
    return _ensure_fn(method, int(rest[0][1:]) if rest else None)


def _variant_names(text: str) -> list:
    """--variants: lru.ensure's methods, or ``pallas_w<n>`` (the kernel with n warps); an
    unknown name is an argparse error naming it before anything runs."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not re.fullmatch(r"auto|dense|sort|pallas(_w[1-9][0-9]*)?", n)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown variants {bad or text!r} (choose from auto, "
                                         "dense, sort, pallas, pallas_w<warps>)")
    return names


def time_variant(fn, reqs, prot, L, P, S, reps):
    T = reqs.shape[0]

    @jax.jit
    def run(reqs, prot):
        def body(t, carry):
            pt, so, lu, n = carry
            r = fn(pt, so, lu, reqs[t], prot, t)
            return r.page_table, r.slot_owner, r.last_used, n + jnp.stack(
                [r.hits, r.misses, r.dropped])
        init = (jnp.full((L, P), -1, jnp.int32), jnp.full((L, S), -1, jnp.int32),
                jnp.full((L, S), -1, jnp.int32), jnp.zeros(3, jnp.int32))
        return jax.lax.fori_loop(0, T, body, init)[3]

    counts = run(reqs, prot)
    return _meta.time_calls(run, (reqs, prot), reps) / T * 1e6, (np.asarray(counts) / T).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--overlap", type=float, default=0.885)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slots-per-request", type=int, default=130,
                    help="pool slots per request and layer (130: the engine's 2x pool)")
    ap.add_argument("--variants", default="auto,dense,sort,pallas", type=_variant_names,
                    help="comma-separated: auto, dense, sort, pallas or pallas_w<warps>")
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    L, H, k, Np, Q = (2, 2, 4, 64, 2) if a.quick else (28, 2, 32, 2048, 2)
    B, Sp = a.batch, (12 if a.quick else a.slots_per_request)
    T = 4 if a.quick else a.steps
    P, S = B * Np, B * Sp
    reqs, prot = stream(np.random.default_rng(0), T, L, B, H, k, Np, a.overlap, Q)
    rows = []
    for name in a.variants:
        if (not gpu and "_w" in name) or (name.startswith("pallas")
                                           and max(B * H * k, S, B * Q) > lru.PALLAS_MAX):
            continue
        us, (hits, misses, dropped) = time_variant(ensure_fn(name), reqs, prot, L, P, S, a.reps)
        rows.append(dict(variant=name, us_per_step=us, hits_per_step=hits,
                         misses_per_step=misses, dropped_per_step=dropped))
        print(f"{name:18s} {us:8.1f} us/step  hits {hits:7.1f}  misses {misses:6.1f}  "
              f"dropped {dropped:5.1f}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        out = dict(benchmark="bench_ensure", device=str(jax.devices()[0].device_kind),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   commit=_meta.commit(), jax_version=jax.__version__, quick=a.quick,
                   layers=L, batch=B, kv_heads=H, k=k, pages_per_request=Np,
                   slots_per_request=Sp, protect_per_request=Q, overlap=a.overlap, steps=T,
                   reps=a.reps, auto_method=lru.resolve_method("auto", B * H * k, S, B * Q),
                   rows=rows)
        with open(os.path.join(a.out, "bench_ensure.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
