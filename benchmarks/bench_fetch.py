"""Host -> device page fetch bandwidth (fetch_pages), write-through cost, zero-miss step cost.

Run on the H200:  PYTHONPATH=. python3 benchmarks/bench_fetch.py --out benchmarks/results
Smoke test (CPU, interpret mode, seconds):  PYTHONPATH=. python3 benchmarks/bench_fetch.py --quick --out /tmp/bf

Every fetch measurement is a jitted ``lax.fori_loop`` of ``steps`` steps, each one launch of
``fetch_pages`` with fresh random distinct source rows (of a >= 2 GiB pinned_host array,
so nothing is cached) and a random permutation of destination pool rows; the time is the
median of several calls divided by ``steps``. Bandwidths are compared with bulk
``device_put`` pinned_host -> device of a 1 GiB array measured in the same run (before and
after; the mean is the reference). Sections, in order (a time budget skips the rest):

1. targets: kernel variants swept at the target points (8 KV heads x 128, bf16):
   256 x 64 KiB (>= 95% of bulk), 256 x 128 KiB (>= 95%), 2048 x 4 KiB (>= 90%),
   256 x 8 KiB (>= 75%). Also per point: the loop floor (same launch, all entries -1),
   the default variant reading a device array, and the jnp reference ("xla") once.
2. write-through: write_tokens of one token for 32 layers (8x128 bf16) per step into the
   pinned_host tier (and into a device pool, and the jnp reference), inside a jitted loop.
3. ensure: a zero-miss step of jaxkv.lru.ensure + fetch_pages for 32 layers x 32 pages.
4. grid: page sizes 16/32/64/128 x 8..4096 missed pages x head shapes 8x128 and 3x64
   (bf16), default variant and the naive one-page-per-program baseline.

``--only-steady``: the per-step slope of the fetch loop at the target points (call time
fitted over 8-64 steps per call), of XLA's DMA of a step-sized block, of a fetch between
bursts of device-only work, and of bulk ``device_put`` over 128 MiB-1 GiB. Median call time /
steps (the sections above) also carries each call's fixed cost (dispatch, loop start, final
sync); the slope is what a fetch costs inside a long compiled loop such as the decode loop.

Writes ``bench_fetch.json`` and ``bench_fetch.png`` to --out; prints a short table last.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxkv.kernels import page_fetch, page_write

KiB, MiB, GiB = 1024, 1024**2, 1024**3
DEV0 = jax.devices()[0]
HOST = SingleDeviceSharding(DEV0, memory_kind="pinned_host")
DEVICE = SingleDeviceSharding(DEV0, memory_kind="device")
HEADS = {"8x128": (8, 128), "3x64": (3, 64)}


# Fetches (or ensure steps) per loop iteration: a GPU loop iteration costs ~10 us
# (docs/decisions.md), spread over them.
UNROLL = 4


def _variants(itemsize: int) -> dict[str, dict]:
    """Sweep set at the target points: name -> fetch_pages tunables.

    ``cNk``: N KiB per entry per load; ``eN``: N entries (pages) per program, loads issued
    before stores; ``kN``: N chunk columns walked sequentially per program; ``wN``: warps.
    """
    c = lambda kib: kib * KiB // itemsize
    v = {
        "default": {},
        "naive": page_fetch.naive_tuning(),
        "naive_w8": dict(page_fetch.naive_tuning(), num_warps=8),
    }
    for e, kib, w in [(1, 2, 4), (1, 4, 4), (1, 8, 4), (1, 16, 8), (1, 32, 8), (2, 8, 4), (2, 16, 8),
                      (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 4, 8)]:
        v[f"e{e}_c{kib}k_w{w}"] = dict(pages_per_program=e, chunk_elems=c(kib),
                                       chunks_per_program=1, num_warps=w)
    v["e1_c16k_k4_w8"] = dict(pages_per_program=1, chunk_elems=c(16), chunks_per_program=4,
                              num_warps=8)
    return v


# ------------------------------------------------------------------------------ helpers
def _commit() -> str:
    from _meta import commit  # benchmarks/ is on sys.path when the script runs
    return commit()


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _pattern(n, row, dtype, row0=0):
    r = jax.lax.broadcasted_iota(jnp.int32, (n, row), 0) + row0
    c = jax.lax.broadcasted_iota(jnp.int32, (n, row), 1)
    return ((r * 7 + c) % 251).astype(dtype)


def pattern_rows(rows, row):
    """numpy values of the fill pattern for the given rows: [len(rows), row] float32."""
    rows = np.asarray(rows, np.int64)[:, None]
    return ((rows * 7 + np.arange(row)[None, :]) % 251).astype(np.float32)


def make_array(n, row, dtype, sharding):
    """[n, row] array with the fill pattern, built directly with the given sharding."""
    space = jax.memory.Space.Host if sharding.memory_kind == "pinned_host" else None
    # ending with device_put(..., Space.Host) types the result as host memory (loop carries)
    fill = jax.jit(lambda: jax.device_put(_pattern(n, row, dtype), space) if space
                   else _pattern(n, row, dtype), out_shardings=sharding)
    x = fill()
    x.block_until_ready()
    return x


def median_time(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds = time.perf_counter(), seconds
        self.skipped = []

    def elapsed(self):
        return time.perf_counter() - self.t0

    def ok(self, what):
        if self.elapsed() < self.seconds:
            return True
        self.skipped.append(what)
        return False


# ------------------------------------------------------------------------------ bulk
def bench_bulk(nbytes, reps):
    n = nbytes // (4 * KiB)
    x = make_array(n, 2 * KiB, jnp.bfloat16, HOST)
    t = median_time(lambda: jax.device_put(x, DEVICE), reps)
    x.delete()
    return dict(bytes=n * 4 * KiB, seconds=t, GBps=n * 4 * KiB / t / 1e9)


# ------------------------------------------------------------------------------ fetch loop
@functools.lru_cache(maxsize=None)
def _fetch_loop(steps, impl, tuning_items):
    tuning = dict(tuning_items)

    unroll = UNROLL if steps % UNROLL == 0 else 1

    def run(src_arr, pool, src_tab, dst_tab):
        def body(t, pool):
            for u in range(unroll):  # back-to-back launches, the loop's cost spread over them
                pool = page_fetch.fetch_pages(src_arr, pool, src_tab[t * unroll + u],
                                              dst_tab[t * unroll + u], implementation=impl, **tuning)
            return pool
        return jax.lax.fori_loop(0, steps // unroll, body, pool)

    return jax.jit(run, donate_argnums=1)


def big_copies(f, *args, min_bytes=MiB):
    """Copy instructions of at least ``min_bytes`` in the compiled HLO of ``f(*args)``: an
    in-place fetch loop has none (a copy of the pool or host array would be a bug)."""
    import re
    sizes = dict(bf16=2, f16=2, f32=4, s32=4, u8=1, s8=1)
    out = []
    for line in f.lower(*args).compile().as_text().splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* copy(-start)?\(", line)
        if m and m.group(1) in sizes:
            n = sizes[m.group(1)] * int(np.prod([int(x) for x in m.group(2).split(",") if x]))
            if n >= min_bytes:
                out.append(line.strip()[:160])
    return out


def source_rows(rng, n_src, M, steps, mode="random", span=None):
    """[steps, M] distinct source rows per step.

    mode: "random" (uniform over the first ``span`` rows, default all, in random order),
    "sorted" (the same draw in ascending order) or "contiguous" (M consecutive rows from a
    random start, in random order)."""
    n = n_src if span is None else min(int(span), n_src)
    if mode == "contiguous":
        starts = rng.integers(0, n - M + 1, steps)
        return np.stack([s + rng.permutation(M) for s in starts])
    tab = np.stack([rng.choice(n, M, replace=False) for _ in range(steps)])
    return np.sort(tab, axis=1) if mode == "sorted" else tab


def time_donating(f, src, buf, *rest, reps):
    """Median seconds of ``buf = f(src, buf, *rest)`` (``buf`` donated, so each call feeds
    the next). Returns (seconds, the last ``buf``)."""
    box = [buf]

    def call():
        box[0] = f(src, box[0], *rest)
        return box[0]

    return median_time(call, reps), box[0]


def fetch_point(src_arr, M, *, steps, reps, rng, tuning=None, impl="pallas", empty=False,
                check=True, check_copies=False, src_mode="random", span=None):
    """Time ``steps`` fetches of M distinct rows (``source_rows``); returns a result dict."""
    n_src, row = src_arr.shape
    itemsize = jnp.dtype(src_arr.dtype).itemsize
    tuning = dict(tuning or {})
    src_tab = source_rows(rng, n_src, M, steps, src_mode, span)
    dst_tab = np.stack([rng.permutation(M) for _ in range(steps)])
    if empty:
        src_tab[:] = -1
    src_tab = jnp.asarray(src_tab, jnp.int32)
    dst_tab = jnp.asarray(dst_tab, jnp.int32)
    pool = jnp.zeros((M, row), src_arr.dtype, device=DEVICE)
    f = _fetch_loop(steps, impl, tuple(sorted(tuning.items())))
    t0 = time.perf_counter()
    pool = f(src_arr, pool, src_tab, dst_tab)
    pool.block_until_ready()
    first = time.perf_counter() - t0
    copies = big_copies(f, src_arr, pool, src_tab, dst_tab) if check_copies else None
    t, pool = time_donating(f, src_arr, pool, src_tab, dst_tab, reps=reps)
    t /= steps
    ok = None
    if check and not empty:
        k = np.array([0, M // 2, M - 1])
        d = np.asarray(dst_tab[-1])[k]
        s = np.asarray(src_tab[-1])[k]
        got = np.asarray(pool[jnp.asarray(d)].astype(jnp.float32))
        ok = bool(np.array_equal(got, pattern_rows(s, row)))
    pool.delete()
    nbytes = M * row * itemsize
    res = dict(M=M, page_bytes=row * itemsize, us_per_step=t * 1e6, steps=steps,
               first_call_s=first, correct=ok)
    if copies is not None:
        res["hlo_big_copies"] = copies
    if not empty:
        res["GBps"] = nbytes / t / 1e9
    if impl == "pallas":
        res["tuning"] = page_fetch.resolve_tuning(M, row, itemsize, **tuning).__dict__
    return res


def steps_for(step_bytes, quick):
    if quick:
        return UNROLL
    n = int(min(48, max(4, -(-256 * MiB // step_bytes))))
    return -(-n // UNROLL) * UNROLL


# ------------------------------------------------------------------------------ sections
TARGETS = [  # (name, page_size, M, target fraction of bulk), 8 KV heads x 128 bf16
    ("256x64KiB", 16, 256, 0.95),
    ("256x128KiB", 32, 256, 0.95),
    ("2048x4KiB", 1, 2048, 0.90),
    ("256x8KiB", 2, 256, 0.75),
]


def section_targets(cfg, bulk_gbps, budget, rng):
    H, D = HEADS["8x128"]
    out = []
    variants = _variants(2)
    if cfg.quick:
        variants = {k: variants[k] for k in ("default", "naive", "e4_c4k_w8")}
    for name, ps, M, frac in cfg.targets:
        if not budget.ok(f"targets {name}"):
            continue
        row = 2 * H * ps * D
        host = make_array(max(cfg.host_bytes // (row * 2), 2 * M), row, jnp.bfloat16, HOST)
        steps = steps_for(M * row * 2, cfg.quick)
        seen, rows = {}, []
        for vname, tun in variants.items():
            eff = page_fetch.resolve_tuning(M, row, 2, **tun)
            if eff in seen:
                seen[eff]["aliases"].append(vname)
                continue
            if not budget.ok(f"targets {name} {vname}"):
                break
            try:
                r = fetch_point(host, M, steps=steps, reps=cfg.reps, rng=rng, tuning=tun,
                                check_copies=vname == "default")
            except Exception as e:  # noqa: BLE001
                r = dict(M=M, error=f"{type(e).__name__}: {str(e)[:300]}")
            r.update(variant=vname, aliases=[])
            if "GBps" in r:
                r["frac_of_bulk"] = r["GBps"] / bulk_gbps
            seen[eff] = r
            rows.append(r)
        point = dict(name=name, page_size=ps, M=M, page_bytes=row * 2, target=frac,
                     variants=rows)
        good = [r for r in rows if r.get("GBps") and r.get("correct") is not False]
        if good:
            best = max(good, key=lambda r: r["GBps"])
            point["best"] = best["variant"]
            point["best_GBps"] = best["GBps"]
            point["best_frac"] = best["GBps"] / bulk_gbps
        for extra, kw in (("floor_default", dict(empty=True)),
                          ("floor_naive", dict(empty=True, tuning=variants["naive"]))):
            if budget.ok(f"targets {name} {extra}"):
                try:
                    point[extra + "_us"] = fetch_point(
                        host, M, steps=steps, reps=cfg.reps, rng=rng, **kw)["us_per_step"]
                except Exception as e:  # noqa: BLE001
                    point[extra + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if budget.ok(f"targets {name} device source"):
            dev = make_array(min(host.shape[0], 4 * M), row, jnp.bfloat16, DEVICE)
            try:
                r = fetch_point(dev, M, steps=steps, reps=cfg.reps, rng=rng)
                point["device_src_GBps"] = r["GBps"]
            except Exception as e:  # noqa: BLE001
                point["device_src_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            dev.delete()
        if name == cfg.targets[0][0] and budget.ok(f"targets {name} xla"):
            try:
                r = fetch_point(host, min(M, 64), steps=2, reps=1, rng=rng, impl="xla")
                point["xla_reference"] = r
            except Exception as e:  # noqa: BLE001
                point["xla_reference"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        host.delete()
        out.append(point)
    return out


def recommend(targets, bulk_gbps):
    """Variant maximizing the worst (GB/s / target GB/s) over the target points."""
    score = {}
    for p in targets:
        for r in p["variants"]:
            for name in [r["variant"]] + r.get("aliases", []):
                g = r.get("GBps") if r.get("correct") is not False else None
                score.setdefault(name, []).append((g or 0.0) / (p["target"] * bulk_gbps))
    n = len(targets)
    full = {k: min(v) for k, v in score.items() if len(v) == n}
    if not full:
        return None
    best = max(full, key=full.get)
    return dict(variant=best, worst_ratio_to_target=full[best],
                default_worst_ratio=full.get("default"), naive_worst_ratio=full.get("naive"))


def _write_loop(T, L, P, ps, impl, on_host):
    def run(dst, kv):
        def body(t, dst):
            rows = jnp.arange(L, dtype=jnp.int32) * P + (t // ps) % P
            dst = page_write.write_tokens(dst, rows, jnp.full((L,), t % ps, jnp.int32),
                                          kv[t % kv.shape[0]], page_size=ps, implementation=impl)
            return page_write.keep_on_host(dst) if on_host else dst
        return jax.lax.fori_loop(0, T, body, dst)
    return run


def section_write_through(cfg, budget, rng):
    L, (H, D), ps = cfg.layers, HEADS["8x128"], cfg.small_page_size
    row = 2 * H * ps * D
    P = max(1, cfg.host_bytes // (row * 2) // L)
    T = 4 if cfg.quick else 64
    kv = jnp.asarray(rng.standard_normal((8, L, 2, H, D)), jnp.bfloat16)
    out = dict(layers=L, heads="8x128", page_size=ps, steps=T, host_rows=L * P)
    for label, impl, on_host in (("host_pallas", "pallas", True), ("device_pallas", "pallas", False),
                                 ("host_xla", "xla", True)):
        if not budget.ok(f"write-through {label}"):
            continue
        n = L * P if on_host else L * min(P, 64)
        steps = T if impl == "pallas" else min(T, 8)
        try:
            dst = make_array(n, row, jnp.bfloat16, HOST if on_host else DEVICE)
            f = jax.jit(_write_loop(steps, L, n // L, ps, impl, on_host), donate_argnums=0,
                        out_shardings=HOST if on_host else DEVICE)
            box = [f(dst, kv)]
            box[0].block_until_ready()

            def call():
                box[0] = f(box[0], kv)
                return box[0]

            t = median_time(call, cfg.reps) / steps
            out[label + "_us_per_token"] = t * 1e6
            out[label + "_GBps"] = L * 2 * H * D * 2 / t / 1e9
            box[0].delete()
        except Exception as e:  # noqa: BLE001
            out[label + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _ensure_fn(method, num_warps=None):
    """(pt, so, lu, req, prot, step) -> lru.EnsureResult: ``lru.ensure(method=...)``, or the
    Pallas kernel with a given warp count (a tuning variant)."""
    from jaxkv import lru
    from jaxkv.kernels import lru_ensure

    if num_warps is None:
        return lambda *a: lru.ensure(*a, method=method)

    def fn(pt, so, lu, req, prot, step):
        pay = jnp.full(req.shape, -1, jnp.int32)
        pt, so, lu, slots, src, dst, pay, counts = lru_ensure.ensure_layers_pallas(
            pt, so, lu, req, prot, pay, step, num_warps=num_warps)
        c = jnp.sum(counts, axis=0)
        return lru.EnsureResult(pt, so, lu, slots, src, dst, pay, c[0], c[1], c[2], c[3])
    return fn


def _zero_miss_case(L, K, S, Q, ps, T, reps, rng, variants, host_rows=None):
    """Time a zero-miss decode step's ensure (+ fetch) for L layers x K requested pages (all
    resident in S slots), 8 KV heads x 128 bf16 pages of ``ps`` tokens.

    variants: {name: (ensure_fn, with_fetch, fetch tuning dict or None)}; also times the fetch
    launch alone with an all -1 (empty) entry list. Returns {name_us_per_step, name_misses}."""
    (H, D) = HEADS["8x128"]
    row = 2 * H * ps * D
    P = max(S, host_rows or S)
    host = make_array(L * P, row, jnp.bfloat16, HOST)
    pool = jax.jit(lambda: jnp.zeros((L * S, row), jnp.bfloat16), out_shardings=DEVICE)()
    pt = np.full((L, P), -1, np.int32)
    pt[:, :S] = np.arange(S)
    so = np.tile(np.arange(S, dtype=np.int32), (L, 1))
    lu = np.zeros((L, S), np.int32)
    reqs = np.stack([np.stack([rng.choice(S, K, replace=False) for _ in range(L)])
                     for _ in range(8)]).astype(np.int32)
    protect = jnp.full((L, Q), -1, jnp.int32)
    lcol = jnp.arange(L, dtype=jnp.int32)[:, None]
    out = {}

    def run(host, state, pool, reqs, ensure_fn, with_fetch, tuning):
        def one(t, carry):
            (pt, so, lu, misses), pool = carry
            if ensure_fn is None:  # the fetch launch alone, nothing to move
                e = jnp.full((L * K,), -1, jnp.int32) + (t - t)
                pool = page_fetch.fetch_pages(host, pool, e, e, implementation="pallas",
                                              **(tuning or {}))
                return (pt, so, lu, misses), pool
            res = ensure_fn(pt, so, lu, reqs[t % reqs.shape[0]], protect, t + 1)
            if with_fetch == "layers":  # per-layer lists: work proportional to the misses
                pool = page_fetch.fetch_layer_pages(host, pool, res.fetch_src, res.fetch_dst,
                                                    src_stride=P, dst_stride=S,
                                                    implementation="pallas", **(tuning or {}))
            elif with_fetch:
                src = jnp.where(res.fetch_src >= 0, lcol * P + res.fetch_src, -1).reshape(-1)
                dst = jnp.where(res.fetch_dst >= 0, lcol * S + res.fetch_dst, -1).reshape(-1)
                pool = page_fetch.fetch_pages(host, pool, src, dst, implementation="pallas",
                                              **(tuning or {}))
            return (res.page_table, res.slot_owner, res.last_used, misses + res.misses), pool

        def body(t, carry):  # UNROLL steps per iteration: the loop's cost spread over them
            for u in range(UNROLL):
                carry = one(t * UNROLL + u, carry)
            return carry
        return jax.lax.fori_loop(0, T // UNROLL, body, (state, pool))

    variants = dict(variants, fetch_only_empty=(None, True, None))
    for name, (ensure_fn, wf, tuning) in variants.items():
        try:
            f = jax.jit(functools.partial(run, ensure_fn=ensure_fn, with_fetch=wf,
                                          tuning=tuning), donate_argnums=2)
            state = (jnp.asarray(pt), jnp.asarray(so), jnp.asarray(lu), jnp.int32(0))
            box = [f(host, state, pool, jnp.asarray(reqs))]
            jax.block_until_ready(box[0])

            def call():
                box[0] = f(host, state, box[0][1], jnp.asarray(reqs))
                return box[0]

            out[name + "_us_per_step"] = median_time(call, reps) / T * 1e6
            out[name + "_misses"] = int(box[0][0][3])
            pool = box[0][1]
        except Exception as e:  # noqa: BLE001
            out[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-600:]}"
    host.delete()
    return out


def section_ensure(cfg, budget, rng):
    try:
        from jaxkv import lru
    except Exception as e:  # noqa: BLE001
        return dict(error=f"jaxkv.lru unavailable: {e}")
    if not budget.ok("ensure"):
        return dict(skipped=True)
    L, K, S, Q = cfg.layers, cfg.ensure_pages, 2 * cfg.ensure_pages, 4
    ps = cfg.small_page_size
    T = UNROLL if cfg.quick else 64 * UNROLL  # 256 steps per call: dispatch cost < 1 %
    # The LRU implementations (jaxkv.lru: "dense" = sort-free compare matrices, "sort",
    # "pallas" = "dense" as one Triton kernel for all layers; interpret mode off the GPU);
    # keys are suffixed with the method; "auto" picks the one named in ``auto_method``.
    # Variants: the kernel's warp count (``_w<n>``), the fetch launch's tuning for this
    # all-empty case (``_fe<E>``: E entries per program; ``row``: whole-row chunks) and
    # ``_layers``: fetch_layer_pages on the per-layer lists (what the engine runs).
    methods = ("dense", "sort", "pallas")
    variants = {}
    for m in methods:
        variants[f"ensure_only_{m}"] = (_ensure_fn(m), False, None)
        variants[f"ensure_fetch_{m}"] = (_ensure_fn(m), True, None)
    for w in (1, 2, 8):
        variants[f"ensure_only_pallas_w{w}"] = (_ensure_fn("pallas", w), False, None)
    variants["ensure_fetch_pallas_layers"] = (_ensure_fn("pallas"), "layers", None)
    variants["ensure_fetch_dense_layers"] = (_ensure_fn("dense"), "layers", None)
    for tag, tun in (("fe8", dict(pages_per_program=8)),
                     ("fe8row", dict(pages_per_program=8, chunk_elems=0))):
        variants[f"ensure_fetch_pallas_{tag}"] = (_ensure_fn("pallas"), True, tun)
    P = max(S, cfg.host_bytes // (2 * 2 * 8 * ps * 128 * 2) // L)
    out = dict(layers=L, pages_per_layer=K, slots=S, steps=T, page_size=ps,
               auto_method=lru.resolve_method("auto", K, S, Q))
    out.update(_zero_miss_case(L, K, S, Q, ps, T, cfg.reps, rng, variants, host_rows=P))
    # the summary table reads one miss count (zero for this zero-miss stream, every method)
    out["ensure_fetch_misses"] = out.get(f"ensure_fetch_{out['auto_method']}_misses")
    print(f"ensure ({L} layers x {K} pages, {S} slots, us/step; auto = {out['auto_method']}): "
          + ", ".join(f"{k[:-12]} {v:.1f}" for k, v in out.items()
                      if k.endswith("_us_per_step")), flush=True)
    # The engine's shape (8B-like, B=1: 8 heads x 32 pages + 4 pinned requests per layer,
    # 2x pool, 64-token pages): what a zero-miss step's ensure and install launch cost there.
    if not cfg.quick and budget.ok("ensure engine shape"):
        Ke, Qe = 8 * 32 + 4, 4
        Se = 2 * Ke
        auto = lru.resolve_method("auto", Ke, Se, Qe)
        ev = {f"ensure_only_{auto}": (_ensure_fn(auto), False, None),
              f"ensure_fetch_{auto}": (_ensure_fn(auto), True, None),
              f"ensure_fetch_{auto}_layers": (_ensure_fn(auto), "layers", None)}
        eng = dict(layers=L, pages_per_layer=Ke, slots=Se, page_size=64, auto_method=auto)
        eng.update(_zero_miss_case(L, Ke, Se, Qe, 64, 16 * UNROLL, cfg.reps, rng, ev))
        out["engine_8b_b1"] = eng
        print(f"engine-shape zero-miss step ({L} x {Ke} requests, {Se} slots, 64-token pages,"
              f" us/step): " + ", ".join(f"{k[:-12]} {v:.1f}" for k, v in eng.items()
                                          if k.endswith("_us_per_step")), flush=True)
    return out


def section_grid(cfg, bulk_gbps, budget, rng, variant):
    out = []
    tuning = _variants(2)[variant]
    for head in cfg.heads:
        if variant == "naive" and head not in cfg.naive_heads:
            continue
        H, D = HEADS[head]
        for ps in (cfg.naive_page_sizes if variant == "naive" else cfg.page_sizes):
            row = 2 * H * ps * D
            if not budget.ok(f"grid {variant} {head} ps{ps}"):
                continue
            host = make_array(cfg.host_bytes // (row * 2), row, jnp.bfloat16, HOST)
            for M in cfg.Ms:
                step_bytes = M * row * 2
                if M > host.shape[0] or step_bytes > cfg.max_step_bytes:
                    continue
                if not budget.ok(f"grid {variant} {head} ps{ps} M{M}"):
                    break
                try:
                    r = fetch_point(host, M, steps=steps_for(step_bytes, cfg.quick),
                                    reps=cfg.grid_reps, rng=rng, tuning=tuning)
                    r["frac_of_bulk"] = r["GBps"] / bulk_gbps
                except Exception as e:  # noqa: BLE001
                    r = dict(M=M, page_bytes=row * 2, error=f"{type(e).__name__}: {str(e)[:300]}")
                r.update(head=head, page_size=ps, variant=variant)
                out.append(r)
            host.delete()
    return out


def dma_in_program(host, step_rows, steps, reps):
    """GB/s of XLA's own host->device copies (the DMA engine) inside one jitted loop: each
    iteration copies ``step_rows`` contiguous rows of the pinned ``host`` array (a different
    block each time) into a donated device buffer. The same sizes as a fetch step, without
    the kernel: what PCIe gives a copy of that size inside a compiled program."""
    n_blocks = host.shape[0] // step_rows

    def run(host, dst):
        def body(i, dst):
            blk = lax.dynamic_slice_in_dim(host, (i % n_blocks) * step_rows, step_rows, 0)
            return lax.dynamic_update_slice(dst, jax.device_put(blk, jax.memory.Space.Device),
                                            (0, 0))
        return lax.fori_loop(0, steps, body, dst)

    f = jax.jit(run, donate_argnums=1)
    dst = f(host, jnp.zeros((step_rows, host.shape[1]), host.dtype, device=DEVICE))  # compile
    t, dst = time_donating(f, host, dst, reps=reps)
    t /= steps
    ok = bool(np.array_equal(np.asarray(dst[:1].astype(jnp.float32)),
                             pattern_rows([((steps - 1) % n_blocks) * step_rows], host.shape[1])))
    dst.delete()
    return dict(step_bytes=step_rows * host.shape[1] * host.dtype.itemsize, us_per_step=t * 1e6,
                GBps=step_rows * host.shape[1] * host.dtype.itemsize / t / 1e9, correct=ok)


def section_locality(cfg, bulk_gbps, budget, rng):
    """Does the fetch rate depend on where the pages lie in the host tier? The target steps
    (default tuning) with sources drawn uniformly over the whole tier, over its first 32 MiB,
    sorted, or as one contiguous run. A GPU that pays per host page translation (TLB reach)
    reads clustered or contiguous sources faster than scattered ones. Last, XLA's own DMA copy
    of a step's bytes inside a compiled loop (``dma_in_program``), for comparison."""
    H, D = HEADS["8x128"]
    out = []
    for name, ps, M, frac in cfg.targets:
        row = 2 * H * ps * D
        host = make_array(max(cfg.host_bytes // (row * 2), 2 * M), row, jnp.bfloat16, HOST)
        steps = steps_for(M * row * 2, cfg.quick)
        span32 = max(M, 32 * MiB // (row * 2))
        for mode, span in (("random", None), ("random", span32), ("sorted", None),
                           ("contiguous", None), ("random", None)):
            label = mode if span is None else f"{mode}_32MiB"
            if not budget.ok(f"locality {name} {label}"):
                continue
            r = fetch_point(host, M, steps=steps, reps=cfg.reps, rng=rng, src_mode=mode, span=span)
            r.update(point=name, mode=label, frac_of_bulk=r["GBps"] / bulk_gbps,
                     host_rows=host.shape[0])
            print(f"locality {name:>10} {label:>17}: {r['GBps']:6.2f} GB/s "
                  f"({r['frac_of_bulk']:.3f} of bulk) correct={r['correct']}", flush=True)
            out.append(r)
        if budget.ok(f"locality {name} dma"):
            try:
                r = dma_in_program(host, M, steps=steps, reps=cfg.reps)
                r.update(point=name, mode="dma_in_program", frac_of_bulk=r["GBps"] / bulk_gbps)
                print(f"locality {name:>10} {'dma_in_program':>17}: {r['GBps']:6.2f} GB/s "
                      f"({r['frac_of_bulk']:.3f} of bulk) correct={r['correct']}", flush=True)
            except Exception as e:  # noqa: BLE001
                r = dict(point=name, mode="dma_in_program", error=f"{type(e).__name__}: {str(e)[:300]}")
                print(f"locality {name} dma_in_program FAILED: {r['error']}", flush=True)
            out.append(r)
        host.delete()
    return out


# ------------------------------------------------------------------------------ steady state
STEADY_STEPS = (8, 16, 32, 64)   # fetch steps per call, for the per-step slope
STEADY_BULK_MIB = (128, 256, 512, 1024)


def fit_line(xs, ys):
    """Least squares ``y = a + b * x``: returns (a, b, r2)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    A = np.stack([np.ones_like(x), x], 1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    ss = float(((y - A @ np.array([a, b])) ** 2).sum())
    tot = float(((y - y.mean()) ** 2).sum())
    return float(a), float(b), (1.0 - ss / tot) if tot > 0 else 1.0


def fit_calls(calls):
    """Fit ``call_us = fixed_us + steps * us_per_step`` over ``calls`` (dicts with ``steps``
    and ``call_us``); returns ``dict(fixed_us, us_per_step, r2)``."""
    a, b, r2 = fit_line([c["steps"] for c in calls], [c["call_us"] for c in calls])
    return dict(fixed_us=a, us_per_step=b, r2=r2)


def steady_bulk(sizes_mib, reps):
    """Bulk ``device_put`` at several sizes; seconds = fixed + bytes / GBps (the marginal
    rate, without the per-call cost that a single size folds into its figure)."""
    rows = [bench_bulk(m * MiB, reps) for m in sizes_mib]
    a, b, r2 = fit_line([r["bytes"] for r in rows], [r["seconds"] for r in rows])
    return dict(calls=rows, fixed_us=a * 1e6, GBps=1e-9 / b, r2=r2)


def steady_fetch(host, M, *, steps_list, reps, rng, tuning=None, empty=False):
    """Call time of a loop of ``steps`` fetches for each ``steps`` in ``steps_list``, fitted
    as call = fixed + steps * per_step: ``us_per_step`` is what one more fetch step costs
    inside a compiled loop (the decode step's situation), ``fixed_us`` the per-call cost
    (dispatch, the loop's start and the final sync) that ``fetch_point`` spreads over its
    steps."""
    calls = []
    for steps in steps_list:
        r = fetch_point(host, M, steps=steps, reps=reps, rng=rng, tuning=tuning, empty=empty)
        calls.append(dict(steps=steps, call_us=r["us_per_step"] * steps, correct=r["correct"]))
    nbytes = M * host.shape[1] * host.dtype.itemsize
    out = dict(M=M, page_bytes=host.shape[1] * host.dtype.itemsize, calls=calls,
               **fit_calls(calls), correct=all(c["correct"] is not False for c in calls))
    if not empty:
        out["GBps"] = nbytes / out["us_per_step"] / 1e3
    return out


def steady_dma(host, step_rows, *, steps_list, reps):
    """``dma_in_program`` at several loop lengths, fitted like ``steady_fetch``."""
    calls = []
    for steps in steps_list:
        r = dma_in_program(host, step_rows, steps, reps)
        calls.append(dict(steps=steps, call_us=r["us_per_step"] * steps, correct=r["correct"]))
    nbytes = step_rows * host.shape[1] * host.dtype.itemsize
    fit = fit_calls(calls)
    return dict(step_bytes=nbytes, calls=calls, **fit, GBps=nbytes / fit["us_per_step"] / 1e3,
                correct=all(c["correct"] for c in calls))


def dma_gather_in_program(host, M, *, steps_list, reps, rng):
    """The copy engine as a gather: each loop iteration copies M scattered rows of the pinned
    ``host`` array, one XLA host->device copy per row (``dynamic_slice`` + ``device_put``,
    unrolled in the loop body), into a donated device pool; fitted like ``steady_fetch``.
    What the DMA path gives a fetch step, since one XLA copy moves one contiguous block."""
    n_src, row = host.shape

    def run(host, pool, src_tab, dst_tab):
        def body(t, pool):
            for m in range(M):
                blk = lax.dynamic_slice_in_dim(host, src_tab[t, m], 1, 0)
                pool = lax.dynamic_update_slice(
                    pool, jax.device_put(blk, jax.memory.Space.Device), (dst_tab[t, m], 0))
            return pool
        return lax.fori_loop(0, src_tab.shape[0], body, pool)

    f = jax.jit(run, donate_argnums=1)
    calls, ok = [], True
    for steps in steps_list:
        src = source_rows(rng, n_src, M, steps)
        dst = np.stack([rng.permutation(M) for _ in range(steps)])
        pool = f(host, jnp.zeros((M, row), host.dtype, device=DEVICE), jnp.asarray(src, jnp.int32),
                 jnp.asarray(dst, jnp.int32))
        t, pool = time_donating(f, host, pool, jnp.asarray(src, jnp.int32),
                                jnp.asarray(dst, jnp.int32), reps=reps)
        k = np.array([0, M - 1])
        got = np.asarray(pool[jnp.asarray(dst[-1][k])].astype(jnp.float32))
        ok = ok and bool(np.array_equal(got, pattern_rows(src[-1][k], row)))
        pool.delete()
        calls.append(dict(steps=steps, call_us=t * 1e6))
    nbytes = M * row * host.dtype.itemsize
    fit = fit_calls(calls)
    return dict(M=M, calls=calls, **fit, GBps=nbytes / fit["us_per_step"] / 1e3, correct=ok)


@functools.lru_cache(maxsize=None)
def _interleaved_loop(steps, with_fetch, busy_passes):
    """``steps`` iterations of [fetch one step's pages] -> [device-only work that reads the
    pool: ``busy_passes`` dependent elementwise passes over a 64 MiB f32 array in HBM]; the
    next fetch's source rows depend on that work, so nothing overlaps and PCIe idles between
    fetches, as it does between the fetches of decode steps."""
    def run(src_arr, pool, src_tab, dst_tab, x):
        def body(t, carry):
            pool, x = carry
            dep = (x[0, 0] > 1e30).astype(jnp.int32)   # 0, but only known after the work
            if with_fetch:
                pool = page_fetch.fetch_pages(src_arr, pool, src_tab[t] + dep, dst_tab[t])
            x = x + pool[0, : x.shape[1]].astype(x.dtype)
            for _ in range(busy_passes):
                x = lax.optimization_barrier(x * 0.999 + 1e-3)
            return pool, x
        return jax.lax.fori_loop(0, steps, body, (pool, x))

    return jax.jit(run, donate_argnums=1)


def steady_interleaved(host, M, *, steps_list, reps, rng, busy_passes=8):
    """Per-step cost of a fetch between bursts of device-only work: slope(with fetch) -
    slope(without). Equal to the back-to-back per-step time when the link needs no warm-up
    after idling."""
    n_src, row = host.shape
    x = jnp.zeros((4096 if n_src > 4096 else 8, 4096), jnp.float32, device=DEVICE)
    out = {}
    for with_fetch in (False, True):
        calls = []
        for steps in steps_list:
            src = jnp.asarray(source_rows(rng, n_src, M, steps), jnp.int32)
            dst = jnp.asarray(np.stack([rng.permutation(M) for _ in range(steps)]), jnp.int32)
            pool = jnp.zeros((M, row), host.dtype, device=DEVICE)
            f = _interleaved_loop(steps, with_fetch, busy_passes)
            pool, _ = f(host, pool, src, dst, x)
            jax.block_until_ready(pool)
            box = [pool]

            def call():
                box[0], y = f(host, box[0], src, dst, x)
                return y

            t = median_time(call, reps)
            calls.append(dict(steps=steps, call_us=t * 1e6))
            box[0].delete()
        out["fetch" if with_fetch else "work_only"] = dict(calls=calls, **fit_calls(calls))
    nbytes = M * row * host.dtype.itemsize
    d = out["fetch"]["us_per_step"] - out["work_only"]["us_per_step"]
    out.update(M=M, busy_passes=busy_passes, fetch_us_per_step=d, GBps=nbytes / d / 1e3)
    return out


def section_steady(cfg, budget, rng, *, sweep=False, only=None, variants=None, repeat=1):
    """Steady-state rates: the per-step slope of the fetch loop at the target points (default
    and naive tunings, and the empty launch), the same for XLA's DMA of a step-sized block,
    a fetch between bursts of device-only work, and the bulk ``device_put`` slope before and
    after. Fractions are slope over slope (no per-call cost on either side). ``variants``
    (names of the target sweep) or ``sweep`` (all of them) add tunings; ``repeat`` measures
    every tuning that many times in round robin and keeps the median turn."""
    H, D = HEADS["8x128"]
    steps_list = (UNROLL, 2 * UNROLL) if cfg.quick else STEADY_STEPS
    bulk_sizes = (1, 2) if cfg.quick else STEADY_BULK_MIB
    bulk0 = steady_bulk(bulk_sizes, cfg.reps)
    print(f"steady bulk: {bulk0['GBps']:.2f} GB/s marginal, fixed {bulk0['fixed_us']:.0f} us "
          f"(r2 {bulk0['r2']:.4f})", flush=True)
    points = []
    for name, ps, M, frac in cfg.targets:
        if (only and name not in only) or not budget.ok(f"steady {name}"):
            continue
        row = 2 * H * ps * D
        host = make_array(max(cfg.host_bytes // (row * 2), 2 * M), row, jnp.bfloat16, HOST)
        p = dict(name=name, page_size=ps, M=M, page_bytes=row * 2, target=frac)
        runs = [("default", {}), ("naive", dict(tuning=page_fetch.naive_tuning())),
                ("empty", dict(empty=True))]
        seen = {page_fetch.resolve_tuning(M, row, 2)}
        for vname, tun in _variants(2).items():
            eff = page_fetch.resolve_tuning(M, row, 2, **tun)
            wanted = vname in variants if variants else sweep
            if wanted and eff not in seen and vname not in ("default", "naive"):
                seen.add(eff)
                runs.append((vname, dict(tuning=tun)))
        reps_of = {}
        for turn in range(repeat):  # round robin: drifts of the machine hit every variant
            for label, kw in runs:
                if not budget.ok(f"steady {name} {label} {turn}"):
                    continue
                r = steady_fetch(host, M, steps_list=steps_list, reps=cfg.reps, rng=rng, **kw)
                reps_of.setdefault(label, []).append(r)
                print(f"steady {name:>10} {label:>8} #{turn}: {r['us_per_step']:8.1f} us/step "
                      f"fixed {r['fixed_us']:6.0f} us r2 {r['r2']:.4f}"
                      + (f" {r['GBps']:6.2f} GB/s" if "GBps" in r else ""), flush=True)
        for label, kw in runs:
            if label not in reps_of:
                continue
            rs = sorted(reps_of[label], key=lambda r: r["us_per_step"])
            r = dict(rs[(len(rs) - 1) // 2])  # the median turn (the slower one of two)
            r["us_per_step_turns"] = [x["us_per_step"] for x in reps_of[label]]
            r["correct"] = all(x["correct"] for x in rs)
            if "tuning" in kw:
                r["tuning"] = page_fetch.resolve_tuning(M, row, 2, **kw["tuning"]).__dict__
            home = p if label in ("default", "naive", "empty") else p.setdefault("variants", {})
            home[label] = r
        try:
            p["dma"] = steady_dma(host, M, steps_list=steps_list, reps=cfg.reps)
        except Exception as e:  # noqa: BLE001
            p["dma"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        if M <= 256 and budget.ok(f"steady {name} dma gather"):
            try:
                p["dma_gather"] = dma_gather_in_program(host, M, steps_list=steps_list[:2],
                                                        reps=cfg.reps, rng=rng)
                print(f"steady {name:>10} dma gather: {p['dma_gather']['us_per_step']:8.1f} "
                      f"us/step correct={p['dma_gather']['correct']}", flush=True)
            except Exception as e:  # noqa: BLE001
                p["dma_gather"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        if budget.ok(f"steady {name} interleaved"):
            try:
                p["interleaved"] = steady_interleaved(host, M, steps_list=steps_list,
                                                      reps=cfg.reps, rng=rng,
                                                      busy_passes=1 if cfg.quick else 8)
            except Exception as e:  # noqa: BLE001
                p["interleaved"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        host.delete()
        points.append(p)
    bulk1 = steady_bulk(bulk_sizes, cfg.reps)
    bulk = (bulk0["GBps"] + bulk1["GBps"]) / 2
    for p in points:
        keys = ("default", "naive", "dma", "dma_gather", "interleaved")
        for r in [p.get(k, {}) for k in keys] + list(p.get("variants", {}).values()):
            if r.get("GBps"):
                r["frac_of_bulk"] = r["GBps"] / bulk
        good = {k: r for k, r in [("default", p["default"]), ("naive", p["naive"])]
                + list(p.get("variants", {}).items()) if r.get("GBps") and r["correct"]}
        if good:
            p["best"] = max(good, key=lambda k: good[k]["GBps"])
            p["best_frac"] = good[p["best"]]["frac_of_bulk"]
    return dict(bulk=dict(GBps=bulk, before=bulk0, after=bulk1), steps=list(steps_list),
                points=points)


def print_steady(st):
    print(f"\nsteady state (slopes over {st['steps']} steps per call; bulk device_put slope "
          f"{st['bulk']['GBps']:.2f} GB/s, fixed {st['bulk']['before']['fixed_us']:.0f} us)")
    print(f"{'target':>11} {'goal':>5} {'default':>8} {'naive':>8} {'dma':>8} {'dma gath':>8} "
          f"{'between':>8} {'us/step':>8} {'fixed us':>8} {'empty us':>8} {'best':>20} ok")
    f = lambda r: f"{r['frac_of_bulk']:.3f}" if r and r.get("frac_of_bulk") else "-"
    for p in st["points"]:
        d = p["default"]
        print(f"{p['name']:>11} {p['target']:>5.2f} {f(d):>8} {f(p.get('naive')):>8} "
              f"{f(p.get('dma')):>8} {f(p.get('dma_gather')):>8} {f(p.get('interleaved')):>8} "
              f"{d['us_per_step']:>8.1f} "
              f"{d['fixed_us']:>8.0f} {p['empty']['us_per_step']:>8.1f} "
              f"{p.get('best', '-'):>14} {p.get('best_frac', 0):.3f} "
              f"{'PASS' if d.get('frac_of_bulk', 0) >= p['target'] else 'miss'}"
              f"{'' if d['correct'] else ' WRONG'}")


# ------------------------------------------------------------------------------ main
def _save(res, out_dir, name):
    """Write ``res`` as JSON to ``out_dir/name`` (the --only-* sections' result files)."""
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {path}")


def config(args):
    c = argparse.Namespace(quick=args.quick)
    if args.quick:
        c.host_bytes, c.bulk_bytes, c.reps, c.grid_reps = 1 * MiB, 4 * MiB, 2, 1
        c.targets = [("16x8KiB", 2, 16, 0.75)]
        c.heads, c.naive_heads, c.page_sizes, c.Ms = ["3x64"], ["3x64"], [16], [8, 32]
        c.naive_page_sizes = [16]
        c.layers, c.max_step_bytes, c.budget = 2, 64 * MiB, 120.0
        c.small_page_size, c.ensure_pages = 1, 4
    else:
        c.host_bytes, c.bulk_bytes, c.reps, c.grid_reps = 2 * GiB + 64 * MiB, GiB, 5, 3
        c.targets = TARGETS
        c.heads, c.naive_heads = ["8x128", "3x64"], ["8x128"]
        c.page_sizes, c.Ms = [16, 32, 64, 128], [8, 32, 128, 256, 512, 1024, 2048, 4096]
        c.naive_page_sizes = [16, 64]
        c.layers, c.max_step_bytes, c.budget = 32, 2 * GiB, args.budget_s
        c.small_page_size, c.ensure_pages = 16, 32
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (CPU ok)")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="skip remaining sections after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only-ensure", action="store_true",
                    help="run only the zero-miss ensure section; writes bench_fetch_ensure.json")
    ap.add_argument("--only-locality", action="store_true",
                    help="run only bulk + the source-locality section; writes "
                         "bench_fetch_locality.json")
    ap.add_argument("--only-steady", action="store_true",
                    help="run only the steady-state section (per-step slopes); writes "
                         "bench_fetch_steady.json")
    ap.add_argument("--steady-sweep", action="store_true",
                    help="--only-steady: also every tuning variant of the target sweep")
    ap.add_argument("--steady-targets", default="",
                    help="--only-steady: comma-separated target names (default: all)")
    ap.add_argument("--steady-variants", default="",
                    help="--only-steady: comma-separated tuning variants of the sweep to add")
    ap.add_argument("--steady-repeat", type=int, default=1,
                    help="--only-steady: measure every tuning this many times (round robin)")
    args = ap.parse_args(argv)
    cfg = config(args)
    for opt, given, known in (("--steady-targets", args.steady_targets, [t[0] for t in cfg.targets]),
                              ("--steady-variants", args.steady_variants, list(_variants(2)))):
        bad = [n for n in given.split(",") if n and n not in known]
        if bad:  # an unknown name would measure nothing for it, silently
            ap.error(f"{opt}: unknown {', '.join(bad)} (choose from {', '.join(known)})")
    rng = np.random.default_rng(args.seed)
    budget = Budget(cfg.budget)
    os.makedirs(args.out, exist_ok=True)
    res = dict(benchmark="bench_fetch", device=DEV0.device_kind, platform=DEV0.platform,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=_commit(), jax=jax.__version__, quick=cfg.quick, argv=sys.argv[1:])
    print(f"bench_fetch on {DEV0.device_kind} ({DEV0.platform}), jax {jax.__version__}", flush=True)

    if args.only_ensure:
        res["ensure"] = section_ensure(cfg, budget, rng)
        _save(res, args.out, "bench_fetch_ensure.json")
        return res
    if args.only_steady:
        names = lambda a: [t for t in a.split(",") if t]
        res["steady"] = section_steady(cfg, budget, rng, sweep=args.steady_sweep,
                                       only=names(args.steady_targets),
                                       variants=names(args.steady_variants),
                                       repeat=args.steady_repeat)
        print_steady(res["steady"])
        _save(res, args.out, "bench_fetch_steady.json")
        return res
    bulk0 = bench_bulk(cfg.bulk_bytes, cfg.reps)
    print(f"bulk device_put: {bulk0['GBps']:.1f} GB/s", flush=True)
    if args.only_locality:
        res["locality"] = section_locality(cfg, bulk0["GBps"], budget, rng)
        res["bulk"] = dict(before=bulk0, after=bench_bulk(cfg.bulk_bytes, cfg.reps))
        print(f"bulk after: {res['bulk']['after']['GBps']:.1f} GB/s")
        _save(res, args.out, "bench_fetch_locality.json")
        return res
    targets = section_targets(cfg, bulk0["GBps"], budget, rng)
    print(f"[{budget.elapsed():.0f}s] targets done", flush=True)
    res["write_through"] = section_write_through(cfg, budget, rng)
    res["ensure"] = section_ensure(cfg, budget, rng)
    print(f"[{budget.elapsed():.0f}s] write-through / ensure done", flush=True)
    grid = section_grid(cfg, bulk0["GBps"], budget, rng, "default")
    print(f"[{budget.elapsed():.0f}s] grid (default) done", flush=True)
    grid += section_grid(cfg, bulk0["GBps"], budget, rng, "naive")
    bulk1 = bench_bulk(cfg.bulk_bytes, cfg.reps)
    bulk = (bulk0["GBps"] + bulk1["GBps"]) / 2
    # fractions relative to the mean of the two bulk measurements
    for p in targets:
        for r in p["variants"]:
            if r.get("GBps"):
                r["frac_of_bulk"] = r["GBps"] / bulk
        if "best_GBps" in p:
            p["best_frac"] = p["best_GBps"] / bulk
    for r in grid:
        if r.get("GBps"):
            r["frac_of_bulk"] = r["GBps"] / bulk
    res["bulk"] = dict(GBps=bulk, before=bulk0, after=bulk1)
    res["targets"] = targets
    res["recommended"] = recommend(targets, bulk) if targets else None
    res["grid"] = grid
    res["skipped"] = budget.skipped
    res["elapsed_s"] = budget.elapsed()
    path = os.path.join(args.out, "bench_fetch.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    try:
        from benchmarks.plot_fetch import plot
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot_fetch import plot
    png = plot(res, os.path.join(args.out, "bench_fetch.png"))
    print_table(res, path, png)
    return res


def _cfg(r):
    t = (r or {}).get("tuning")
    if not t:
        return "-"
    return (f"e{t['pages_per_program']} c{t['chunk_elems'] * 2 // KiB}k "
            f"k{t['chunks_per_program']} w{t['num_warps']}")


def print_table(res, path, png):
    bulk = res["bulk"]["GBps"]
    print(f"\nbulk device_put host->device: {bulk:.1f} GB/s "
          f"(before {res['bulk']['before']['GBps']:.1f}, after {res['bulk']['after']['GBps']:.1f})")
    print(f"{'target':>11} {'goal':>5} {'best variant':>16} {'GB/s':>6} {'frac':>5} "
          f"{'default':>7} {'naive':>6} {'floor us':>8} {'dev GB/s':>8} {'default cfg':>14} ok")
    for p in res["targets"]:
        by = {}
        for r in p["variants"]:
            for n in [r["variant"]] + r.get("aliases", []):
                by[n] = r
        fr = lambda n: f"{by[n]['frac_of_bulk']:.2f}" if n in by and by[n].get("GBps") else "-"
        bf = p.get("best_frac", 0.0)
        bad = [r["variant"] for r in p["variants"] if r.get("correct") is False or r.get("error")]
        print(f"{p['name']:>11} {p['target']:>5.2f} {p.get('best', '-'):>16} "
              f"{p.get('best_GBps', 0):>6.1f} {bf:>5.2f} {fr('default'):>7} {fr('naive'):>6} "
              f"{p.get('floor_default_us', float('nan')):>8.1f} "
              f"{p.get('device_src_GBps', float('nan')):>8.1f} {_cfg(by.get('default')):>14} "
              f"{'PASS' if bf >= p['target'] else 'miss'}{' BAD:' + ','.join(bad) if bad else ''}")
    for p in res["targets"]:
        for r in p["variants"]:
            if r.get("hlo_big_copies") is not None:
                print(f"{p['name']}: copies >= 1 MiB in the compiled fetch loop: "
                      f"{len(r['hlo_big_copies'])} {r['hlo_big_copies'][:2]}")
    if res.get("recommended"):
        r = res["recommended"]
        f2 = lambda x: "-" if x is None else f"{x:.2f}"
        print(f"recommended rule (best worst-case GB/s / target GB/s over the targets): "
              f"{r['variant']} {f2(r['worst_ratio_to_target'])}; adaptive default "
              f"{f2(r['default_worst_ratio'])}; naive {f2(r['naive_worst_ratio'])}")
    w = res.get("write_through", {})
    print(f"write-through ({w.get('layers')} layers x 1 token, 8x128 bf16, us/token): " + ", ".join(
        f"{k[:-13]} {v:.1f}" for k, v in w.items() if k.endswith("_us_per_token")) +
        "".join(f"; {k}: {v[:80]}" for k, v in w.items() if k.endswith("_error")))
    e = res.get("ensure", {})
    print(f"zero-miss step ({e.get('layers')} layers x {e.get('pages_per_layer')} pages, us): " + ", ".join(
        f"{k[:-12]} {v:.1f}" for k, v in e.items() if k.endswith("_us_per_step")) +
        f"; misses {e.get('ensure_fetch_misses')}" +
        "".join(f"; {k}: {str(v)[:80]}" for k, v in e.items() if k.endswith("error")))
    grid = [r for r in res["grid"] if r.get("GBps")]
    for head in sorted({r["head"] for r in grid}):
        cells = []
        for ps in sorted({r["page_size"] for r in grid if r["head"] == head}):
            best = {v: max((r["GBps"] for r in grid if r["head"] == head and r["page_size"] == ps
                            and r["variant"] == v), default=None) for v in ("default", "naive")}
            cells.append(f"ps{ps} " + "/".join("-" if x is None else f"{x:.0f}"
                                                for x in best.values()))
        print(f"grid {head}, max GB/s default/naive over M: " + "; ".join(cells))
    bad = [r for r in res["grid"] if r.get("error") or r.get("correct") is False]
    if bad:
        print(f"grid: {len(bad)} points failed, e.g. {bad[0]}")
    if res["skipped"]:
        print(f"skipped (time budget): {len(res['skipped'])}: {res['skipped'][:4]}")
    print(f"elapsed {res['elapsed_s']:.0f}s; wrote {path} and {png}")


if __name__ == "__main__":
    main()
