"""Component timings of a decode step, for the step-time split of ``decode_lib``.

Each component runs on its own at the shapes of a plan inside a jitted ``fori_loop``
(:func:`time_loop`): the selector with its summary update, the LRU ``ensure``, the
per-step schedule's ``move_rows``, the host-to-pool ``fetch_pages`` and the sparse
attention. Every function returns seconds per decode step (all layers).
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import compile_stats, lru, selectors
from jaxkv.spec import INVALID
from jaxkv.models import llama
from jaxkv.kernels import page_fetch
from jaxkv.kernels.sparse_attention import sparse_paged_attention

if TYPE_CHECKING:
    from decode_lib import Settings


def time_loop(body, carry, args, iters: int, reps: int):
    """Median seconds per iteration of ``fori_loop(0, iters, body(i, carry, *args))``.

    ``carry`` is donated (updated in place, e.g. the pool or the summaries) and returned;
    ``args`` are read-only jit arguments (never copied)."""
    f = jax.jit(lambda c, a: lax.fori_loop(0, iters, lambda i, c: body(i, c, *a), c),
                donate_argnums=0)
    for _ in range(3):  # until a call compiles nothing (the first output may be committed
        snap = compile_stats.snapshot()  # differently from the input carry)
        carry = jax.block_until_ready(f(carry, args))
        if compile_stats.since(snap)["count"] == 0:
            break
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(f(carry, args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / iters, carry


def _random_pages(rng, B, H, K, n_valid):
    """[B, H, K] distinct sorted pages in [0, n_valid) (stratified), -1 where K > n_valid."""
    if K >= n_valid:
        p = np.broadcast_to(np.arange(K), (B, H, K)).copy()
        return np.where(p < n_valid, p, -1).astype(np.int32)
    stride = n_valid // K
    return (np.arange(K) * stride + rng.integers(0, stride, (B, H, K))).astype(np.int32)


def time_selector(plan, params, summaries, lengths, st: Settings):
    """Seconds per step of the selector (summary update + select) over all layers."""
    cfg = plan.model
    L, B, ps = cfg.num_layers, plan.batch, plan.page_size
    nq = 4
    key = jax.random.key(st.seed + 11)
    k1, k2, k3 = jax.random.split(key, 3)
    dt = jnp.dtype(cfg.dtype)
    qs = jax.random.normal(k1, (nq, B, cfg.num_heads, cfg.head_dim), jnp.float32).astype(dt)
    ks = jax.random.normal(k2, (nq, B, cfg.num_kv_heads, cfg.head_dim), jnp.float32).astype(dt)
    hs = jax.random.normal(k3, (nq, B, 1, cfg.d_model), jnp.float32).astype(dt)
    pos = jnp.asarray(lengths, jnp.int32)
    use_lp = plan.cache.selector == "indexer"

    def body(i, c, qs, ks, hs, layers, pos):
        summ, acc = c
        layer = (i % L).astype(jnp.int32)
        j = i % nq
        lp = jax.tree.map(lambda a: a[layer], layers) if use_lp else None
        summ, pages = plan.selector.update_select(plan, summ, layer, lp, hs[j], qs[j], ks[j], pos)
        return summ, acc + jnp.sum(pages[..., :1])

    layers = llama.stack_layer_tree(params["layers"]) if use_lp else {}
    own, shift, ahead = selectors.split(summaries, plan)  # the same work either way
    sec, (summ, _) = time_loop(body, (own, jnp.int32(0)), (qs, ks, hs, layers, pos),
                                st.split_steps * L, st.reps)
    return sec * L, selectors.join(summ, shift, ahead)


def _ensure_shapes(plan, lengths):
    """(L, P, S, B, H, k, Np, ps, n_valid) of the LRU timings: n_valid = pages of the shortest
    request."""
    spec = plan.spec
    ps = plan.page_size
    return (spec.num_layers, spec.num_logical_pages, spec.num_slots, plan.batch,
            plan.model.num_kv_heads, plan.k, plan.pages_per_seq, ps, -(-int(min(lengths)) // ps))


def time_ensure(plan, lengths, st: Settings, rng):
    """Seconds per step of ``lru.ensure`` + the LRU-state updates for random requests of the
    step's shape: one call for all layers per step (per-step schedule) or one per layer."""
    if plan.per_step:
        return _time_ensure_all_layers(plan, lengths, st, rng)
    L, P, S, B, H, k, Np, ps, n_valid = _ensure_shapes(plan, lengths)
    nr = 4
    reqs = np.stack([(_random_pages(rng, B, H, k, n_valid)
                      + (np.arange(B) * Np)[:, None, None]).reshape(1, -1) for _ in range(nr)])
    cur = np.asarray(lengths) // ps
    prot = np.concatenate([np.arange(B)[:, None] * Np + np.zeros((B, 1), np.int64),
                           np.arange(B)[:, None] * Np + cur[:, None]], axis=1).reshape(1, -1)

    def body(i, c, reqs, prot):
        pt, so, lu, step, acc = c
        layer = (i % L).astype(jnp.int32)[None]
        res = lru.ensure(pt[layer], so[layer], lu[layer], reqs[i % nr], prot, step)
        pt = pt.at[layer].set(res.page_table)
        so = so.at[layer].set(res.slot_owner)
        lu = lu.at[layer].set(res.last_used)
        step = step + (i % L == L - 1).astype(jnp.int32)
        acc = acc + jnp.sum(res.slots[:, :1]) + jnp.sum(res.fetch_src[:, :1]) + res.misses
        return pt, so, lu, step, acc

    carry = (jnp.full((L, P), INVALID, jnp.int32), jnp.full((L, S), INVALID, jnp.int32),
             jnp.full((L, S), INVALID, jnp.int32), jnp.int32(0), jnp.int32(0))
    sec, _ = time_loop(body, carry, (jnp.asarray(reqs, jnp.int32), jnp.asarray(prot, jnp.int32)),
                        st.split_steps * L, st.reps)
    return sec * L


def _time_ensure_all_layers(plan, lengths, st: Settings, rng):
    L, P, S, B, H, k, Np, ps, n_valid = _ensure_shapes(plan, lengths)
    nr = 4
    reqs = np.stack([np.stack([(_random_pages(rng, B, H, k, n_valid)
                                + (np.arange(B) * Np)[:, None, None]).reshape(-1)
                               for _ in range(L)]) for _ in range(nr)])          # [nr, L, R]
    cur = np.asarray(lengths) // ps
    prot = np.concatenate([np.arange(B)[:, None] * Np, np.arange(B)[:, None] * Np + cur[:, None]],
                          axis=1).reshape(1, -1)
    prot = np.broadcast_to(prot, (L, prot.shape[1]))

    def body(i, c, reqs, prot):
        pt, so, lu, step, acc = c
        res = lru.ensure(pt, so, lu, reqs[i % nr], prot, step)
        acc = acc + jnp.sum(res.slots[:, :1]) + jnp.sum(res.fetch_dst[:, :1]) + res.misses
        return res.page_table, res.slot_owner, res.last_used, step + 1, acc

    carry = (jnp.full((L, P), INVALID, jnp.int32), jnp.full((L, S), INVALID, jnp.int32),
             jnp.full((L, S), INVALID, jnp.int32), jnp.int32(0), jnp.int32(0))
    sec, _ = time_loop(body, carry, (jnp.asarray(reqs, jnp.int32), jnp.asarray(prot, jnp.int32)),
                        st.split_steps, st.reps)
    return sec


def time_move(plan, pool, moved_per_layer: float, st: Settings, rng):
    """Per-step schedule: seconds per step of the one ``move_rows`` launch that installs the
    previous step's fetched pages (scratch rows -> pool slots), ``moved_per_layer`` per layer."""
    spec = plan.spec
    L, S, E = spec.num_layers, spec.num_slots, spec.num_scratch
    m = int(min(round(moved_per_layer), S, E))
    nr = 2
    src = np.full((nr, L, E), -1, np.int32)
    dst = np.full((nr, L, E), -1, np.int32)
    for r in range(nr):
        for layer in range(L):
            src[r, layer, :m] = L * S + layer * E + rng.choice(E, m, replace=False)
            dst[r, layer, :m] = layer * S + rng.choice(S, m, replace=False)

    def body(i, pool, src, dst):
        return page_fetch.move_rows(pool, src[i % nr].reshape(-1), dst[i % nr].reshape(-1),
                                    implementation=st.implementation)

    sec, pool = time_loop(body, pool, (jnp.asarray(src), jnp.asarray(dst)), st.split_steps, st.reps)
    return sec, pool


def time_fetch(plan, host_kv, pool, fetched_per_layer: float, lengths, st: Settings, rng):
    """Seconds per step of ``fetch_pages``: one launch per layer of the engine's size (B * H * k
    entries) moving ``fetched_per_layer`` random distinct pages of the host tier into distinct
    pool rows (scratch rows with the per-step schedule, slots otherwise). Returns
    (seconds, pool, pages moved per launch)."""
    spec = plan.spec
    L, P, S, R = spec.num_layers, spec.num_logical_pages, spec.num_slots, spec.max_requests
    E = spec.num_scratch
    per_step = plan.per_step and E > 0
    Np, ps, B = plan.pages_per_seq, plan.page_size, plan.batch
    n_dst = E if per_step else S
    m = int(min(round(fetched_per_layer), R, n_dst))
    nr = 4
    n_valid = -(-int(min(lengths)) // ps)
    cand = (np.arange(B)[:, None] * Np + np.arange(n_valid)[None, :]).reshape(-1)
    m = min(m, cand.size)
    src = np.full((nr, R), -1, np.int32)
    dst = np.full((nr, R), -1, np.int32)
    for r in range(nr):
        src[r, :m] = rng.choice(cand, m, replace=False)
        dst[r, :m] = rng.choice(n_dst, m, replace=False)

    def body(i, pool, host_kv, src, dst):
        layer = (i % L).astype(jnp.int32)
        s, d = src[i % nr], dst[i % nr]
        gs = jnp.where(s >= 0, layer * P + s, INVALID)
        base = L * S + layer * E if per_step else layer * S
        gd = jnp.where(d >= 0, base + d, INVALID)
        return page_fetch.fetch_pages(host_kv, pool, gs, gd, implementation=st.implementation)

    sec, pool = time_loop(body, pool, (host_kv, jnp.asarray(src), jnp.asarray(dst)),
                           st.split_steps * L, st.reps)
    return sec * L, pool, m


def time_attention(plan, pool, lengths, st: Settings, rng, *, where: str):
    """Seconds per step of ``sparse_paged_attention`` over all layers.

    where: "resident" (rows of the resident tier, the plan's k pages), "dense" (every valid
    page, resident) or "pool" (random slots of the host-tier pool, k pages)."""
    cfg = plan.model
    L, B, H, ps = cfg.num_layers, plan.batch, cfg.num_kv_heads, plan.page_size
    Np = plan.pages_per_seq
    n_valid = -(-int(min(lengths)) // ps)
    nq = 2
    dt = jnp.dtype(plan.model.dtype)  # queries in the model's dtype (the pool's may differ)
    qs = jax.random.normal(jax.random.key(st.seed + 5), (nq, B, cfg.num_heads, cfg.head_dim),
                           jnp.float32).astype(dt)
    if where == "dense":
        K = Np
        pidx = np.stack([_random_pages(rng, B, H, K, n_valid)] * nq)
    else:
        K = plan.k
        pidx = np.stack([_random_pages(rng, B, H, K, n_valid) for _ in range(nq)])
    if where == "pool":
        per_layer = plan.spec.num_slots
        rows = rng.integers(0, per_layer, pidx.shape).astype(np.int32)
    else:
        per_layer = plan.spec.num_logical_pages
        rows = pidx + (np.arange(B) * Np)[None, :, None, None]
    rows = np.where(pidx >= 0, rows, -1).astype(np.int32)
    seq = jnp.asarray(lengths, jnp.int32) + 1

    def body(i, acc, pool, qs, rows, pidx, seq):
        layer = (i % L).astype(jnp.int32)
        j = i % nq
        r = rows[j]
        g = jnp.where(r >= 0, layer * per_layer + r, INVALID)
        out, _ = sparse_paged_attention(qs[j], pool, g, pidx[j], seq, page_size=ps,
                                        num_kv_heads=H, implementation=st.implementation)
        return acc + out.astype(jnp.float32)

    acc = jnp.zeros((B, cfg.num_heads, cfg.head_dim), jnp.float32)
    sec, _ = time_loop(body, acc, (pool, qs, jnp.asarray(rows), jnp.asarray(pidx), seq),
                        st.split_steps * L, st.reps)
    return sec * L
