"""fetch_pages: Pallas kernel (interpret mode on CPU), jnp reference and its "compact" CPU form vs
a numpy oracle.

Also: the Triton lowering of every kernel variant for an (abstract) H200, a jitted
fori_loop with a pinned_host carry (write + fetch, like probe4) and GPU-only checks
(compiled HLO has no whole-host-array copy; host arrays > 4 GiB; large random cases).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jaxkv.kernels import _common, page_fetch, page_write

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

from lowering import lower_for_h200  # noqa: E402
from page_kernel_util import (DEV0, DEVICE, DTYPES, HEADS, HOST, SHAPES, as_f32,  # noqa: F401,E402
                              host_zeros, rng)


def make_case(rng, n_host, n_pool, row, m, dtype, *, p_invalid=0.3, repeat_src=True):
    """Random host rows (unused ones NaN), NaN pool, random src/dst with -1 holes."""
    n_valid_dst = min(m, n_pool)
    dst = np.full(m, -1, np.int32)
    dst[rng.permutation(m)[:n_valid_dst]] = rng.permutation(n_pool)[:n_valid_dst]
    if repeat_src:
        src = rng.integers(0, n_host, m).astype(np.int32)
    else:
        src = rng.permutation(n_host)[:m].astype(np.int32)
    holes = rng.random(m) < p_invalid
    src[holes & (rng.random(m) < 0.5)] = -1
    dst[holes & (rng.random(m) >= 0.5)] = -1
    host = np.full((n_host, row), np.nan, np.float32)
    used = np.unique(src[src >= 0])
    host[used] = rng.standard_normal((used.size, row))
    host = np.asarray(jnp.asarray(host, dtype).astype(jnp.float32))  # exact in dtype
    expect = np.full((n_pool, row), np.nan, np.float32)
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            expect[d] = host[s]
    return host, src, dst, expect


def run_fetch(host_np, src, dst, n_pool, dtype, impl, **tuning):
    host = jax.device_put(jnp.asarray(host_np, dtype), HOST)
    pool = jnp.full((n_pool, host_np.shape[1]), jnp.nan, dtype)
    out = page_fetch.fetch_pages(host, pool, jnp.asarray(src), jnp.asarray(dst),
                                 implementation=impl, **tuning)
    assert out.shape == pool.shape and out.dtype == dtype
    return as_f32(out)


# One tuning per case (rotating) keeps the interpret-mode compile count small.
TUNINGS = [
    {},                                                   # defaults
    dict(pages_per_program=1, chunk_elems=0, chunks_per_program=0),  # naive
    dict(pages_per_program=2, chunk_elems=256, chunks_per_program=1, num_warps=8),
    dict(pages_per_program=4, chunk_elems=1024, chunks_per_program=2),
]


@pytest.mark.parametrize("heads,page_size,dtype", SHAPES)
def test_fetch_matches_reference(rng, heads, page_size, dtype):
    H, D = HEADS[heads]
    row = 2 * H * page_size * D
    big = row * 4 > 256 * 1024
    n_host, n_pool, m = (6, 4, 5) if big else (17, 9, 11)
    host, src, dst, expect = make_case(rng, n_host, n_pool, row, m, DTYPES[dtype])
    i = SHAPES.index((heads, page_size, dtype)) + (heads == "3x64")
    tuning = dict(TUNINGS[i % len(TUNINGS)])
    if big:  # fewer, larger programs keep interpret mode fast
        tuning = dict(chunk_elems=16384, chunks_per_program=0, pages_per_program=2)
    got = run_fetch(host, src, dst, n_pool, DTYPES[dtype], "pallas", **tuning)
    np.testing.assert_array_equal(got, expect)
    ref = run_fetch(host, src, dst, n_pool, DTYPES[dtype], "xla")
    np.testing.assert_array_equal(ref, expect)
    np.testing.assert_array_equal(run_fetch(host, src, dst, n_pool, DTYPES[dtype], "compact"),
                                  expect)


@pytest.mark.parametrize("tuning", [
    {},
    dict(pages_per_program=1, chunk_elems=0, chunks_per_program=0),
    dict(pages_per_program=1, chunk_elems=512, chunks_per_program=1),
    dict(pages_per_program=4, chunk_elems=2048, chunks_per_program=3, num_warps=8),
    dict(pages_per_program=8, chunk_elems=1024, chunks_per_program=2),
    dict(pages_per_program=3, chunk_elems=1000, chunks_per_program=5),  # snapped to legal
], ids=["default", "naive", "split", "e4k3", "e8k2", "snapped"])
def test_fetch_tunings_non_pow2_row(rng, tuning):
    """R = 6144 (3 KV heads x 64 x 2 x 16) is not a power of two; M not a multiple of E."""
    host, src, dst, expect = make_case(rng, 23, 13, 6144, 13, jnp.float32)
    got = run_fetch(host, src, dst, 13, jnp.float32, "pallas", **tuning)
    np.testing.assert_array_equal(got, expect)


def test_fetch_edge_cases(rng):
    row = 384  # 3 x 64 x 2 x page_size 1
    host = rng.standard_normal((9, row)).astype(np.float32)
    # all invalid, out of range, repeated sources, single entry
    cases = [  # all padded to M = 5 (one compile per implementation)
        ([-1, -1, -1, -1, -1], [0, 1, 2, 3, 4]),
        ([9, 100, 3, -7, 2], [0, 1, 6, 2, -1]),
        ([4, 4, 4, -1, -1], [2, 0, 5, -1, -1]),
        ([8, -1, -1, -1, -1], [5, -1, -1, -1, -1]),
    ]
    cases = [(np.array(s, np.int32), np.array(d, np.int32)) for s, d in cases]
    for src, dst in cases:
        expect = np.full((6, row), np.nan, np.float32)
        for s, d in zip(src, dst):
            if 0 <= s < 9 and 0 <= d < 6:
                expect[d] = host[s]
        for impl in ("pallas", "xla", "compact"):
            got = run_fetch(host, src, dst, 6, jnp.float32, impl)
            np.testing.assert_array_equal(got, expect, err_msg=f"{impl} {src} {dst}")
    none = np.zeros((0,), np.int32)  # no entry at all: the pool comes back unchanged
    for impl in ("pallas", "xla", "compact"):
        np.testing.assert_array_equal(run_fetch(host, none, none, 6, jnp.float32, impl),
                                      np.full((6, row), np.nan, np.float32), err_msg=impl)


def test_fetch_from_device_array(rng):
    """Every implementation also works when the source is a device array."""
    host, src, dst, expect = make_case(rng, 10, 7, 512, 6, jnp.bfloat16)
    for impl in ("pallas", "xla", "compact"):
        pool = jnp.full((7, 512), jnp.nan, jnp.bfloat16)
        out = page_fetch.fetch_pages(jnp.asarray(host, jnp.bfloat16), pool, jnp.asarray(src),
                                     jnp.asarray(dst), implementation=impl)
        np.testing.assert_array_equal(as_f32(out), expect)


def test_resolve_tuning():
    t = page_fetch.resolve_tuning(2048, 2048, 2)  # 2048 misses of 4 KiB
    assert t.chunk_elems == 2048 and t.chunks_per_program == 1
    assert t.pages_per_program >= 2 and 2048 // t.pages_per_program >= 132
    t = page_fetch.resolve_tuning(256, 6144, 2, chunk_elems=0, chunks_per_program=0)
    assert (t.chunk_elems, t.chunks_per_program) == (2048, 3)
    t = page_fetch.resolve_tuning(1024, 32768, 2)
    assert t.pages_per_program == 1 and t.chunk_elems * 2 == page_fetch.DEFAULT_CHUNK_BYTES
    t = page_fetch.resolve_tuning(5, 32768, 2)  # few pages: rows split into small chunks
    assert t.pages_per_program == 1 and t.chunk_elems * 2 == page_fetch.DEFAULT_MIN_CHUNK_BYTES
    for m, r, isz in [(1, 384, 4), (13, 6144, 2), (4096, 131072, 2), (7, 2048, 4)]:
        t = page_fetch.resolve_tuning(m, r, isz)
        for v in (t.pages_per_program, t.chunk_elems):
            assert v & (v - 1) == 0
        assert r % (t.chunk_elems * t.chunks_per_program) == 0
        assert t.pages_per_program * t.chunk_elems * isz <= 64 * 1024


# ---------------------------------------------------------------- Triton lowering (no GPU)
@pytest.mark.parametrize("row,n_host", [(6144, 1 << 20), (32768, 1 << 17), (2048, 1 << 10)],
                         ids=["3x64ps16_12GiB", "8x128ps16_8GiB", "8x128ps1_4MiB"])
def test_fetch_lowers_to_triton(no_interpret, row, n_host):
    sds = jax.ShapeDtypeStruct
    for tuning in TUNINGS + [dict(pages_per_program=8, chunk_elems=1 << 14, chunks_per_program=4)]:
        txt = lower_for_h200(
            lambda h, p, s, d: page_fetch.fetch_pages(h, p, s, d, implementation="pallas", **tuning),
            sds((n_host, row), jnp.bfloat16, sharding=HOST), sds((64, row), jnp.bfloat16),
            sds((37,), jnp.int32), sds((37,), jnp.int32))
        assert "__gpu$xla.gpu.triton" in txt


def test_fetch_benchmark_variants_lower_to_triton(no_interpret):
    """Shapes and tunings of the benchmark sweep (8x128 bf16, page sizes 1..128)."""
    sds = jax.ShapeDtypeStruct
    kib = lambda n: n * 1024 // 2
    variants = [page_fetch.naive_tuning(), {},
                dict(pages_per_program=1, chunk_elems=kib(2), chunks_per_program=1),
                dict(pages_per_program=8, chunk_elems=kib(4), chunks_per_program=1, num_warps=8),
                dict(pages_per_program=2, chunk_elems=kib(16), chunks_per_program=1, num_warps=8),
                dict(pages_per_program=1, chunk_elems=kib(16), chunks_per_program=4, num_warps=8)]
    for ps, m in [(1, 2048), (2, 256), (128, 64)]:
        row = 2 * 8 * ps * 128
        for tuning in variants:
            txt = lower_for_h200(
                lambda h, p, s, d: page_fetch.fetch_pages(h, p, s, d, implementation="pallas",
                                                          **tuning),
                sds((2**31 // row, row), jnp.bfloat16, sharding=HOST),
                sds((m, row), jnp.bfloat16), sds((m,), jnp.int32), sds((m,), jnp.int32))
            assert "__gpu$xla.gpu.triton" in txt


# ---------------------------------------------------------------- decode-like loop
def _loop(impl, L, P, S, H, D, ps, T):
    """fori_loop over T steps; carry (host [L*P, R] pinned_host, pool [L*S, R]).

    Step t writes token t (all layers) into host page t // ps at offset t % ps, then fetches
    fetch_src[t] -> fetch_dst[t] (which include the page just written)."""

    def run(host, pool, kv, fsrc, fdst):
        def body(t, carry):
            host, pool = carry
            rows = jnp.arange(L, dtype=jnp.int32) * P + t // ps
            offs = jnp.full((L,), t % ps, jnp.int32)
            host = page_write.keep_on_host(page_write.write_tokens(
                host, rows, offs, kv[t], page_size=ps,
                implementation="xla" if impl == "compact" else impl))
            pool = page_fetch.fetch_pages(host, pool, fsrc[t], fdst[t], implementation=impl)
            return host, pool
        return jax.lax.fori_loop(0, T, body, (host, pool))

    return jax.jit(run, donate_argnums=(0, 1), out_shardings=(HOST, DEVICE))


def _loop_case(rng, L, P, S, H, D, ps, T, M):
    R = 2 * H * ps * D
    host = rng.standard_normal((L * P, R)).astype(np.float32)
    kv = rng.standard_normal((T, L, 2, H, D)).astype(np.float32)
    fsrc = np.full((T, M), -1, np.int32)
    fdst = np.full((T, M), -1, np.int32)
    for t in range(T):
        n = rng.integers(1, M + 1)
        fsrc[t, 0] = (t // ps)  # layer 0's page just written
        fsrc[t, 1:n] = rng.integers(0, L * P, n - 1)
        fdst[t, :n] = rng.permutation(L * S)[:n]
    h = host.copy().reshape(L * P, 2, H, ps, D)
    pool = np.full((L * S, R), np.nan, np.float32)
    for t in range(T):
        for l in range(L):
            h[l * P + t // ps, :, :, t % ps, :] = kv[t, l]
        hf = h.reshape(L * P, R)
        for s, d in zip(fsrc[t], fdst[t]):
            if s >= 0 and d >= 0:
                pool[d] = hf[s]
    return host, kv, fsrc, fdst, h.reshape(L * P, R), pool


@pytest.mark.parametrize("impl", ["pallas", "xla", "compact"])
def test_fetch_and_write_in_fori_loop_with_host_carry(rng, impl):
    L, P, S, H, D, ps, T, M = 2, 5, 4, 3, 64, 2, 6, 5
    host, kv, fsrc, fdst, want_host, want_pool = _loop_case(rng, L, P, S, H, D, ps, T, M)
    f = _loop(impl, L, P, S, H, D, ps, T)
    h = jax.device_put(jnp.asarray(host), HOST)
    pool = jnp.full((L * S, host.shape[1]), jnp.nan, jnp.float32)
    h, pool = f(h, pool, jnp.asarray(kv), jnp.asarray(fsrc), jnp.asarray(fdst))
    assert h.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(h), want_host)
    np.testing.assert_array_equal(np.asarray(pool), want_pool)


# ---------------------------------------------------------------- GPU only
def _whole_array_copies(hlo_text, shape):
    dims = ",".join(str(s) for s in shape)
    return [ln.strip()[:200] for ln in hlo_text.splitlines()
            if f"[{dims}]" in ln and (" copy(" in ln or "copy-start" in ln or "copy-done" in ln)]


@pytest.mark.gpu
def test_gpu_loop_hlo_has_no_host_array_copy(rng):
    L, P, S, H, D, ps, T, M = 4, 4096, 64, 8, 128, 16, 8, 32  # 1 GiB host tier
    R = 2 * H * ps * D
    f = _loop("pallas", L, P, S, H, D, ps, T)
    host = host_zeros((L * P, R))
    pool = jnp.zeros((L * S, R), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((T, L, 2, H, D)), jnp.bfloat16)
    fsrc = jnp.asarray(rng.integers(0, L * P, (T, M)), jnp.int32).at[:, 0].set(
        jnp.arange(T, dtype=jnp.int32) // ps)
    fdst = jnp.asarray(np.stack([rng.permutation(L * S)[:M] for _ in range(T)]), jnp.int32)
    txt = f.lower(host, pool, kv, fsrc, fdst).compile().as_text()
    copies = _whole_array_copies(txt, (L * P, R))
    assert not copies, copies
    host, pool = f(host, pool, kv, fsrc, fdst)
    assert host.sharding.memory_kind == "pinned_host"
    # last step: entry 0 fetched host page (T-1)//ps of layer 0, holding tokens 0..T-1
    got = np.asarray(pool[int(fdst[T - 1, 0])].astype(jnp.float32)).reshape(2, H, ps, D)
    want = np.asarray(kv.astype(jnp.float32))[:, 0].transpose(1, 2, 0, 3)  # [2, H, T, D]
    np.testing.assert_array_equal(got[:, :, :T], want)


@pytest.mark.gpu
def test_gpu_fetch_large_host_array_64bit_offsets(rng):
    """Host array of 5 GiB: rows beyond 4 GiB need 64-bit offsets in the kernel."""
    R = 32768  # 8x128 bf16 page_size 16: 64 KiB rows
    N = 5 * 2**30 // (R * 2)
    host = host_zeros((N, R))
    rows = np.array([0, N // 2, N - 3, N - 2, N - 1], np.int32)
    vals = jnp.asarray(rng.standard_normal((5, R)), jnp.bfloat16)
    host = page_write.write_pages(host, jnp.asarray(rows), vals, implementation="pallas")
    src = np.array([N - 1, -1, N - 3, 0, N // 2, N - 2], np.int32)
    dst = np.array([5, 1, 0, 7, -1, 3], np.int32)
    for tuning in TUNINGS:
        pool = jnp.full((8, R), jnp.nan, jnp.bfloat16)
        pool = page_fetch.fetch_pages(host, pool, jnp.asarray(src), jnp.asarray(dst),
                                      implementation="pallas", **tuning)
        got = as_f32(pool)
        vf = as_f32(vals)
        by_row = dict(zip(rows.tolist(), vf))
        for s, d in zip(src, dst):
            if s >= 0 and d >= 0:
                np.testing.assert_array_equal(got[d], by_row[int(s)], err_msg=str(tuning))
        assert np.isnan(got[[2, 4, 6]]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("heads,page_size,m", [("8x128", 16, 512), ("3x64", 16, 300),
                                              ("8x128", 1, 2048), ("3x64", 64, 100)])
def test_gpu_fetch_random_large(rng, heads, page_size, m):
    H, D = HEADS[heads]
    row = 2 * H * page_size * D
    host, src, dst, expect = make_case(rng, 3 * m, m + 7, row, m, jnp.bfloat16, p_invalid=0.1)
    for tuning in TUNINGS:
        got = run_fetch(host, src, dst, m + 7, jnp.bfloat16, "pallas", **tuning)
        np.testing.assert_array_equal(got, expect, err_msg=str(tuning))
    ref = run_fetch(host, src, dst, m + 7, jnp.bfloat16, "xla")
    np.testing.assert_array_equal(ref, expect)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_move_rows_in_place(impl):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    N, R, M = 40, 384, 9
    arr = rng.standard_normal((N, R)).astype(np.float32)
    perm = rng.permutation(N)
    src, dst = perm[:M].copy(), perm[M:2 * M].copy()
    src[2], dst[5] = -1, -1
    want = arr.copy()
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            want[d] = arr[s]
    got = page_fetch.move_rows(jnp.asarray(arr), jnp.asarray(src, jnp.int32),
                               jnp.asarray(dst, jnp.int32), implementation=impl)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"seed {seed}")


# ---------------------------------------------------------------- fetch_layer_pages
def _layer_case(rng, L, P, S, R, row, *, compact):
    """Per-layer lists: ``n_l`` distinct pages -> distinct slots per layer (compacted at the
    front, or scattered between -1 holes), a few invalid / out-of-range entries; host rows
    that are never listed are NaN; expected pool from a numpy loop."""
    src = np.full((L, R), -1, np.int32)
    dst = np.full((L, R), -1, np.int32)
    for l in range(L):
        n = int(rng.integers(0, min(R, S) + 1)) if l else 0  # layer 0: nothing to fetch
        pos = np.arange(n) if compact else np.sort(rng.permutation(R)[:n])
        src[l, pos] = rng.permutation(P)[:n]
        dst[l, pos] = rng.permutation(S)[:n]
    if L > 1 and R > 2:  # out-of-range / half-invalid entries move nothing
        src[-1, -1], dst[-1, -1] = P, 0
        src[-1, -2], dst[-1, -2] = 1, -1
    host = np.full((L * P, row), np.nan, np.float32)
    ok = (src >= 0) & (src < P) & (dst >= 0) & (dst < S)
    lcol = np.arange(L)[:, None]
    used = (lcol * P + src)[ok]
    host[used] = rng.standard_normal((used.size, row))
    pool = np.full((L * S + 3, row), np.nan, np.float32)  # 3 spare rows stay NaN
    expect = pool.copy()
    expect[(lcol * S + dst)[ok]] = host[(lcol * P + src)[ok]]
    return host, src, dst, pool, expect


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fetch_layer_pages_matches_numpy(impl, compact, dtype):
    dtype = DTYPES[dtype]
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    L, P, S, R, row = 3, 11, 6, 5, 192
    host, src, dst, pool, expect = _layer_case(rng, L, P, S, R, row, compact=compact)
    expect = as_f32(jnp.asarray(expect, dtype))
    tuning = dict(chunk_elems=64, programs_per_layer=2) if compact else {}
    out = page_fetch.fetch_layer_pages(
        jax.device_put(jnp.asarray(host, dtype), HOST), jnp.asarray(pool, dtype),
        jnp.asarray(src), jnp.asarray(dst), src_stride=P, dst_stride=S, implementation=impl,
        **(tuning if impl == "pallas" else {}))
    np.testing.assert_array_equal(as_f32(out), expect, err_msg=f"seed {seed}")


def test_fetch_layer_pages_checks_shapes():
    host = jnp.zeros((20, 8), jnp.float32)
    with pytest.raises(ValueError, match="exceed the rows"):
        page_fetch.fetch_layer_pages(host, jnp.zeros((10, 8), jnp.float32),
                                     jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32),
                                     src_stride=10, dst_stride=6)
    with pytest.raises(ValueError, match="must both be"):
        page_fetch.fetch_layer_pages(host, jnp.zeros((12, 8), jnp.float32),
                                     jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4), jnp.int32),
                                     src_stride=10, dst_stride=6)


@pytest.mark.gpu
@pytest.mark.parametrize("compact", [True, False])
def test_gpu_fetch_layer_pages_in_jitted_loop(rng, compact):
    """Compiled kernel, pinned_host source, pool donated through a jitted fori_loop that
    fetches a different random per-layer list each iteration (engine-like sizes)."""
    L, P, S, R, T = 8, 96, 40, 36, 4
    row = 2 * 8 * 64 * 128 // 8  # 32 KiB bf16 rows
    cases = [_layer_case(rng, L, P, S, R, row, compact=compact) for _ in range(T)]
    host_np = np.where(np.isnan(cases[0][0]), 0, cases[0][0])
    for c in cases[1:]:
        host_np = np.where(np.isnan(host_np) | (host_np == 0), np.nan_to_num(c[0]), host_np)
    host_np = np.asarray(jnp.asarray(host_np, jnp.bfloat16).astype(jnp.float32))
    src = jnp.asarray(np.stack([c[1] for c in cases]))
    dst = jnp.asarray(np.stack([c[2] for c in cases]))

    @jax.jit
    def loop(host, pool, src, dst):
        def body(t, pool):
            return page_fetch.fetch_layer_pages(host, pool, src[t], dst[t], src_stride=P,
                                                dst_stride=S, implementation="pallas")
        return jax.lax.fori_loop(0, T, body, pool)

    host = jax.device_put(jnp.asarray(host_np, jnp.bfloat16), HOST)
    pool0 = np.full((L * S + 3, row), np.nan, np.float32)
    got = as_f32(jax.jit(loop, donate_argnums=1)(host, jnp.asarray(pool0, jnp.bfloat16), src, dst))
    want = pool0
    lcol = np.arange(L)[:, None]
    for c in cases:
        ok = (c[1] >= 0) & (c[1] < P) & (c[2] >= 0) & (c[2] < S)
        want[(lcol * S + c[2])[ok]] = host_np[(lcol * P + c[1])[ok]]
    np.testing.assert_array_equal(got, want)


def test_fetch_layer_pages_lowers_to_triton(no_interpret):
    """The kernel's data-dependent loop lowers to Triton for an (abstract) H200, at the
    engine's 8B-like shape (32 layers, 260 requests, 256 KiB rows) and a small one."""
    sds = jax.ShapeDtypeStruct
    for L, P, S, R, row in [(32, 2048, 520, 260, 2 * 8 * 64 * 128), (4, 64, 8, 5, 384)]:
        txt = lower_for_h200(
            lambda h, p, s, d: page_fetch.fetch_layer_pages(
                h, p, s, d, src_stride=P, dst_stride=S, implementation="pallas"),
            sds((L * P, row), jnp.bfloat16, sharding=HOST), sds((L * S, row), jnp.bfloat16),
            sds((L, R), jnp.int32), sds((L, R), jnp.int32))
        assert "__gpu$xla.gpu.triton" in txt
