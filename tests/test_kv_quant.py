"""Quantized KV, fp8 and int8 (jaxkv.kernels.kv_quant): the quantize / dequantize pair vs its
numpy reference, and every kernel that reads or writes quantized page rows (Pallas in
interpret mode on CPU) vs its pure-jnp reference: fresh seeds, poisoned unused pages and
tokens (NaN for fp8; for int8 the scale byte 255, NaN, so they dequantize to NaN),
permuted page tables; the Triton lowering of the quantized paths for an H200."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.kernels import kv_quant as kq
from jaxkv.kernels import layer_lookup as ll
from jaxkv.kernels import page_fetch, page_write
from jaxkv.kernels import sparse_attention as sa
from jaxkv.kernels.sparse_attention import AttentionTuning, sparse_paged_attention

from lowering import lower_for_h200
from page_kernel_util import HOST, rng  # noqa: F401 - fixture
from test_sparse_attention import dense_f64, fresh_seed, make_case, split_to_host

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
FP8 = kq.FP8_DTYPES
QUANT = kq.QUANT_DTYPES


def poison_np(shape, dtype):
    """numpy rows of ``dtype`` that dequantize to non-finite values: NaN for fp8, all bytes
    0xFF for int8 (payload -1, scale byte 255: NaN)."""
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype == np.int8:
        return np.full(shape, -1, dtype)
    return np.full(shape, np.nan, dtype)


def is_poison(a):
    """Elements still holding :func:`poison_np`'s value."""
    a = np.asarray(a)
    if a.dtype == np.int8:
        return a == -1
    return np.isnan(a.astype(np.float32))


def bits(a):
    return np.asarray(a).view(np.uint8)


def assert_same(a, b, msg=""):
    """Quantized arrays equal bit for bit, except that any NaN equals any NaN (XLA may
    canonicalize the NaN patterns of untouched poison)."""
    fa, fb = (np.asarray(jnp.asarray(x).astype(jnp.float32)) for x in (a, b))
    same = (bits(a) == bits(b)) | (np.isnan(fa) & np.isnan(fb))
    assert same.all(), f"{msg}: {np.sum(~same)} of {same.size} differ, first at {np.argwhere(~same)[:3].tolist()}"


# --------------------------------------------------------------------------------------------
# quantize / dequantize
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP8)
def test_quantize_matches_numpy_reference(rng, dtype):
    """Bit-exact against the numpy reference over magnitudes from 1e-30 to 1e30, zero vectors
    and exact powers of two; the error is within the format's half-ulp of the vector's scale."""
    mags = 10.0 ** rng.uniform(-30, 30, (6, 5, 1))
    x = (rng.standard_normal((6, 5, 32)) * mags).astype(np.float32)
    x[0, 0] = 0.0
    x[0, 1] = 0.0; x[0, 1, 3] = float(ml_dtypes.finfo(dtype).max) * 2.0 ** 5  # amax on a power of 2
    x[0, 2] = -np.float32(2.0 ** -20)
    p, e = kq.quantize(jnp.asarray(x), dtype)
    pn, en = kq.quantize_np(x, dtype)
    np.testing.assert_array_equal(np.asarray(e), en)
    np.testing.assert_array_equal(bits(p), bits(pn))
    assert p.dtype == jnp.dtype(dtype) and e.dtype == jnp.uint8
    back = kq.dequantize_np(pn, en)
    np.testing.assert_array_equal(np.asarray(kq.dequantize(p, e)), back)
    amax = np.abs(x).max(-1, keepdims=True)
    mant = ml_dtypes.finfo(dtype).nmant
    assert np.all(np.abs(back - x) <= amax * 2.0 ** -mant + 1e-37)
    scaled_max = np.abs(pn.astype(np.float32)).max(-1)
    fmax = float(ml_dtypes.finfo(dtype).max)
    nz = amax[..., 0] > 0
    assert np.all(scaled_max[nz] >= fmax / 2) and np.all(scaled_max <= fmax)  # the range is used
    assert en[0, 0] == 1 and np.all(back[0, 0] == 0)
    assert back[0, 1, 3] == x[0, 1, 3]


def test_int8_quantize_matches_numpy_reference(rng):
    """int8: bit-exact against the numpy reference (round half to even, ties included) over
    the scale's range (2**-48 to 2**15.5); the error is within half a step of the vector's
    scale, the largest element lands in (106.8, 127], and each code is the smallest that fits."""
    mags = 10.0 ** rng.uniform(-12, 6, (6, 5, 1))
    x = (rng.standard_normal((6, 5, 32)) * mags).astype(np.float32)
    x[0, 0] = 0.0
    x[0, 1] = 0.0; x[0, 1, 3] = 127.0 * 2.0 ** 5                     # amax on the format's max
    x[0, 1, 4] = 2.5 * 2.0 ** 5; x[0, 1, 5] = -3.5 * 2.0 ** 5        # ties: to even
    x[0, 2] = -np.float32(2.0 ** -20)
    x[0, 3] = 0.0; x[0, 3, 0] = 127.0 * float(kq.scale_of_np(201, "int8"))  # on a quarter code
    p, e = kq.quantize(jnp.asarray(x), "int8")
    pn, en = kq.quantize_np(x, "int8")
    np.testing.assert_array_equal(np.asarray(e), en)
    np.testing.assert_array_equal(np.asarray(p), pn)
    assert p.dtype == jnp.int8 and e.dtype == jnp.uint8
    back = kq.dequantize_np(pn, en)
    np.testing.assert_array_equal(np.asarray(kq.dequantize(p, e)), back)
    scale = kq.scale_of_np(en, "int8")[..., None]
    np.testing.assert_array_equal(np.asarray(kq.scale_of(jnp.asarray(en), jnp.int8)), scale[..., 0])
    np.testing.assert_allclose(scale[..., 0], 2.0 ** (en.astype(np.float64) / 4 - 48), rtol=1e-7)
    assert np.all(np.abs(back - x) <= scale / 2 * (1 + 1e-6) + 1e-37)
    amax = np.abs(x).max(-1)
    peak = np.abs(pn.astype(np.int32)).max(-1)
    assert np.all(peak[amax > 0] >= 107) and np.all(np.abs(pn.astype(np.int32)) <= 127)
    nz = amax > 0
    assert np.all(amax[nz] <= 127 * scale[..., 0][nz])                        # fits
    smaller = kq.scale_of_np(en.astype(np.int64) - 1, "int8")
    assert np.all(amax[nz] > 127 * smaller[nz])                               # the smallest that fits
    assert pn[0, 1, 3] == 127 and pn[0, 1, 4] == 2 and pn[0, 1, 5] == -4
    assert en[0, 3] == 201 and pn[0, 3, 0] == 127
    assert en[0, 0] == 0 and np.all(back[0, 0] == 0)


def test_int8_scale_codes():
    """int8's scale codes: quarter powers of two, 2**-48 at code 0, exact powers of two at
    multiples of 4, code 255 NaN; vectors beyond the range saturate at code 254."""
    codes = np.arange(256)
    s = kq.scale_of_np(codes, "int8")
    np.testing.assert_array_equal(np.asarray(kq.scale_of(jnp.asarray(codes, jnp.uint8), jnp.int8)), s)
    assert s[0] == 2.0 ** -48 and s[192] == 1.0 and s[196] == 2.0 and np.isnan(s[255])
    assert np.all(np.diff(s[:255]) > 0)
    np.testing.assert_allclose(s[:255], 2.0 ** (codes[:255] / 4 - 48), rtol=1e-7)
    big = np.full((1, 8), 1e9, np.float32)
    p, e = kq.quantize(jnp.asarray(big), "int8")
    assert int(e[0]) == 254 and np.all(np.asarray(p) == 127)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_int8_non_finite_vectors_dequantize_to_nan(bad):
    """A K or V vector holding an inf or NaN gets scale code 255 (NaN), so it reads back as NaN
    (as a float cache would fail) and never as finite numbers; its neighbours are unaffected."""
    x = np.ones((2, 3, 8), np.float32)
    x[1, 2, 5] = bad
    p, e = kq.quantize(jnp.asarray(x), "int8")
    pn, en = kq.quantize_np(x, "int8")
    np.testing.assert_array_equal(np.asarray(e), en)
    np.testing.assert_array_equal(np.asarray(p), pn)
    back = np.asarray(kq.dequantize(p, e))
    assert en[1, 2] == kq.NAN_CODE and np.isnan(back[1, 2]).all()
    np.testing.assert_allclose(back[0], x[0], rtol=1 / 200)        # within half a step


def test_row_layout_helpers():
    """pack_pages / unpack_rows / encode_tokens / token_columns agree on the row layout."""
    rng_ = np.random.default_rng(fresh_seed())
    B, T, H, D, ps = 2, 8, 3, 16, 4
    k, v = (jnp.asarray(rng_.standard_normal((B, T, H, D)), jnp.float32) for _ in range(2))
    for dt in QUANT + ("bfloat16",):
        rows = kq.pack_pages(k, v, ps, dt)
        assert rows.shape == (B, T // ps, kq.row_elems(dt, H, ps, D)) and rows.dtype == jnp.dtype(dt)
        kv = kq.unpack_rows(rows, H, ps, D)                       # [B, n, 2, H, ps, D]
        tok = jnp.stack([k, v], 2).reshape(B, T // ps, ps, 2, H, D)
        for t in range(ps):  # token t of each page: the encoded token at token_columns(t)
            enc = kq.encode_tokens(tok[:, :, t].reshape(-1, 2, H, D), dt)
            cols = kq.token_columns(H, ps, D, t, dt)
            np.testing.assert_array_equal(bits(rows.reshape(-1, rows.shape[-1])[:, cols]), bits(enc))
            want = np.asarray(tok[:, :, t].astype(jnp.float32))
            got = np.asarray(kv[:, :, :, :, t])
            tol = (2.0 ** -ml_dtypes.finfo(dt).nmant if dt in FP8 else 2.0 ** -7 if dt == "int8"
                   else 0.01)
            np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max())
        empty = kq.encode_tokens(jnp.zeros((0, 2, H, D)), dt)   # no entries: no reshape to -1
        assert empty.shape == (0, kq.encode_tokens(tok[:1, 0, 0], dt).shape[1])


# --------------------------------------------------------------------------------------------
# sparse attention over quantized pages
# --------------------------------------------------------------------------------------------
def to_fp8(case, static, dtype, q_dtype):
    """make_case's pool (float32, NaN in unused rows and tokens) as quantized rows: fp8 NaN
    vectors keep a NaN payload and get random scale bytes; int8 ones get a random payload and
    the scale byte 255 (2**128: +-inf, NaN for zeros)."""
    H, ps = static["num_kv_heads"], static["page_size"]
    q = case["q"]
    D = q.shape[-1]
    pool = np.asarray(case["pool"], np.float32).reshape(-1, 2, H, ps, D)
    payload, e = kq.quantize_np(np.nan_to_num(pool, nan=0.0), dtype)
    bad = np.isnan(pool).any(-1)
    poison_rng = np.random.default_rng(0)
    if payload.dtype == np.int8:
        payload[bad] = poison_rng.integers(-127, 128, (bad.sum(), D))
        e[bad] = 255
    else:
        payload[bad] = np.nan
        e[bad] = poison_rng.integers(0, 256, bad.sum())
    N = pool.shape[0]
    rows = np.concatenate([payload.reshape(N, -1), e.view(payload.dtype).reshape(N, -1)], 1)
    return dict(case, pool=jnp.asarray(rows), q=q.astype(q_dtype))


def dequantized(case, static):
    """The quantized case with a float32 pool of the dequantized values (for the float64 oracle)."""
    H, ps, D = static["num_kv_heads"], static["page_size"], case["q"].shape[-1]
    pool = np.asarray(kq.unpack_rows(case["pool"], H, ps, D)).reshape(case["pool"].shape[0], -1)
    return dict(case, pool=jnp.asarray(pool))


FP8_CASES = [  # (B, H, G, D, ps, K, kv dtype, q dtype, splits)
    (2, 3, 3, 64, 16, 5, "float8_e4m3fn", jnp.bfloat16, None),
    (2, 2, 4, 32, 8, 6, "float8_e5m2", jnp.float32, 2),       # two pages per tile
    (3, 2, 1, 32, 64, 4, "float8_e4m3fn", jnp.float32, 1),
    (2, 3, 3, 64, 16, 5, "int8", jnp.bfloat16, None),
    (2, 2, 4, 32, 8, 6, "int8", jnp.float32, 2),
]


@pytest.mark.parametrize("B,H,G,D,ps,K,dt,qdt,splits", FP8_CASES)
def test_fp8_attention_matches_reference(B, H, G, D, ps, K, dt, qdt, splits):
    """Pallas (interpret) and blocked vs the reference, from the pool and with half the pages
    on a host array; the reference vs a float64 softmax over the dequantized values."""
    seed = fresh_seed()
    case, static = make_case(seed, B=B, H=H, G=G, D=D, ps=ps, K=K, dtype=jnp.float32,
                             max_pages=max(2, 24 // ps, K))
    case = to_fp8(case, static, dt, qdt)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    want_o, want_l = dense_f64(dequantized(case, static), **static)
    tol = dict(rtol=2e-2, atol=2e-2) if qdt == jnp.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref_o, np.float32), want_o, err_msg=f"seed {seed}", **tol)
    split, _ = split_to_host(dequantized(case, static), seed)
    # the split's host rows, re-encoded: the same quantized rows moved (split_to_host works in f32)
    split = host_split_fp8(case, split)
    assert np.isfinite(np.asarray(ref_l)[np.isfinite(want_l)]).all()
    for impl, kw in (("pallas", dict(num_splits=splits)), ("blocked", dict(tuning=AttentionTuning(pages_per_iter=3)))):
        for name, c in (("pool", case), ("host", split)):
            out, lse = sparse_paged_attention(**c, **static, implementation=impl, **kw)
            assert out.dtype == qdt
            np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_o, np.float32),
                                       err_msg=f"{impl} {name} seed {seed}", **tol)
            np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_l), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{impl} {name} lse seed {seed}")


def host_split_fp8(case, split):
    """split_to_host's result with the quantized rows of ``case`` (its host rows are copies of
    pool rows, the others poisoned): the same moves on the quantized arrays."""
    pool = np.asarray(case["pool"])
    rows, host_rows = np.asarray(case["block_rows"]), np.asarray(split["host_rows"])
    n_host = split["host"].shape[0]
    host = poison_np((n_host, pool.shape[1]), pool.dtype)
    new_pool = pool.copy()
    for r, hr in zip(rows.ravel(), host_rows.ravel()):
        if hr >= 0:
            host[hr] = pool[r]
            new_pool[r] = poison_np(pool.shape[1:], pool.dtype)
    return dict(split, pool=jnp.asarray(new_pool), host=jnp.asarray(host), q=case["q"])


@pytest.mark.parametrize("G,ppi,dt", [(4, 1, "float8_e4m3fn"), (6, 2, "float8_e4m3fn"),
                                      (4, 1, "int8")])
def test_fp8_attention_lowers_to_triton(G, ppi, dt):
    """The quantized kernel (scale loads, bitcasts, fp8 / int8 -> bf16 converts) with a
    pinned-host tier."""
    B, H, K, D, ps = 2, 8, 32, 128, 16 if ppi == 2 else 64
    f = lambda q, pool, r, p, l, host, hr: sa._pallas_impl(  # noqa: E731
        q, pool, r, p, l, page_size=ps, num_kv_heads=H, sm_scale=None, num_splits=None,
        tuning=AttentionTuning(pages_per_iter=ppi), interpret=False, host=host, host_rows=hr)
    S = jax.ShapeDtypeStruct
    R = kq.row_elems(dt, H, ps, D)
    f8 = jnp.dtype(dt)
    txt = lower_for_h200(f, S((B, H * G, D), jnp.bfloat16), S((512, R), f8),
                         S((B, H, K), jnp.int32), S((B, H, K), jnp.int32), S((B,), jnp.int32),
                         S((4096, R), f8), S((B, H, K), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


# --------------------------------------------------------------------------------------------
# writes: write_tokens (write-through), layer_lookup (the pool write), fetch of quantized rows
# --------------------------------------------------------------------------------------------
def poisoned(n, row, dtype):
    return jnp.asarray(poison_np((n, row), dtype))


@pytest.mark.parametrize("dt,H,D,ps", [("float8_e4m3fn", 3, 16, 4), ("float8_e5m2", 2, 32, 1),
                                       ("int8", 2, 16, 4)])
def test_fp8_write_tokens_matches_reference(rng, dt, H, D, ps):
    n = 8
    R = kq.row_elems(dt, H, ps, D)
    pairs = rng.permutation(n * ps)[:7]
    rows, offs = (pairs // ps).astype(np.int32), (pairs % ps).astype(np.int32)
    rows[rng.random(7) < 0.3] = -1
    kv = rng.standard_normal((7, 2, H, D)).astype(np.float32) * 10.0 ** rng.uniform(-3, 3, (7, 2, H, 1))
    kv = jnp.asarray(kv, jnp.bfloat16)
    want = np.asarray(poisoned(n, R, dt)).copy()
    enc = np.asarray(kq.encode_tokens(kv, dt))
    for m in range(7):
        if rows[m] >= 0:
            want[rows[m], np.asarray(kq.token_columns(H, ps, D, int(offs[m]), dt))] = enc[m]
    for impl in ("pallas", "xla"):
        for dst in (poisoned(n, R, dt), jax.device_put(poisoned(n, R, dt), HOST)):
            got = page_write.write_tokens(dst, jnp.asarray(rows), jnp.asarray(offs), kv,
                                          page_size=ps, implementation=impl)
            assert_same(got, want, impl)


@pytest.mark.parametrize("dt", [jnp.float8_e4m3fn, jnp.int8])
def test_fp8_write_tokens_lowers_to_triton(no_interpret, dt):
    H, D, ps = 8, 128, 64
    S = jax.ShapeDtypeStruct
    txt = lower_for_h200(lambda d, r, o, kv: page_write._write_tokens_pallas(d, r, o, kv, page_size=ps),
                         S((64, kq.row_elems(dt, H, ps, D)), dt), S((4,), jnp.int32),
                         S((4,), jnp.int32), S((4, 2, H, D), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.parametrize("reuse,dt", [(True, "float8_e4m3fn"), (False, "float8_e4m3fn"),
                                      (True, "int8")])
def test_fp8_layer_lookup_matches_reference(rng, reuse, dt):
    from test_layer_lookup import make_case as lookup_case
    B, H, K, D, ps, L, Np, S = 3, 2, 3, 16, 4, 2, 5, 7
    c = lookup_case(rng, B=B, H=H, K=K, D=D, ps=ps, L=L, Np=Np, S=S, dtype=jnp.dtype(jnp.float32))
    layer = int(rng.integers(0, L))
    outs = []
    for impl in ("pallas", "xla"):
        outs.append(ll.layer_lookup(
            jnp.asarray(c["pages"]), jnp.asarray(c["active"]), jnp.asarray(c["tok_page"]),
            jnp.asarray(c["tok_offset"]), jnp.asarray(c["tok_kv"]), jnp.asarray(c["page_table"]),
            jnp.int32(layer), poisoned(L * S, kq.row_elems(dt, H, ps, D), dt),
            jnp.asarray(c["record"]), pages_per_seq=Np, page_size=ps, reuse=reuse,
            implementation=impl))
    assert_same(outs[0][0], outs[1][0], "pool")
    for a, b in zip(outs[0][1:], outs[1][1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    written = ~is_poison(outs[1][0]).all(1)
    assert written.sum() == 0 or reuse


@pytest.mark.parametrize("H,ps,D,dt", [(8, 16, 128, "float8_e4m3fn"), (3, 4, 16, "float8_e4m3fn"),
                                       (3, 4, 16, "int8")])
def test_fp8_fetch_moves_whole_rows(rng, H, ps, D, dt):
    """fetch_pages / fetch_layer_pages copy quantized rows with their scales (the row length
    is not a power of two): Pallas vs reference, bit for bit."""
    R = kq.row_elems(dt, H, ps, D)
    L, P, Sl = 2, 6, 3
    host = jnp.asarray(rng.integers(0, 256, (L * P, R), dtype=np.uint8).view(jnp.dtype(dt)))
    src = np.stack([rng.permutation(P)[:Sl] for _ in range(L)]).astype(np.int32)
    dst = np.stack([rng.permutation(Sl) for _ in range(L)]).astype(np.int32)
    src[0, -1] = dst[1, 0] = -1
    got = [page_fetch.fetch_layer_pages(host, poisoned(L * Sl, R, dt), jnp.asarray(src),
                                        jnp.asarray(dst), src_stride=P, dst_stride=Sl,
                                        implementation=impl) for impl in ("pallas", "xla")]
    assert_same(got[0], got[1], "fetch_layer_pages")
    flat_src = np.where(src >= 0, np.arange(L)[:, None] * P + src, -1).ravel()
    flat_dst = np.where((src >= 0) & (dst >= 0), np.arange(L)[:, None] * Sl + dst, -1).ravel()
    got2 = page_fetch.fetch_pages(host, poisoned(L * Sl, R, dt), jnp.asarray(flat_src),
                                  jnp.asarray(flat_dst), implementation="pallas")
    assert_same(got2, got[1], "fetch_pages")


def test_fp8_fetch_lowers_to_triton(no_interpret):
    dt, H, ps, D = jnp.float8_e4m3fn, 8, 16, 128
    R = kq.row_elems(dt, H, ps, D)
    S = jax.ShapeDtypeStruct
    txt = lower_for_h200(lambda h, p, s, d: page_fetch.fetch_layer_pages_pallas(
        h, p, s, d, src_stride=64, dst_stride=16), S((4 * 64, R), dt), S((4 * 16, R), dt),
        S((4, 32), jnp.int32), S((4, 32), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


def test_fp8_layer_lookup_lowers_to_triton(no_interpret):
    B, H, K, D, L, P, S, ps, dt = 1, 8, 32, 128, 4, 2052, 516, 64, jnp.float8_e4m3fn
    sds = jax.ShapeDtypeStruct
    txt = lower_for_h200(
        lambda *a: ll.layer_lookup(*a, pages_per_seq=P // B, page_size=ps, implementation="pallas"),
        sds((B, H, K), jnp.int32), sds((B,), jnp.bool_), sds((B,), jnp.int32), sds((B,), jnp.int32),
        sds((B, 2, H, D), jnp.bfloat16), sds((L, P), jnp.int32), sds((), jnp.int32),
        sds((L * S, kq.row_elems(dt, H, ps, D)), dt), sds((L, B * H * K), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.gpu
@pytest.mark.parametrize("dt,ps", [("float8_e4m3fn", 64), ("float8_e5m2", 8), ("int8", 64),
                                   ("int8", 8)])
def test_gpu_fp8_attention_reads_pinned_host(dt, ps):
    """The compiled kernel on quantized rows, half of them read in place from a pinned_host array
    (64-token pages: a tile is one page; 8-token pages: mixed tiles), vs the reference."""
    from jax.sharding import SingleDeviceSharding
    pinned = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    seed = fresh_seed()
    case, static = make_case(seed, B=3, H=8, G=4, D=128, ps=ps, K=16, dtype=jnp.float32,
                             max_pages=12)
    case = to_fp8(case, static, dt, jnp.bfloat16)
    ref_o, ref_l = sparse_paged_attention(**case, **static, implementation="xla")
    split, _ = split_to_host(dequantized(case, static), seed)
    split = host_split_fp8(case, split)
    split = dict(split, host=jax.device_put(split["host"], pinned))
    out, lse = jax.jit(lambda c: sparse_paged_attention(**c, **static, implementation="pallas"))(split)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_o, np.float32),
                               rtol=2e-2, atol=2e-2, err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_l), rtol=1e-3, atol=1e-3,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("dt", FP8)
def test_xla_paths_move_fp8_rows_as_bytes(dt):
    """XLA:CPU widens an fp8 array around a gather, scatter or dynamic update of it (a copy
    of the whole array in f16 per write: decode 56x slower than int8 on the CPU). The XLA
    paths that move page rows move their bytes (``kv_quant.bits``), pinned-host arrays too
    on the CPU: the compiled programs hold no wider float array of the page array's shape,
    and the results are exact."""
    H, ps, D, N, B = 2, 4, 16, 64, 2
    R = kq.row_elems(dt, H, ps, D)
    rng_ = np.random.default_rng(0)
    pool = jnp.asarray(rng_.integers(0, 256, (N, R), dtype=np.uint8).view(jnp.dtype(dt)))
    pool = jnp.where(jnp.isnan(pool.astype(jnp.float32)), jnp.zeros((), dt), pool)
    kv = jnp.asarray(rng_.standard_normal((B, 2, H, D)), jnp.float32)
    rows, offs = jnp.asarray([3, 40], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    src, dst = jnp.asarray([5, 9, -1], jnp.int32), jnp.asarray([7, 8, 2], jnp.int32)
    q = jnp.asarray(rng_.standard_normal((B, 2 * H, D)), jnp.float32)
    block_rows = jnp.asarray(rng_.permutation(N)[:B * H * 3].reshape(B, H, 3), jnp.int32)
    page_index = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (B, H, 3))
    lens = jnp.asarray([12, 9], jnp.int32)
    progs = {
        "write_tokens": (lambda p: page_write.write_tokens(p, rows, offs, kv, page_size=ps,
                                                           implementation="xla"), (pool,)),
        "write_tokens_host": (lambda p: page_write.write_tokens(p, rows, offs, kv, page_size=ps,
                                                                implementation="xla"),
                              (jax.device_put(pool, HOST),)),
        "fetch_pages": (lambda p: page_fetch.fetch_pages(p, p, src, dst, implementation="xla"),
                        (pool,)),
        "fetch_pages_host": (lambda p, h: page_fetch.fetch_pages(h, p, src, dst,
                                                                 implementation="xla"),
                             (pool, jax.device_put(pool, HOST))),
        "move_rows": (lambda p: page_fetch.move_rows(p, src, dst, implementation="xla"), (pool,)),
        "attention": (lambda p: sparse_paged_attention(q, p, block_rows, page_index, lens,
                                                       page_size=ps, num_kv_heads=H,
                                                       implementation="xla"), (pool,)),
    }
    for name, (fn, args) in progs.items():
        text = jax.jit(fn).lower(*args).compile().as_text()
        for wide in ("f16", "bf16", "f32"):
            assert f" {wide}[{N},{R}]" not in text, (name, wide)
    # exact: the written tokens and copied rows equal the numpy-side edits
    want = np.asarray(pool).copy()                    # the eager calls below donate their dst
    enc = np.asarray(kq.encode_tokens(kv, dt))
    for m in range(B):
        want[int(rows[m]), np.asarray(kq.token_columns(H, ps, D, int(offs[m]), dt))] = enc[m]
    got = page_write.write_tokens(jnp.array(pool), rows, offs, kv, page_size=ps,
                                  implementation="xla")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    moved = np.asarray(pool).copy()
    moved[[7, 8]] = moved[[5, 9]]
    got = page_fetch.fetch_pages(pool, jnp.array(pool), src, dst, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), moved.view(np.uint8))
