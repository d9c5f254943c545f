"""write_tokens / write_pages: Pallas kernels (interpret mode on CPU) and jnp references vs
a numpy oracle, into pinned_host and device arrays; keep_on_host; Triton lowering; GPU-only
checks (host arrays > 4 GiB, write-through in a jitted loop without a whole-array copy)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jaxkv.kernels import _common, kv_quant, page_write

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

from page_kernel_util import (DEV0, DEVICE, DTYPES, HEADS, HOST, SHAPES, as_f32,  # noqa: F401,E402
                              host_zeros, rng)


def token_case(rng, n, H, D, ps, m, dtype):
    """Distinct valid (row, offset) pairs, rows repeat; some -1 rows / bad offsets."""
    pairs = rng.permutation(n * ps)[:m]
    rows = (pairs // ps).astype(np.int32)
    offs = (pairs % ps).astype(np.int32)
    bad = rng.random(m) < 0.3
    rows[bad & (rng.random(m) < 0.6)] = -1
    offs[bad & (rows >= 0)] = ps  # out of range offset: skipped too
    kv = np.asarray(jnp.asarray(rng.standard_normal((m, 2, H, D)), dtype).astype(jnp.float32))
    expect = np.full((n, 2, H, ps, D), np.nan, np.float32)
    for r, o, x in zip(rows, offs, kv):
        if r >= 0 and o < ps:
            expect[r, :, :, o, :] = x
    return rows, offs, kv, expect.reshape(n, -1)


def run_tokens(n, row, rows, offs, kv, ps, dtype, impl, on_host):
    dst = jnp.full((n, row), jnp.nan, dtype)
    if on_host:
        dst = jax.device_put(dst, HOST)
    out = page_write.write_tokens(dst, jnp.asarray(rows), jnp.asarray(offs),
                                  jnp.asarray(kv, dtype), page_size=ps, implementation=impl)
    assert out.sharding.memory_kind == ("pinned_host" if on_host else "device")
    space = jax.memory.Space.Host if on_host else jax.memory.Space.Device
    assert jax.typeof(out).memory_space == space  # eager results keep the input's type
    return as_f32(out)


@pytest.mark.parametrize("heads,page_size,dtype", SHAPES)
def test_write_tokens_matches_reference(rng, heads, page_size, dtype):
    H, D = HEADS[heads]
    row = 2 * H * page_size * D
    n = 3 if row * 4 > 256 * 1024 else 6
    m = min(7, n * page_size)
    rows, offs, kv, expect = token_case(rng, n, H, D, page_size, m, DTYPES[dtype])
    on_host = page_size != 2  # the write-through case, plus the device pool for ps=2
    for impl in ("pallas", "xla"):
        got = run_tokens(n, row, rows, offs, kv, page_size, DTYPES[dtype], impl, on_host)
        np.testing.assert_array_equal(got, expect, err_msg=impl)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_write_tokens_pair(rng, impl):
    """One launch writes each token into the host tier and (where its row is valid) the pool:
    each array gets exactly what write_tokens would write into it."""
    H, D, ps, n = 3, 64, 4, 6
    row = 2 * H * ps * D
    rows, offs, kv, expect_host = token_case(rng, n, H, D, ps, 7, jnp.float32)
    pool_rows = np.where(rng.random(7) < 0.5, (rows + 2) % 5, -1).astype(np.int32)
    pool_rows[rows < 0] = -1
    expect_pool = np.full((5, 2, H, ps, D), np.nan, np.float32)
    for r, o, x in zip(pool_rows, offs, kv):
        if r >= 0 and o < ps:
            expect_pool[r, :, :, o, :] = x

    def f(host, pool):
        h, p = page_write.write_tokens_pair(host, jnp.asarray(rows), pool, jnp.asarray(pool_rows),
                                            jnp.asarray(offs), jnp.asarray(kv), page_size=ps,
                                            implementation=impl)
        return page_write.keep_on_host(h), p

    host = jax.device_put(jnp.full((n, row), jnp.nan, jnp.float32), HOST)
    pool = jnp.full((5, row), jnp.nan, jnp.float32)
    h, p = jax.jit(f, donate_argnums=(0, 1), out_shardings=(HOST, DEVICE))(host, pool)
    assert h.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(as_f32(h), expect_host)
    np.testing.assert_array_equal(as_f32(p), expect_pool.reshape(5, row))


def test_write_tokens_casts_kv(rng):
    rows, offs, kv, expect = token_case(rng, 4, 3, 64, 4, 6, jnp.bfloat16)
    got = run_tokens(4, 2 * 3 * 4 * 64, rows, offs, kv.astype(np.float32), 4, jnp.bfloat16,
                     "pallas", True)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("heads,page_size,dtype,on_host", [
    ("3x64", 16, "f32", True), ("8x128", 2, "bf16", True), ("3x64", 1, "bf16", False),
    ("8x128", 64, "f32", False)])
def test_write_pages_matches_reference(rng, heads, page_size, dtype, on_host):
    H, D = HEADS[heads]
    row = 2 * H * page_size * D
    n, m = (4, 3) if row * 4 > 256 * 1024 else (9, 6)
    rows = rng.permutation(n)[:m].astype(np.int32)
    rows[rng.random(m) < 0.3] = -1
    pages = as_f32(jnp.asarray(rng.standard_normal((m, row)), DTYPES[dtype]))
    expect = np.full((n, row), np.nan, np.float32)
    for r, p in zip(rows, pages):
        if r >= 0:
            expect[r] = p
    for impl in ("pallas", "xla"):
        dst = jnp.full((n, row), jnp.nan, DTYPES[dtype])
        if on_host:
            dst = jax.device_put(dst, HOST)
        tuning = dict(chunk_elems=16384, chunks_per_program=0) if impl == "pallas" else {}
        out = page_write.write_pages(dst, jnp.asarray(rows), jnp.asarray(pages, DTYPES[dtype]),
                                     implementation=impl, **tuning)
        assert out.sharding.memory_kind == ("pinned_host" if on_host else "device")
        np.testing.assert_array_equal(as_f32(out), expect, err_msg=impl)


def test_keep_on_host():
    x = jax.device_put(jnp.zeros((4, 8)), HOST)
    assert page_write.keep_on_host(x) is x  # eager: no-op

    def f(h):
        y = page_write.write_pages(h, jnp.array([1], jnp.int32), jnp.ones((1, 8)),
                                   implementation="pallas")
        assert jax.typeof(y).memory_space == jax.memory.Space.Device  # pallas output type
        z = page_write.keep_on_host(y)
        assert jax.typeof(z).memory_space == jax.memory.Space.Host
        assert page_write.keep_on_host(z) is z
        return z

    out = jax.jit(f, donate_argnums=0, out_shardings=HOST)(x)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [0, 1, 0, 0])


def test_write_tokens_in_loop_with_host_carry(rng):
    """Write-through of one token for all layers per step, host tier as the loop carry."""
    L, P, H, D, ps, T = 3, 2, 3, 64, 4, 6
    R = 2 * H * ps * D
    kv = rng.standard_normal((T, L, 2, H, D)).astype(np.float32)

    def run(host, kv):
        def body(t, host):
            rows = jnp.arange(L, dtype=jnp.int32) * P + t // ps
            host = page_write.write_tokens(host, rows, jnp.full((L,), t % ps, jnp.int32), kv[t],
                                           page_size=ps, implementation="pallas")
            return page_write.keep_on_host(host)
        return jax.lax.fori_loop(0, T, body, host)

    host = jax.device_put(jnp.full((L * P, R), jnp.nan, jnp.float32), HOST)
    out = jax.jit(run, donate_argnums=0, out_shardings=HOST)(host, jnp.asarray(kv))
    want = np.full((L * P, 2, H, ps, D), np.nan, np.float32)
    for t in range(T):
        for l in range(L):
            want[l * P + t // ps, :, :, t % ps] = kv[t, l]
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), want.reshape(L * P, R))


def test_write_lowers_to_triton(monkeypatch):
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    monkeypatch.setattr(_common, "interpret_mode", lambda: False)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    sds = jax.ShapeDtypeStruct

    def lower(fn, *avals):
        with use_abstract_mesh(mesh):
            return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()

    for (H, D), ps, n in [((3, 64), 16, 1 << 20), ((8, 128), 1, 1 << 10), ((8, 128), 64, 40000)]:
        R = 2 * H * ps * D
        txt = lower(lambda h, r, o, kv: page_write.write_tokens(h, r, o, kv, page_size=ps,
                                                                implementation="pallas"),
                    sds((n, R), jnp.bfloat16, sharding=HOST), sds((32,), jnp.int32),
                    sds((32,), jnp.int32), sds((32, 2, H, D), jnp.bfloat16))
        assert "__gpu$xla.gpu.triton" in txt
        txt = lower(lambda h, r, p, o, kv: page_write.write_tokens_pair(
                        h, r, p, r, o, kv, page_size=ps, implementation="pallas"),
                    sds((n, R), jnp.bfloat16, sharding=HOST), sds((32,), jnp.int32),
                    sds((64, R), jnp.bfloat16), sds((32,), jnp.int32),
                    sds((32, 2, H, D), jnp.bfloat16))
        assert "__gpu$xla.gpu.triton" in txt
        txt = lower(lambda h, r, p: page_write.write_pages(h, r, p, implementation="pallas"),
                    sds((n, R), jnp.bfloat16, sharding=HOST), sds((5,), jnp.int32),
                    sds((5, R), jnp.bfloat16))
        assert "__gpu$xla.gpu.triton" in txt


# ---------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_gpu_write_large_host_array_64bit_offsets(rng):
    H, D, ps = 8, 128, 16
    R = 2 * H * ps * D
    N = 5 * 2**30 // (R * 2)
    host = host_zeros((N, R))
    rows = np.array([N - 1, 3, -1, N - 1, N // 2], np.int32)
    offs = np.array([15, 0, 4, 2, 7], np.int32)
    kv = jnp.asarray(rng.standard_normal((5, 2, H, D)), jnp.bfloat16)
    host = page_write.write_tokens(host, jnp.asarray(rows), jnp.asarray(offs), kv, page_size=ps,
                                   implementation="pallas")
    pages = jnp.asarray(rng.standard_normal((2, R)), jnp.bfloat16)
    host = page_write.write_pages(host, jnp.array([N - 2, -1], jnp.int32), pages,
                                  implementation="pallas")
    assert host.sharding.memory_kind == "pinned_host"
    kvf = as_f32(kv)
    for i, (r, o) in enumerate(zip(rows, offs)):
        if r >= 0:
            got = as_f32(host[int(r)]).reshape(2, H, ps, D)
            np.testing.assert_array_equal(got[:, :, o], kvf[i])
    np.testing.assert_array_equal(as_f32(host[N - 2]), as_f32(pages[0]))
    np.testing.assert_array_equal(as_f32(host[N - 3]), 0)


@pytest.mark.gpu
def test_gpu_write_tokens_pair_in_loop(rng):
    """The engine's write-through: host tier (loop carry) and device pool in one launch per
    step, inside a jitted loop, without a copy of either array."""
    L, P, S, H, D, ps, T = 4, 64, 8, 8, 128, 16, 6
    R = 2 * H * ps * D
    kv = jnp.asarray(rng.standard_normal((T, L, 2, H, D)), jnp.bfloat16)

    def run(host, pool, kv):
        def body(t, carry):
            host, pool = carry
            rows = jnp.arange(L, dtype=jnp.int32) * P + t // ps
            prow = jnp.where(jnp.arange(L) % 2 == 0, jnp.arange(L, dtype=jnp.int32) * S, -1)
            host, pool = page_write.write_tokens_pair(
                host, rows, pool, prow, jnp.full((L,), t % ps, jnp.int32), kv[t], page_size=ps,
                implementation="pallas")
            return page_write.keep_on_host(host), pool
        return jax.lax.fori_loop(0, T, body, (host, pool))

    f = jax.jit(run, donate_argnums=(0, 1), out_shardings=(HOST, DEVICE))
    host = host_zeros((L * P, R))
    pool = jnp.zeros((L * S, R), jnp.bfloat16, device=DEVICE)
    txt = f.lower(host, pool, kv).compile().as_text()
    assert not [ln for ln in txt.splitlines() if " copy(" in ln and f"{L * P}," in ln]
    host, pool = f(host, pool, kv)
    kvf = as_f32(kv)
    for t in range(T):
        for l in range(L):
            got = as_f32(host[l * P + t // ps]).reshape(2, H, ps, D)[:, :, t % ps]
            np.testing.assert_array_equal(got, kvf[t, l])
            if l % 2 == 0:
                got = as_f32(pool[l * S]).reshape(2, H, ps, D)[:, :, t % ps]
                np.testing.assert_array_equal(got, kvf[t, l])


@pytest.mark.gpu
def test_gpu_write_through_jit_no_host_copy(rng):
    L, P, H, D, ps, T = 32, 512, 8, 128, 16, 8  # 1 GiB host tier
    R = 2 * H * ps * D

    def run(host, kv):
        def body(t, host):
            rows = jnp.arange(L, dtype=jnp.int32) * P + t // ps
            host = page_write.write_tokens(host, rows, jnp.full((L,), t % ps, jnp.int32), kv[t],
                                           page_size=ps, implementation="pallas")
            return page_write.keep_on_host(host)
        return jax.lax.fori_loop(0, T, body, host)

    f = jax.jit(run, donate_argnums=0, out_shardings=HOST)
    host = host_zeros((L * P, R))
    kv = jnp.asarray(rng.standard_normal((T, L, 2, H, D)), jnp.bfloat16)
    txt = f.lower(host, kv).compile().as_text()
    big = [ln for ln in txt.splitlines() if f"[{L * P},{R}]" in ln and " copy" in ln]
    assert not big, big[:3]
    host = f(host, kv)
    got = as_f32(host[5 * P]).reshape(2, H, ps, D)[:, :, :T]
    np.testing.assert_array_equal(got, as_f32(kv[:, 5]).transpose(1, 2, 0, 3))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_rows_past_the_array_write_nothing(rng, impl):
    """Rows >= the array's row count (and huge ones) are skipped like -1, by both writers: no
    clamped write lands in the last row."""
    H, D, ps, n = 3, 64, 4, 5
    row = 2 * H * ps * D
    rows = np.array([n, 2, n + 7, 2**30, -1, 0], np.int32)
    offs = np.array([0, 1, 3, 2, 0, 3], np.int32)
    kv = rng.standard_normal((6, 2, H, D)).astype(np.float32)
    got = run_tokens(n, row, rows, offs, kv, ps, jnp.float32, impl, True)
    expect = np.full((n, 2, H, ps, D), np.nan, np.float32)
    expect[2, :, :, 1], expect[0, :, :, 3] = kv[1], kv[5]
    np.testing.assert_array_equal(got, expect.reshape(n, row))

    pages = rng.standard_normal((4, row)).astype(np.float32)
    prow = np.array([n, 1, 2**30, n + 1], np.int32)
    tuning = dict(chunk_elems=16384, chunks_per_program=0) if impl == "pallas" else {}
    out = page_write.write_pages(jax.device_put(jnp.full((n, row), jnp.nan), HOST),
                                 jnp.asarray(prow), jnp.asarray(pages), implementation=impl,
                                 **tuning)
    expect = np.full((n, row), np.nan, np.float32)
    expect[1] = pages[1]
    np.testing.assert_array_equal(as_f32(out), expect)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_zero_entries_write_nothing(impl, dtype):
    """M = 0 entries (no token, no page): the array comes back unchanged, NaN rows included,
    from both writers and both dtypes (a quantized array encodes its empty batch too)."""
    H, D, ps, n = 2, 16, 4, 3
    dt = jnp.int8 if dtype == "int8" else jnp.float32
    row = kv_quant.row_elems(dt, H, ps, D)
    dst0 = np.full((n, row), np.nan if dtype == "f32" else 7, np.float32)
    none = jnp.zeros((0,), jnp.int32)
    out = page_write.write_tokens(jnp.asarray(dst0, dt), none, none, jnp.zeros((0, 2, H, D)),
                                  page_size=ps, implementation=impl)
    np.testing.assert_array_equal(as_f32(out), dst0)
    out = page_write.write_pages(jnp.asarray(dst0, dt), none, jnp.zeros((0, row), dt),
                                 implementation=impl)
    np.testing.assert_array_equal(as_f32(out), dst0)
