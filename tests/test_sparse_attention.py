"""Tests of jaxkv.kernels.sparse_attention: Pallas kernel (interpret mode on CPU, Triton on GPU)
and the blocked jnp formulation (the CPU default) vs the pure-jnp reference, the reference vs a
float64 numpy softmax, merge_attention, and a CPU-only check that the kernel lowers to Triton IR
for an H200 (power-of-two blocks etc.)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import _common
from jaxkv.kernels import sparse_attention as sa
from jaxkv.kernels.sparse_attention import AttentionTuning, merge_attention, sparse_paged_attention

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
LSE_TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-4, atol=1e-4)}


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**32)


def make_case(seed, *, B, H, G, D, ps, K, dtype, max_pages=6, extra_rows=5, empty_request=False):
    """Random pool + selections: page rows are a random permutation, heads pick random page subsets
    in random slot order, -1 padding, invalid half-entries, fully masked pages, NaN-poisoned unused
    rows and token slots past each sequence's end."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, max_pages * ps + 1, size=B)
    n_pages = -(-seq_lens // ps)
    n_rows = int(n_pages.sum()) + extra_rows
    perm = rng.permutation(n_rows)
    row_of, r = {}, 0
    for b in range(B):
        for j in range(n_pages[b]):
            row_of[b, j] = int(perm[r]); r += 1
    R = 2 * H * ps * D
    pool = np.full((n_rows, 2, H, ps, D), np.nan, np.float32)
    for (b, j), row in row_of.items():
        n_tok = min(ps, int(seq_lens[b]) - j * ps)
        pool[row, :, :, :n_tok] = rng.standard_normal((2, H, n_tok, D))
    rows = np.full((B, H, K), -1, np.int32)
    pidx = np.full((B, H, K), -1, np.int32)
    for b in range(B):
        if empty_request and b == 0:
            continue
        for h in range(H):
            n = int(rng.integers(1, min(K, n_pages[b]) + 1))
            pages = rng.choice(n_pages[b], size=n, replace=False)
            slots = rng.choice(K, size=n, replace=False)
            rows[b, h, slots] = [row_of[b, int(p)] for p in pages]
            pidx[b, h, slots] = pages
            free = np.setdiff1d(np.arange(K), slots)
            if len(free) and rng.random() < 0.5:  # half-invalid entry: row set, page -1
                rows[b, h, free[0]] = int(rng.integers(n_rows))
            if len(free) > 1 and rng.random() < 0.5:  # page set, row -1
                pidx[b, h, free[1]] = 0
            if len(free) > 2 and rng.random() < 0.5:  # valid row, page past the end: all masked
                rows[b, h, free[2]] = int(rng.integers(n_rows))
                pidx[b, h, free[2]] = int(n_pages[b]) + 1
    q = rng.standard_normal((B, H * G, D)).astype(np.float32)
    return dict(
        q=jnp.asarray(q, dtype), pool=jnp.asarray(pool.reshape(n_rows, R), dtype),
        block_rows=jnp.asarray(rows), page_index=jnp.asarray(pidx),
        seq_lens=jnp.asarray(seq_lens, jnp.int32)), dict(page_size=ps, num_kv_heads=H)


def dense_f64(case, page_size, num_kv_heads, sm_scale=None):
    """Dense softmax in float64 numpy over the gathered tokens of each (b, query head)."""
    q = np.asarray(case["q"].astype(jnp.float32), np.float64)
    B, Hq, D = q.shape
    H, ps = num_kv_heads, page_size
    G = Hq // H
    pool = np.asarray(case["pool"].astype(jnp.float32), np.float64).reshape(-1, 2, H, ps, D)
    rows, pidx = np.asarray(case["block_rows"]), np.asarray(case["page_index"])
    lens = np.asarray(case["seq_lens"])
    scale = sm_scale or 1 / math.sqrt(D)
    out = np.zeros((B, Hq, D)); lse = np.full((B, Hq), -np.inf)
    for b in range(B):
        for h in range(H):
            ks, vs = [], []
            for r, p in zip(rows[b, h], pidx[b, h]):
                if r < 0 or p < 0:
                    continue
                n = int(np.clip(lens[b] - p * ps, 0, ps))
                ks.append(pool[r, 0, h, :n]); vs.append(pool[r, 1, h, :n])
            if not ks or sum(len(k) for k in ks) == 0:
                continue
            k, v = np.concatenate(ks), np.concatenate(vs)
            for g in range(G):
                s = k @ q[b, h * G + g] * scale
                m = s.max(); w = np.exp(s - m)
                out[b, h * G + g] = w @ v / w.sum(); lse[b, h * G + g] = m + np.log(w.sum())
    return out, lse


def check(a, b, dtype, seed, what, tol=TOL):
    np.testing.assert_allclose(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)),
                               err_msg=f"{what} (seed {seed})", **tol[dtype])


CASES = [  # (B, H, G, D, ps, K, dtype, num_splits)
    (2, 3, 3, 64, 16, 5, jnp.float32, None),   # SmolLM2: 9 query / 3 KV heads, G=3
    (2, 3, 3, 64, 16, 5, jnp.bfloat16, 2),
    (3, 2, 1, 32, 64, 4, jnp.float32, 1),      # G=1, 64-token pages
    (2, 2, 4, 32, 64, 3, jnp.bfloat16, None),  # G=4
    (2, 1, 8, 32, 16, 7, jnp.float32, 3),      # G=8, K not a multiple of the splits
    (2, 2, 8, 32, 8, 6, jnp.bfloat16, 2),      # 8-token pages (two pages per tile)
    (2, 2, 4, 32, 1, 20, jnp.float32, 2),      # 1-token pages (16 pages per tile)
]


@pytest.mark.parametrize("B,H,G,D,ps,K,dtype,num_splits", CASES)
def test_kernel_matches_reference(B, H, G, D, ps, K, dtype, num_splits):
    seed = fresh_seed()
    case, static = make_case(seed, B=B, H=H, G=G, D=D, ps=ps, K=K, dtype=dtype, max_pages=max(2, 24 // ps))
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    out, lse = sparse_paged_attention(**case, **static, num_splits=num_splits, implementation="pallas")
    assert out.shape == case["q"].shape and out.dtype == dtype and lse.shape == (B, H * G) and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(out, np.float32)).all(), f"non-finite output (seed {seed})"
    check(out, ref_o, dtype, seed, "out")
    check(lse, ref_l, dtype, seed, "lse", LSE_TOL)


@pytest.mark.parametrize("B,H,G,D,ps,K,dtype,num_splits", CASES + [
    (2, 3, 3, 64, 16, 40, jnp.float32, None),   # more entries than one default chunk
    (3, 2, 2, 32, 4, 37, jnp.bfloat16, None),
])
def test_blocked_matches_reference(B, H, G, D, ps, K, dtype, num_splits):
    """The blocked formulation with chunks of 3 and the default entries (a chunk past the
    last valid entry is skipped), from the pool and with half the pages on a host array."""
    del num_splits
    seed = fresh_seed()
    case, static = make_case(seed, B=B, H=H, G=G, D=D, ps=ps, K=K, dtype=dtype,
                             max_pages=max(2, 24 // ps, K))
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    split, _ = split_to_host(case, seed)
    for chunk in (None, 3):
        tuning = AttentionTuning(pages_per_iter=chunk)
        for name, c in (("pool", case), ("host", split)):
            out, lse = sparse_paged_attention(**c, **static, tuning=tuning, implementation="blocked")
            assert out.shape == case["q"].shape and out.dtype == dtype
            assert np.isfinite(np.asarray(out, np.float32)).all(), f"{name} {chunk} (seed {seed})"
            check(out, ref_o, dtype, seed, f"blocked {name} chunk {chunk} out")
            check(lse, ref_l, dtype, seed, f"blocked {name} chunk {chunk} lse", LSE_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocked_reads_a_pinned_host_array(dtype):
    """With the host tier in pinned_host memory (inside jit, as in the decode round) the
    blocked formulation gathers the entries' heads on the host: same result as the reference's
    row-by-row copies."""
    from jax.sharding import SingleDeviceSharding
    pinned = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    seed = fresh_seed()
    case, static = make_case(seed, B=2, H=3, G=3, D=64, ps=16, K=9, dtype=dtype, max_pages=9)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    split, _ = split_to_host(case, seed, on_host=lambda a: jax.device_put(a, pinned))
    assert split["host"].sharding.memory_kind == "pinned_host"
    for impl in ("blocked", "xla"):
        out, lse = jax.jit(lambda c: sparse_paged_attention(
            **c, **static, tuning=AttentionTuning(pages_per_iter=4), implementation=impl))(split)
        check(out, ref_o, dtype, seed, f"{impl} out")
        check(lse, ref_l, dtype, seed, f"{impl} lse", LSE_TOL)


def test_blocked_is_the_cpu_default(monkeypatch):
    monkeypatch.setattr(_common, "on_gpu", lambda: False)
    for var in ("JAXKV_IMPL", "JAXKV_IMPL_SPARSE_PAGED_ATTENTION"):
        monkeypatch.delenv(var, raising=False)
    assert _common.resolve(sa.OP) is sa.sparse_paged_attention_blocked
    assert _common.resolve(sa.OP, "xla") is sa.sparse_paged_attention_xla
    monkeypatch.setattr(_common, "on_gpu", lambda: True)
    assert _common.resolve(sa.OP) is sa.sparse_paged_attention_pallas
    case, static = make_case(fresh_seed(), B=1, H=1, G=1, D=16, ps=16, K=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="pages_per_iter=0 must be >= 1"):
        sparse_paged_attention(**case, **static, tuning=AttentionTuning(pages_per_iter=0),
                               implementation="blocked")


def split_to_host(case, seed, on_host=None):
    """Move a random half of the selected pages to a separate "host" array (random row order,
    NaN-poisoned spare rows) and poison their pool rows: entries then read block_rows = -1 and
    host_rows = their host row. The attention result must not change."""
    rng = np.random.default_rng(seed + 1)
    pool = np.array(case["pool"].astype(jnp.float32))
    rows = np.asarray(case["block_rows"])
    used = sorted({int(r) for r in rows[rows >= 0].ravel()})
    moved = [r for r in used if rng.random() < 0.5] or used[:1]  # at least one page moves
    n_host = len(moved) + 3
    host_of = dict(zip(moved, rng.permutation(n_host)[:len(moved)].tolist()))
    host = np.full((n_host, pool.shape[1]), np.nan, np.float32)
    for r, hr in host_of.items():
        host[hr] = pool[r]
        pool[r] = np.nan
    new_rows = np.where(np.isin(rows, moved), -1, rows)
    host_rows = np.vectorize(lambda r: host_of.get(int(r), -1))(rows).astype(np.int32)
    dt = case["pool"].dtype
    host = jnp.asarray(host, dt)
    if on_host is not None:
        host = on_host(host)
    return dict(case, pool=jnp.asarray(pool, dt), block_rows=jnp.asarray(new_rows),
                host=host, host_rows=jnp.asarray(host_rows)), len(moved)


@pytest.mark.parametrize("B,H,G,D,ps,K,dtype,num_splits", [CASES[0], CASES[3], CASES[5]])
def test_host_rows_read_in_place(B, H, G, D, ps, K, dtype, num_splits):
    """Entries missing from the pool are read from the host tier's rows: same result."""
    seed = fresh_seed()
    case, static = make_case(seed, B=B, H=H, G=G, D=D, ps=ps, K=K, dtype=dtype, max_pages=max(2, 24 // ps))
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    split, n_moved = split_to_host(case, seed)
    assert n_moved > 0
    for impl in ("xla", "pallas"):
        out, lse = sparse_paged_attention(**split, **static, num_splits=num_splits, implementation=impl)
        assert np.isfinite(np.asarray(out, np.float32)).all(), f"{impl}: non-finite (seed {seed})"
        check(out, ref_o, dtype, seed, f"{impl} out")
        check(lse, ref_l, dtype, seed, f"{impl} lse", LSE_TOL)
    with pytest.raises(ValueError, match="together"):
        sparse_paged_attention(**dict(split, host_rows=None), **static)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ps,G", [(16, 3), (64, 1), (8, 4)])
def test_reference_matches_float64(dtype, ps, G):
    seed = fresh_seed()
    case, static = make_case(seed, B=3, H=2, G=G, D=32, ps=ps, K=5, dtype=dtype, max_pages=4)
    o, l = sparse_paged_attention(**case, **static, sm_scale=0.3, implementation="xla")
    o64, l64 = dense_f64(case, **static, sm_scale=0.3)
    check(o, o64, dtype, seed, "out")
    check(l, l64, jnp.float32, seed, "lse")


def test_empty_selection_and_scale():
    seed = fresh_seed()
    case, static = make_case(seed, B=2, H=2, G=2, D=32, ps=16, K=4, dtype=jnp.float32, empty_request=True)
    # request 1, head 1: only fully masked pages (past the end) -> empty too
    rows = case["block_rows"].at[1, 1].set(jnp.asarray([0, 1, -1, -1]))
    case["block_rows"] = rows
    case["page_index"] = case["page_index"].at[1, 1].set(jnp.asarray([50, 51, 0, 0]))
    for impl in ("xla", "pallas", "blocked"):
        out, lse = sparse_paged_attention(**case, **static, sm_scale=0.125, num_splits=2, implementation=impl)
        assert (np.asarray(out[0]) == 0).all() and np.isneginf(np.asarray(lse[0])).all(), impl
        assert (np.asarray(out[1, 2:]) == 0).all() and np.isneginf(np.asarray(lse[1, 2:])).all(), impl
        assert np.isfinite(np.asarray(lse[1, :2])).all(), impl
    o64, l64 = dense_f64(case, **static, sm_scale=0.125)
    check(out, o64, jnp.float32, seed, "out")
    check(lse, l64, jnp.float32, seed, "lse")


def test_length_zero_request_with_listed_entries():
    """A request of length 0 (inactive) whose entries still name pool rows and pages (a stale
    selection): every token is masked, so out = 0, lse = -inf, with NaN in its rows; the
    other requests are unchanged."""
    seed = fresh_seed()
    case, static = make_case(seed, B=2, H=2, G=2, D=32, ps=16, K=4, dtype=jnp.float32)
    rows = np.asarray(case["block_rows"])
    mine = np.unique(rows[0][rows[0] >= 0])
    mine = mine[~np.isin(mine, rows[1])]   # rows of request 0 only: poisoned
    case["pool"] = case["pool"].at[jnp.asarray(mine, jnp.int32)].set(jnp.nan)
    case["page_index"] = case["page_index"].at[0].set(jnp.maximum(case["page_index"][0], 0))
    case["seq_lens"] = case["seq_lens"].at[0].set(0)
    o64, l64 = dense_f64(case, **static)
    for impl in ("xla", "pallas", "blocked"):
        out, lse = sparse_paged_attention(**case, **static, num_splits=2, implementation=impl)
        assert (np.asarray(out[0]) == 0).all() and np.isneginf(np.asarray(lse[0])).all(), \
            f"{impl} (seed {seed})"
        check(out, o64, jnp.float32, seed, f"{impl} out")
        check(lse, l64, jnp.float32, seed, f"{impl} lse")


def test_zero_entries():
    case, static = make_case(fresh_seed(), B=2, H=2, G=2, D=16, ps=16, K=3, dtype=jnp.bfloat16)
    case["block_rows"] = case["block_rows"][:, :, :0]
    case["page_index"] = case["page_index"][:, :, :0]
    for impl in ("xla", "pallas", "blocked"):
        out, lse = sparse_paged_attention(**case, **static, implementation=impl)
        assert out.shape == (2, 4, 16) and out.dtype == jnp.bfloat16 and (np.asarray(out, np.float32) == 0).all()
        assert lse.shape == (2, 4) and np.isneginf(np.asarray(lse)).all()


def test_duplicates_count_as_listed():
    """Documented semantics: a duplicated entry is attended twice, by both implementations."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    pool = np.full((3, 2, 1, 16, 32), np.nan, np.float32)
    pool[0] = rng.standard_normal((2, 1, 16, 32))
    pool[1, :, :, :4] = rng.standard_normal((2, 1, 4, 32))  # page 1 holds tokens 16..19
    case = dict(q=jnp.asarray(rng.standard_normal((1, 4, 32)), jnp.float32), pool=jnp.asarray(pool.reshape(3, -1)),
                block_rows=jnp.asarray([[[0, 1, -1, 0]]], jnp.int32),
                page_index=jnp.asarray([[[0, 1, -1, 0]]], jnp.int32), seq_lens=jnp.asarray([20], jnp.int32))
    static = dict(page_size=16, num_kv_heads=1)
    ref = sparse_paged_attention(**case, **static, implementation="xla")
    out = sparse_paged_attention(**case, **static, num_splits=2, implementation="pallas")
    blocked = sparse_paged_attention(**case, **static, implementation="blocked",
                                     tuning=AttentionTuning(pages_per_iter=3))
    o64, l64 = dense_f64(case, **static)
    for got in (ref, out, blocked):
        check(got[0], o64, jnp.float32, seed, "out")
        check(got[1], l64, jnp.float32, seed, "lse")


def test_merge_attention():
    seed = fresh_seed()
    case, static = make_case(seed, B=2, H=2, G=3, D=32, ps=16, K=6, dtype=jnp.float32, max_pages=5)
    rows, pidx = case["block_rows"], case["page_index"]
    half = jnp.arange(6) < 3
    part = lambda keep: sparse_paged_attention(
        **{**case, "block_rows": jnp.where(keep, rows, -1), "page_index": jnp.where(keep, pidx, -1)},
        **static, implementation="xla")
    (oa, la), (ob, lb) = part(half), part(~half)
    out, lse = merge_attention(oa, la, ob, lb)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    check(out, ref_o, jnp.float32, seed, "merged out")
    check(lse, ref_l, jnp.float32, seed, "merged lse")
    # one side empty -> the other side; both empty -> (0, -inf)
    ninf = jnp.full_like(la, -jnp.inf)
    o1, l1 = merge_attention(jnp.full_like(oa, 0.0), ninf, ob, lb)
    check(o1, ob, jnp.float32, seed, "empty a")
    check(l1, lb, jnp.float32, seed, "empty a lse")
    o2, l2 = merge_attention(jnp.zeros_like(oa), ninf, jnp.zeros_like(ob), ninf)
    assert (np.asarray(o2) == 0).all() and np.isneginf(np.asarray(l2)).all()
    o3, _ = merge_attention(oa.astype(jnp.bfloat16), la, ob.astype(jnp.bfloat16), lb)
    assert o3.dtype == jnp.bfloat16


def test_default_num_splits():
    assert sa.default_num_splits(1, 8, 32) == 32  # the B=1 best of the H200 sweep
    assert sa.default_num_splits(8, 8, 32) == 8
    assert sa.default_num_splits(32, 8, 64) == 2
    assert sa.default_num_splits(64, 8, 64) == 1
    assert sa.default_num_splits(1, 1, 1) == 1


# --------------------------------------------------------------------------------------------
# Triton lowering without a GPU: lower for an abstract H200 and check the custom call appears.
# --------------------------------------------------------------------------------------------
def _lower_for_h200(B, H, G, D, ps, K, N, dtype, **kw):
    from lowering import lower_for_h200

    kw = dict(dict(sm_scale=None, num_splits=None, tuning=None), **kw)
    f = lambda q, pool, r, p, l: sa._pallas_impl(q, pool, r, p, l, page_size=ps, num_kv_heads=H, interpret=False, **kw)
    S = jax.ShapeDtypeStruct
    return lower_for_h200(f, S((B, H * G, D), dtype), S((N, 2 * H * ps * D), dtype),
                          S((B, H, K), jnp.int32), S((B, H, K), jnp.int32), S((B,), jnp.int32))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU tests compile the real thing")
@pytest.mark.parametrize("B,H,G,D,ps,K,N,dtype,kw", [
    (1, 8, 4, 128, 64, 32, 20000, jnp.bfloat16, {}),  # benchmark shape, 5 GiB pool (64-bit offsets)
    (32, 8, 4, 128, 64, 64, 512, jnp.bfloat16, dict(tuning=AttentionTuning(pages_per_iter=2, num_warps=8, num_stages=2))),
    (2, 3, 3, 64, 16, 5, 40, jnp.float32, dict(num_splits=2)),
    (2, 2, 8, 32, 1, 40, 100, jnp.bfloat16, {}),
    (2, 2, 32, 64, 8, 6, 30, jnp.float32, {}),
])
def test_lowers_to_triton(B, H, G, D, ps, K, N, dtype, kw):
    txt = _lower_for_h200(B, H, G, D, ps, K, N, dtype, **kw)
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU tests compile the real thing")
@pytest.mark.parametrize("B,H,G,K", [(1, 8, 4, 32), (8, 2, 6, 32)])
def test_host_path_lowers_to_triton(B, H, G, K):
    """With a pinned-host tier operand (the branch that skips tiles without missed pages)."""
    from lowering import lower_for_h200
    D, ps = 128, 64
    f = lambda q, pool, r, p, l, host, hr: sa._pallas_impl(
        q, pool, r, p, l, page_size=ps, num_kv_heads=H, sm_scale=None, num_splits=None,
        tuning=None, interpret=False, host=host, host_rows=hr)
    S = jax.ShapeDtypeStruct
    R = 2 * H * ps * D
    txt = lower_for_h200(f, S((B, H * G, D), jnp.bfloat16), S((512, R), jnp.bfloat16),
                         S((B, H, K), jnp.int32), S((B, H, K), jnp.int32), S((B,), jnp.int32),
                         S((4096, R), jnp.bfloat16), S((B, H, K), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


# --------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernel at realistic shapes (the CPU tests above also run there).
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("B,H,G,D,ps,K,num_splits,tuning", [
    (8, 8, 4, 128, 64, 32, None, None),
    (3, 3, 3, 64, 16, 40, None, None),
    (4, 8, 4, 128, 64, 16, 1, AttentionTuning(pages_per_iter=2, num_warps=8)),
    (2, 4, 8, 128, 8, 24, 3, AttentionTuning(pages_per_iter=4, num_stages=2)),
])
def test_gpu_kernel_matches_reference(dtype, B, H, G, D, ps, K, num_splits, tuning):
    seed = fresh_seed()
    case, static = make_case(seed, B=B, H=H, G=G, D=D, ps=ps, K=K, dtype=dtype, max_pages=K + 8)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    out, lse = sparse_paged_attention(**case, **static, num_splits=num_splits, tuning=tuning, implementation="pallas")
    check(out, ref_o, dtype, seed, "out")
    check(lse, ref_l, dtype, seed, "lse", LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,ps", [(jnp.float32, 64), (jnp.bfloat16, 64), (jnp.bfloat16, 8)])
def test_gpu_host_rows_read_from_pinned_host(dtype, ps):
    """On the GPU the host rows come from a real pinned_host array, read by the kernel in place
    (64-token pages: a tile is one page, from the pool or the host; 8-token pages: mixed tiles)."""
    from jax.sharding import SingleDeviceSharding
    pinned = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    seed = fresh_seed()
    case, static = make_case(seed, B=3, H=8, G=4, D=128, ps=ps, K=16, dtype=dtype, max_pages=12)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    split, _ = split_to_host(case, seed, on_host=lambda a: jax.device_put(a, pinned))
    assert split["host"].sharding.memory_kind == "pinned_host"
    out, lse = jax.jit(lambda c: sparse_paged_attention(**c, **static, implementation="pallas"))(split)
    check(out, ref_o, dtype, seed, "out")
    check(lse, ref_l, dtype, seed, "lse", LSE_TOL)


@pytest.mark.parametrize("B,H,S,G,D,dtype", [
    (2, 2, 11, 6, 64, jnp.bfloat16),   # Qwen-like group of 6, splits not a multiple of 8
    (2, 1, 32, 8, 128, jnp.float32),
    (1, 2, 2, 1, 16, jnp.float32),     # G = 1, D below the merge's dim block
    (1, 1, 40, 32, 64, jnp.float32),   # G = 32 (MQA-like): fewer splits per loop step
])
def test_merge_kernel_matches_xla_merge(B, H, S, G, D, dtype):
    """The Pallas split merge equals _merge_lse; unused rows (g >= G) hold NaN and are never
    read; some splits are empty (lse -inf) and one (b, h) has no split at all."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    G_pad = max(16, 1 << (G - 1).bit_length())
    o = rng.standard_normal((B, H, S, G_pad, D)).astype(np.float32)
    lse = (rng.standard_normal((B, H, S, G_pad)) * 3).astype(np.float32)
    lse[rng.random((B, H, S, G_pad)) < 0.3] = -np.inf
    lse[0, 0] = -np.inf                      # (0, 0): every split empty
    o[lse == -np.inf] = 0.0                  # an empty split's partial is zero
    o[..., G:, :] = np.nan
    lse[..., G:] = np.nan
    out, l = sa.merge_splits_pallas(jnp.asarray(o), jnp.asarray(lse), num_q_heads=H * G,
                                    out_dtype=dtype)
    ref_o, ref_l = sa._merge_lse(jnp.asarray(o[..., :G, :]), jnp.asarray(lse[..., :G]), axis=2)
    assert out.shape == (B, H * G, D) and out.dtype == dtype and l.shape == (B, H * G)
    check(out, ref_o.reshape(B, H * G, D).astype(dtype), dtype, seed, "merged out")
    check(l, ref_l.reshape(B, H * G), jnp.float32, seed, "merged lse")
    assert np.all(np.asarray(out, np.float32)[0, :G] == 0) and np.all(np.asarray(l)[0, :G] == -np.inf)


def test_kernel_merge_matches_reference():
    """The merge kernel of the Pallas path matches the reference (Qwen-like G = 6, 3 splits)."""
    seed = fresh_seed()
    case, static = make_case(seed, B=2, H=2, G=6, D=32, ps=16, K=6, dtype=jnp.bfloat16, max_pages=3)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    out, lse = sparse_paged_attention(**case, **static, num_splits=3, implementation="pallas")
    check(out, ref_o, jnp.bfloat16, seed, "out (merged)")
    check(lse, ref_l, jnp.bfloat16, seed, "lse (merged)", LSE_TOL)
