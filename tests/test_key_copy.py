"""The two-stage selectors' key copy (jaxkv.kernels.key_copy): its quantizer against numpy,
and the decode step's write (the kernel in interpret mode off the GPU, and the reference)
against numpy on fresh seeds, with NaN in every scale the op must leave alone, positions in
any order, dropped ones (-1, past the pages) included; the kernel lowered for an H200 at the
decode shapes; the engine's two store methods token for token."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import CacheConfig, Tuning
from jaxkv.kernels import key_copy
from jaxkv.models import configs, llama
from jaxkv.spec import alloc_rows
from page_kernel_util import fresh_rng
from tests.lowering import lower_for_h200

IMPLS = ["pallas", "xla"]


def quantize_numpy(k, bits):
    """float32 arithmetic as the op's: s = max|k| / 127, round half to even, clip."""
    k = np.asarray(k, np.float32)
    if bits != 8:
        return k, np.ones(k.shape[:-1], np.float32)
    s = (np.abs(k).max(-1) / np.float32(127.0)).astype(np.float32)
    q = np.round(k / np.where(s > 0, s, np.float32(1.0))[..., None])
    return np.clip(q, -127, 127).astype(np.int8), s


def store_numpy(keys, scales, layer, k_new, positions, page_size):
    vals, scale = quantize_numpy(k_new, 8 if keys.dtype == np.int8 else 16)
    keys, scales = keys.copy(), scales.copy()
    Np = keys.shape[3]
    for b, pos in enumerate(positions):
        if pos < 0 or pos // page_size >= Np:
            continue
        keys[layer, b, :, pos // page_size, pos % page_size] = vals[b].astype(keys.dtype)
        scales[layer, b, :, pos // page_size, pos % page_size] = scale[b]
    return keys, scales


def _case(rng, L, B, H, Np, ps, D, dtype):
    if dtype == np.int8:
        keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
        k_new = (rng.normal(size=(B, H, D)) * rng.uniform(0.1, 30, size=(B, H, 1))).astype(np.float32)
        k_new[0, 0] = 0.0                                     # a zero vector: scale 0, values 0
        if D >= 8:
            k_new[-1, -1, :4] = [1.5, -2.5, 0.5, 127.0]       # midpoints: ties to even
    else:
        keys = rng.normal(size=(L, B, H, Np, ps, D)).astype(dtype)
        keys[rng.random(keys.shape) < 0.1] = np.nan
        k_new = rng.normal(size=(B, H, D)).astype(dtype)
    scales = rng.random((L, B, H, Np, ps)).astype(np.float32)
    scales[rng.random(scales.shape) < 0.3] = np.nan   # left alone: must stay NaN
    positions = rng.permutation(Np * ps)[:B].astype(np.int32)
    if B > 2:
        positions[rng.integers(B)] = -1               # no token
        positions[(rng.integers(B) + 1) % B] = Np * ps + int(rng.integers(1, 4 * ps))  # past
    return keys, scales, k_new, positions


def assert_same_to_rounding(got, want):
    """int8 values at most one step apart, and rarely (XLA's float32 division, on the CPU
    too, is not IEEE's to the last bit, so a quotient near a midpoint may round the other
    way); the rest of the array bit for bit."""
    got, want = np.asarray(got).astype(np.int32), np.asarray(want).astype(np.int32)
    assert np.abs(got - want).max() <= 1
    assert (got != want).mean() < 0.02


def test_quantize_matches_numpy():
    rng = fresh_rng()
    k = (rng.normal(size=(5, 3, 64)) * rng.uniform(0.01, 50, size=(5, 3, 1))).astype(np.float32)
    k[0, 0] = 0.0
    k[1, 1, :3] = [127.0, 0.5, -1.5]
    vals, scale = key_copy.quantize(jnp.asarray(k), 8)
    want_v, want_s = quantize_numpy(k, 8)
    assert_same_to_rounding(vals, want_v)
    np.testing.assert_allclose(np.asarray(scale), want_s, rtol=1e-6)
    assert not np.asarray(vals)[0, 0].any() and float(scale[0, 0]) == 0.0
    vals, scale = key_copy.quantize(jnp.asarray(k), 16)
    np.testing.assert_array_equal(np.asarray(vals), k)
    np.testing.assert_array_equal(np.asarray(scale), 1.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,H,Np,ps,D,dtype", [(4, 2, 6, 4, 8, np.int8), (3, 3, 5, 8, 16, np.int8),
                                               (1, 1, 2, 16, 8, np.int8),
                                               (2, 2, 4, 4, 8, jnp.bfloat16)])
def test_store_key_copy_matches_numpy(impl, B, H, Np, ps, D, dtype):
    rng = fresh_rng()
    L = 3
    dtype = np.dtype(dtype)
    keys, scales, k_new, positions = _case(rng, L, B, H, Np, ps, D, dtype)
    layer = int(rng.integers(L))
    got_k, got_s = key_copy.store_key_copy(jnp.asarray(keys), jnp.asarray(scales), jnp.int32(layer),
                                           jnp.asarray(k_new), jnp.asarray(positions),
                                           page_size=ps, implementation=impl, num_warps=2)
    want_k, want_s = store_numpy(keys, scales, layer, k_new, positions, ps)
    got_k, got_s = np.asarray(got_k), np.asarray(got_s)
    bits = lambda a: a.view(f"u{a.dtype.itemsize}")  # noqa: E731 - NaN compared too
    if dtype == np.int8:
        assert_same_to_rounding(got_k, want_k)
        np.testing.assert_allclose(got_s, want_s, rtol=1e-6)   # NaN where it must stay NaN
    else:
        np.testing.assert_array_equal(bits(got_k), bits(want_k))
        np.testing.assert_array_equal(got_s, want_s)
    written = np.zeros(keys.shape[:5], bool)
    for b, pos in enumerate(positions):
        if 0 <= pos < keys.shape[3] * ps:
            written[layer, b, :, pos // ps, pos % ps] = True
    np.testing.assert_array_equal(bits(got_k)[~written], bits(keys)[~written])
    np.testing.assert_array_equal(got_s[~written], scales[~written])


@pytest.mark.parametrize("dtype", [np.int8, jnp.bfloat16])
def test_store_key_copy_kernel_against_reference(dtype):
    """The kernel (interpret mode) against the reference: an int8 copy the same to rounding
    (XLA's division differs between the kernel's [1, D] rows and the reference's [B, H, D]
    block in the last bit), scales within 2 ulp; a copy in the KV dtype bit for bit."""
    rng = fresh_rng()
    keys, scales, k_new, positions = _case(rng, 2, 4, 2, 6, 8, 64, np.dtype(dtype))
    run = lambda impl: [np.asarray(a) for a in key_copy.store_key_copy(  # noqa: E731
        jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1), jnp.asarray(k_new),
        jnp.asarray(positions), page_size=8, implementation=impl)]
    (gk, gs), (wk, ws) = run("pallas"), run("xla")
    if np.dtype(dtype) == np.int8:
        assert_same_to_rounding(gk, wk)
        np.testing.assert_array_max_ulp(np.nan_to_num(gs), np.nan_to_num(ws), maxulp=2)
        np.testing.assert_array_equal(np.isnan(gs), np.isnan(ws))
    else:
        np.testing.assert_array_equal(gk.view("u2"), wk.view("u2"))
        np.testing.assert_array_equal(gs, ws)


def test_store_key_copy_rejects_mismatched_shapes():
    keys = jnp.zeros((2, 2, 2, 4, 4, 8), jnp.int8)
    scales = jnp.zeros((2, 2, 2, 4, 4), jnp.float32)
    ok = dict(k_new=jnp.zeros((2, 2, 8)), positions=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="page_size"):
        key_copy.store_key_copy(keys, scales, 0, page_size=8, **ok)
    with pytest.raises(ValueError, match="k_new"):
        key_copy.store_key_copy(keys, scales, 0, page_size=4,
                                **dict(ok, k_new=jnp.zeros((2, 8))))


@pytest.mark.parametrize("name,L,B,H,Np,ps,D", [("qwen_b8_128k_p16", 28, 8, 2, 8212, 16, 64),
                                                ("8b_b1_128k_p16", 32, 1, 8, 8212, 16, 128)])
def test_store_key_copy_lowers_for_h200(no_interpret, name, L, B, H, Np, ps, D):
    """The Triton lowering at the decode shapes, the copy padded past 2**32 bytes where the
    int8 array is 2-4 GiB (``spec.alloc_rows``) as the selector allocates it."""
    La = alloc_rows(L, B * H * Np * ps * D, 1)
    s = jax.ShapeDtypeStruct
    fn = functools.partial(key_copy.store_key_copy, page_size=ps, implementation="pallas")
    text = lower_for_h200(fn, s((La, B, H, Np, ps, D), jnp.int8), s((La, B, H, Np, ps), jnp.float32),
                          s((), jnp.int32), s((B, H, D), jnp.bfloat16), s((B,), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1 and "scatter" not in text, name


CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=3)


def test_engine_store_methods():
    """``Tuning.rescore_store_method="pallas"`` in the engine (a first stage that chooses: 24
    of 64 candidate pages): host tier == resident token for token (the same kernel both
    ways), and the tokens of the XLA store on this fixed case (the copies agree to rounding,
    so only a near-tie of two pages' masses could tell them apart)."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in (200, 157)]
    out = {}
    for mode in ("resident", "host"):
        for method in ("xla", "pallas"):
            cache = CacheConfig(mode=mode, selector="quest_rescore8", page_size=4,
                                selected_pages=3, candidate_pages=24,
                                tuning=Tuning(rescore_store_method=method))
            out[mode, method] = jaxkv.generate(CFG, PARAMS, prompts, max_new_tokens=6,
                                               stop_tokens=[], cache=cache).tokens
    assert out["host", "pallas"] == out["resident", "pallas"]
    assert out["resident", "pallas"] == out["resident", "xla"] == out["host", "xla"]


def test_tuning_rejects_an_unknown_store_method():
    with pytest.raises(ValueError, match="rescore_store_method"):
        Tuning(rescore_store_method="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("L,B,H,Np,ps,D", [(4, 8, 2, 8212, 16, 64), (3, 1, 8, 8212, 16, 128),
                                           (2, 3, 3, 100, 8, 64)])
def test_gpu_store_key_copy_kernel(L, B, H, Np, ps, D):
    """The kernel on the GPU against numpy at decode shapes: the same copy to rounding (a
    value at most one step away, where Triton's division lands on the other side of a
    midpoint; the scales within 2 ulp); everything it must not write unchanged."""
    rng = fresh_rng()
    keys, scales, k_new, positions = _case(rng, L, B, H, Np, ps, D, np.dtype(np.int8))
    layer = int(rng.integers(L))
    fn = jax.jit(functools.partial(key_copy.store_key_copy, page_size=ps, implementation="pallas"))
    got_k, got_s = fn(jnp.asarray(keys), jnp.asarray(scales), jnp.int32(layer), jnp.asarray(k_new),
                      jnp.asarray(positions))
    want_k, want_s = store_numpy(keys, scales, layer, k_new, positions, ps)
    got_k, got_s = np.asarray(got_k), np.asarray(got_s)
    assert np.abs(got_k.astype(np.int32) - want_k.astype(np.int32)).max() <= 1
    assert (got_k != want_k).mean() < 1e-3
    np.testing.assert_array_max_ulp(np.nan_to_num(got_s), np.nan_to_num(want_s), maxulp=2)
    np.testing.assert_array_equal(np.isnan(got_s), np.isnan(want_s))


@pytest.mark.gpu
def test_gpu_store_key_copy_past_2_gib():
    """Qwen-like B=8 at 128k: the int8 copy of 3.5 GiB, padded past 2**32 bytes as the
    selector allocates it; the last layer's last request written near the array's end lands
    where the reference puts it, nothing else changes."""
    L, B, H, Np, ps, D = 28, 8, 2, 8212, 16, 64
    La = alloc_rows(L, B * H * Np * ps * D, 1)
    rng = fresh_rng()
    k_new = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
    vals, scale = quantize_numpy(np.asarray(k_new), 8)
    positions = jnp.asarray(Np * ps - 1 - rng.permutation(64)[:B], jnp.int32)
    out = {}
    for impl in ("pallas", "xla"):
        keys = jnp.zeros((La, B, H, Np, ps, D), jnp.int8)
        scales = jnp.zeros((La, B, H, Np, ps), jnp.float32)
        fn = jax.jit(functools.partial(key_copy.store_key_copy, page_size=ps, implementation=impl),
                     donate_argnums=(0, 1))
        k, s = fn(keys, scales, jnp.int32(L - 1), k_new, positions)
        page, slot = positions // ps, positions % ps
        b = jnp.arange(B)[:, None]
        out[impl] = (np.asarray(k[L - 1, b, jnp.arange(H)[None], page[:, None], slot[:, None]]),
                     np.asarray(s[L - 1, b, jnp.arange(H)[None], page[:, None], slot[:, None]]),
                     int(jnp.abs(k.astype(jnp.int32)).sum()), float(s.sum()))
        del k, s
    assert np.abs(out["pallas"][0].astype(np.int32) - vals.astype(np.int32)).max() <= 1
    np.testing.assert_allclose(out["pallas"][1], scale, rtol=1e-6)
    # nothing else written: the sums of the whole arrays equal the written entries' own
    assert out["pallas"][2] == int(np.abs(out["pallas"][0].astype(np.int64)).sum())
    assert out["xla"][2] == int(np.abs(out["xla"][0].astype(np.int64)).sum())
    np.testing.assert_allclose(out["pallas"][3], float(out["pallas"][1].sum()), rtol=1e-5)
