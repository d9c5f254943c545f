"""Soak test of the host tier: thousands of decode-like steps, every step checked.

Each step, for ``B`` requests and ``L`` layers (all inside one jitted ``lax.scan``):

1. every request appends one random token; ``jaxkv.cache.write_through`` writes it to the
   pinned_host tier (and its pool row if resident). Now and then a request is *reset* (its
   logical pages are reused by a new sequence): its host rows are overwritten with NaN
   first, so stale data from the old sequence is poison;
2. random page selections per (layer, request, KV head): duplicates, ``-1`` holes and pages
   past the current one (unwritten: NaN or stale) included; the sink and current pages of
   each request are protected; ``jaxkv.cache.ensure_resident`` (``lru.ensure`` + ONE
   ``page_fetch.fetch_pages``) makes them resident in a pool that is too small, so some
   selections are dropped (layer 0 alone, then the other layers, as the engine and a
   batched caller do);
3. ``sparse_paged_attention`` over the pool with the returned global rows is compared with
   the reference attention over an independent device mirror of the host tier (plain
   ``.at[].set`` writes), restricted to the selections that were made resident (dropped
   ones are excluded on both sides);
4. invariants: no NaN in any output; every resident slot holds its page's valid tokens
   exactly; ``dropped`` equals an independent count of distinct dropped pages; ``misses ==
   pages_fetched + dropped``; ``page_table`` and ``slot_owner`` are inverse maps.

Failures are accumulated in the loop carry (first bad step, worst error) and asserted at
the end with the seed. Replay a failure with ``JAXKV_SOAK_SEED=<seed>`` (and
``JAXKV_SOAK_STEPS``) on the same test. The long version (``gpu``) runs 100k steps with the
Pallas kernels on the H200.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cache as kvcache
from jaxkv.spec import INVALID, CacheSpec
from jaxkv.kernels import page_write
from jaxkv.kernels.sparse_attention import sparse_paged_attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@dataclasses.dataclass(frozen=True)
class Soak:
    """Static shape of a soak run (hashable: a jit static argument)."""

    L: int = 2          # layers
    B: int = 3          # requests
    H: int = 2          # KV heads
    G: int = 2          # query heads per KV head
    D: int = 16         # head dim
    ps: int = 4         # page size
    Np: int = 8         # pages per request
    K: int = 4          # selected pages per (layer, request, head)
    S: int = 10         # pool slots per layer (the step's working set is up to B*H*K = 24)
    dtype: str = "float32"
    p_reset: float = 0.01
    p_hole: float = 0.15
    p_dup: float = 0.2
    p_future: float = 0.1

    @property
    def spec(self) -> CacheSpec:
        return CacheSpec(num_layers=self.L, num_kv_heads=self.H, head_dim=self.D,
                         page_size=self.ps, dtype=self.dtype, num_logical_pages=self.B * self.Np,
                         num_slots=self.S, max_requests=self.B * self.H * self.K,
                         num_sink_pages=1, num_recent_pages=1, max_batch=self.B)


def _seed(default_from_env: str = "JAXKV_SOAK_SEED") -> int:
    env = os.environ.get(default_from_env)
    return int(env) if env else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def _steps(default: int) -> int:
    return int(os.environ.get("JAXKV_SOAK_STEPS", default))


def _init(c: Soak):
    spec = c.spec
    cache = kvcache.init_cache(spec, poison=True)  # NaN pool: an unfetched slot is poison
    nan = jnp.full(spec.host_shape, jnp.nan, spec.jnp_dtype)  # the host tier starts as poison too
    host = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Host),
                   out_shardings=kvcache.host_sharding())(nan)
    cache = dataclasses.replace(cache, host_kv=host)
    mirror = jnp.full((c.L * c.B * c.Np, 2, c.H, c.ps, c.D), jnp.nan, spec.jnp_dtype)
    lengths = jnp.zeros((c.B,), jnp.int32)
    # ok, first_bad, max_err, n_nan, n_dropped_total, n_resets
    stats = (jnp.bool_(True), jnp.int32(-1), jnp.float32(0), jnp.int32(0), jnp.int32(0), jnp.int32(0))
    carry = (cache, mirror, lengths, stats)
    # commit every leaf (as jit outputs are): otherwise the first chunk compiles twice
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), carry)


def _distinct_count(x, valid, big):
    """Distinct values of x [..., R] among entries where ``valid`` (per leading index)."""
    v = jnp.sort(jnp.where(valid, x, big), axis=-1)
    first = jnp.concatenate([jnp.ones_like(v[..., :1], bool), v[..., 1:] != v[..., :-1]], axis=-1)
    return jnp.sum(first & (v < big))


def _step(c: Soak, impl, base_key, carry, step):
    cache, mirror, lengths, (ok, first_bad, max_err, n_nan, n_drop, n_reset) = carry
    spec = c.spec
    L, B, H, G, D, ps, Np, K, S = c.L, c.B, c.H, c.G, c.D, c.ps, c.Np, c.K, c.S
    P = B * Np
    dt = spec.jnp_dtype
    key = jax.random.fold_in(base_key, step)
    (k_reset, k_who, k_kv, k_sel, k_fut, k_fut2, k_hole, k_dup, k_q) = jax.random.split(key, 9)
    b_idx = jnp.arange(B, dtype=jnp.int32)
    l_idx = jnp.arange(L, dtype=jnp.int32)

    # -- 1. reset one request (a full one first, else a random one now and then): its ---
    # pages become poison. Other full requests sit this step out (inactive, -1 writes).
    full = lengths >= Np * ps
    want = jnp.any(full) | jax.random.bernoulli(k_reset, c.p_reset)
    who = jnp.where(jnp.any(full), jnp.argmax(full), jax.random.randint(k_who, (), 0, B))
    reset = want & (b_idx == who)
    rows = who * Np + l_idx[:, None] * P + jnp.arange(Np, dtype=jnp.int32)[None, :]  # [L, Np]
    rows = jnp.where(want, rows, INVALID).reshape(-1)
    nan_pages = jnp.full((L * Np, spec.row_elems), jnp.nan, dt)
    host = page_write.write_pages(cache.host_kv, rows, nan_pages, implementation=impl)
    cache = dataclasses.replace(cache, host_kv=page_write.keep_on_host(host))
    mirror = mirror.at[jnp.where(rows >= 0, rows, L * P)].set(jnp.nan, mode="drop")
    lengths = jnp.where(reset, 0, lengths)

    # -- 2. append one token per active request (all layers) -----------------------------
    active = lengths < Np * ps
    pos = jnp.minimum(lengths, Np * ps - 1)
    logical = jnp.where(active, b_idx * Np + pos // ps, INVALID)      # [B]
    kv = jax.random.normal(k_kv, (L, B, 2, H, D), jnp.float32).astype(dt)
    lay = jnp.repeat(l_idx, B)
    lp = jnp.tile(logical, L)
    off = jnp.tile(pos % ps, L)
    cache = kvcache.write_through(spec, cache, lay, lp, off, kv.reshape(L * B, 2, H, D),
                                  implementation=impl)
    mrow = jnp.where(lp >= 0, lay * P + lp, L * P)
    mirror = mirror.at[mrow, :, :, off, :].set(kv.reshape(L * B, 2, H, D), mode="drop")
    lengths = lengths + active.astype(jnp.int32)
    cur = jnp.maximum(lengths - 1, 0) // ps                            # current page [B]

    # -- 3. random selections: holes, duplicates, future (unwritten/stale) pages ---------
    u = jax.random.uniform(k_sel, (L, B, H, K))
    pages = jnp.floor(u * (cur + 1)[None, :, None, None]).astype(jnp.int32)
    fut = jax.random.randint(k_fut, (L, B, H, K), 0, Np)
    pages = jnp.where(jax.random.bernoulli(k_fut2, c.p_future, pages.shape), fut, pages)
    pages = jnp.where(jax.random.bernoulli(k_dup, c.p_dup, pages.shape),
                      jnp.roll(pages, 1, axis=-1), pages)
    pages = jnp.where(jax.random.bernoulli(k_hole, c.p_hole, pages.shape), INVALID, pages)
    sel = jnp.where(pages >= 0, b_idx[None, :, None, None] * Np + pages, INVALID)
    req = sel.reshape(L, B * H * K)
    protect = jnp.concatenate([b_idx * Np, b_idx * Np + cur], axis=0)  # sink + current page
    protect = jnp.broadcast_to(protect, (L, 2 * B))

    before = cache.counters
    cache, s0 = kvcache.ensure_resident(spec, cache, req[:1], protect[:1],
                                        layers=jnp.zeros((1,), jnp.int32), implementation=impl)
    cache, s1 = kvcache.ensure_resident(spec, cache, req[1:], protect[1:],
                                        layers=l_idx[1:], implementation=impl)
    slots = jnp.concatenate([s0, s1], axis=0)                          # [L, B*H*K] global
    cache = kvcache.tick(cache)

    # -- 4. attention from the pool vs the reference over the mirror ----------------------
    q = jax.random.normal(k_q, (L * B, H * G, D), jnp.float32).astype(dt)
    rows_pool = slots.reshape(L * B, H, K)
    resident = rows_pool >= 0
    rows_ref = jnp.where(resident, jnp.repeat(l_idx * P, B).reshape(L * B, 1, 1)
                         + sel.reshape(L * B, H, K), INVALID)
    pidx = pages.reshape(L * B, H, K)
    seq = jnp.tile(lengths, L)
    out, lse = sparse_paged_attention(q, cache.pool, rows_pool, pidx, seq, page_size=ps,
                                      num_kv_heads=H, implementation=impl)
    mref = mirror.reshape(L * P, -1)
    want_out, want_lse = sparse_paged_attention(q, mref, rows_ref, pidx, seq, page_size=ps,
                                                num_kv_heads=H, implementation="xla")
    o32, w32 = out.astype(jnp.float32), want_out.astype(jnp.float32)
    err = jnp.max(jnp.abs(o32 - w32) / (1.0 + jnp.abs(w32)))
    finite_lse = jnp.isfinite(want_lse)
    err = jnp.maximum(err, jnp.max(jnp.where(finite_lse, jnp.abs(lse - want_lse), 0.0)))
    lse_mismatch = jnp.any(finite_lse != jnp.isfinite(lse))
    nan_here = jnp.sum(~jnp.isfinite(o32)).astype(jnp.int32)

    # -- 5. invariants of the cache state ------------------------------------------------
    owner = cache.slot_owner                                           # [L, S] logical pages
    own_b = jnp.where(owner >= 0, owner // Np, 0)
    own_j = jnp.where(owner >= 0, owner % Np, 0)
    tok_ok = (own_j[..., None] * ps + jnp.arange(ps)[None, None, :] < lengths[own_b][..., None])
    tok_ok = tok_ok & (owner >= 0)[..., None]                          # [L, S, ps]
    pool5 = cache.pool.reshape(L, S, 2, H, ps, D)
    src = mirror[(l_idx[:, None] * P + jnp.where(owner >= 0, owner, 0))]  # [L, S, 2, H, ps, D]
    m = tok_ok[:, :, None, None, :, None]
    slot_bad = jnp.any(m & (pool5 != src)) | jnp.any(m & ~jnp.isfinite(pool5))
    pt = cache.page_table
    inverse_bad = jnp.any((owner >= 0) & (jnp.take_along_axis(pt, jnp.where(owner >= 0, owner, 0), 1)
                                          != jnp.arange(S)[None, :]))
    inverse_bad |= jnp.sum(pt >= 0) != jnp.sum(owner >= 0)
    dropped_entry = (req >= 0) & (slots < 0)
    dropped_now = _distinct_count(req, dropped_entry, jnp.int32(2**30))
    d = jax.tree.map(lambda a, b: a - b, cache.counters, before)
    count_bad = (d.dropped != dropped_now) | (d.misses != d.pages_fetched + d.dropped)
    # a hit or an assigned miss must never come back as -1; a dropped one only if counted
    good = (err <= _tol(c.dtype)) & ~lse_mismatch & (nan_here == 0) & ~slot_bad & ~inverse_bad & ~count_bad
    first_bad = jnp.where(ok & ~good, step, first_bad)
    stats = (ok & good, first_bad, jnp.maximum(max_err, err), n_nan + nan_here,
             n_drop + d.dropped, n_reset + want.astype(jnp.int32))
    return (cache, mirror, lengths, stats), None


def _tol(dtype: str) -> float:
    """Error bound on |out - ref| / (1 + |ref|) and on the LSE. Kernel and reference differ
    only by rounding (bf16 output and P cast; f32 summation order); a stale or foreign page
    changes outputs by O(1)."""
    return 1e-4 if dtype == "float32" else 2e-2


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _chunk(c: Soak, impl, n: int, base_key, carry, start):
    steps = start + jnp.arange(n, dtype=jnp.int32)
    carry, _ = jax.lax.scan(functools.partial(_step, c, impl, base_key), carry, steps)
    return carry


def run_soak(c: Soak, seed: int, steps: int, impl: str, chunk: int = 1000) -> dict:
    """Run ``steps`` soak steps (``chunk`` per jitted scan); returns the summary dict."""
    base = jax.random.key(seed)
    carry = _init(c)
    t0 = time.perf_counter()
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        carry = _chunk(c, impl, n, base, carry, jnp.int32(done))
        done += n
        if not bool(carry[3][0]):
            break
    cache, mirror, lengths, (ok, first_bad, max_err, n_nan, n_drop, n_reset) = carry
    res = dict(seed=seed, steps=done, impl=impl, ok=bool(ok), first_bad_step=int(first_bad),
               max_err=float(max_err), nan_outputs=int(n_nan), dropped_in_loop=int(n_drop),
               resets=int(n_reset), time_s=time.perf_counter() - t0,
               **{k: int(v) for k, v in dataclasses.asdict(cache.counters).items()})
    # final check: the host tier equals the mirror on every written token
    host = np.asarray(jax.device_put(cache.host_kv, kvcache.device_sharding()).astype(jnp.float32))
    mir = np.asarray(mirror.astype(jnp.float32)).reshape(host.shape)
    both = ~np.isnan(mir)
    res["host_matches_mirror"] = bool(np.array_equal(host[both], mir[both]))
    return res


def _check(res: dict, test: str):
    replay = f"replay: JAXKV_SOAK_SEED={res['seed']} JAXKV_SOAK_STEPS={res['steps']} pytest {test}"
    print(res)
    assert res["ok"], f"soak failed at step {res['first_bad_step']}: {res}\n{replay}"
    assert res["nan_outputs"] == 0, f"{res}\n{replay}"
    assert res["host_matches_mirror"], f"host tier differs from the mirror: {res}\n{replay}"
    # the run must have exercised the interesting paths
    for k in ("hits", "misses", "evictions", "dropped", "resets"):
        assert res[k] > 0, f"soak never produced {k}: {res}\n{replay}"


def test_soak_short_xla():
    """A few thousand steps with the XLA references (CI)."""
    res = run_soak(Soak(), _seed(), _steps(3000), "xla", chunk=500)
    _check(res, "tests/test_soak.py::test_soak_short_xla")


def test_soak_short_pallas_interpret():
    """A short run with the Pallas kernels (interpret mode off the GPU)."""
    # 20 steps: the requests fill their 4 pages after 16 tokens, so resets are certain
    res = run_soak(Soak(B=2, Np=4, S=5, p_reset=0.05), _seed(), _steps(20), "pallas", chunk=20)
    _check(res, "tests/test_soak.py::test_soak_short_pallas_interpret")


def test_soak_detects_corruption():
    """The checker itself: a pool with wrong resident rows must fail the soak at once.

    Every resident row holding a valid token is corrupted: one row alone can be wiped out by
    the very next step (its slot evicted and refetched, or its request reset so that none of
    its tokens is valid any more; seed 2103917769 reset the one corrupted row's request).
    Sink and current pages are never evicted, so all rows vanish only if every request
    resets in that step."""
    c, n = Soak(), 500  # the same static arguments as test_soak_short_xla: no new compile
    seed = _seed()
    base = jax.random.key(seed)
    carry = _chunk(c, "xla", n, base, _init(c), jnp.int32(0))
    cache, lengths = carry[0], np.asarray(carry[2])
    owner = np.asarray(cache.slot_owner)                       # a resident page with tokens
    cand = [(l, s) for l in range(c.L) for s in range(c.S)
            if owner[l, s] >= 0 and (owner[l, s] % c.Np) * c.ps < lengths[owner[l, s] // c.Np]]
    assert cand, f"seed={seed}"
    rows = jnp.asarray([l * c.S + s for l, s in cand], jnp.int32)
    bad = dataclasses.replace(cache, pool=cache.pool.at[rows].add(1.0))
    stats = (jax.device_put(jnp.bool_(True), kvcache.device_sharding()),) + tuple(carry[3][1:])
    carry = _chunk(c, "xla", n, base, (bad, carry[1], carry[2], stats), jnp.int32(n))
    assert not bool(carry[3][0]) and int(carry[3][1]) == n, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_soak_long_gpu(dtype):
    """100k steps with the Pallas kernels on the GPU, larger shapes (run by the lead)."""
    c = Soak(L=4, B=4, H=4, G=4, D=64, ps=16, Np=32, K=8, S=48, dtype=dtype, p_reset=0.002)
    res = run_soak(c, _seed(), _steps(100_000), "pallas", chunk=5000)
    _check(res, f"'tests/test_soak.py::test_soak_long_gpu[{dtype}]'")
