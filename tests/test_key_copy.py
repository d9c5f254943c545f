"""The decode step's key-copy write (jaxkv.kernels.key_copy): the kernel (interpret mode off
the GPU) and the reference against numpy on fresh seeds, with NaN in every scale the op must
leave alone, positions in any order, dropped ones (-1, past the pages) included; the kernel
lowered for an H200 at the decode shapes; the engine's two store methods token for token."""
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


def store_numpy(keys, scales, layer, vals, scale, positions, page_size):
    keys, scales = keys.copy(), scales.copy()
    Np = keys.shape[3]
    for b, pos in enumerate(positions):
        if pos < 0 or pos // page_size >= Np:
            continue
        keys[layer, b, :, pos // page_size, pos % page_size] = vals[b]
        scales[layer, b, :, pos // page_size, pos % page_size] = scale[b]
    return keys, scales


def _case(rng, L, B, H, Np, ps, D, dtype):
    if dtype == np.int8:
        keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
        vals = rng.integers(-127, 128, size=(B, H, D)).astype(np.int8)
    else:
        keys = rng.normal(size=(L, B, H, Np, ps, D)).astype(dtype)
        keys[rng.random(keys.shape) < 0.1] = np.nan
        vals = rng.normal(size=(B, H, D)).astype(dtype)
    scales = rng.random((L, B, H, Np, ps)).astype(np.float32)
    scales[rng.random(scales.shape) < 0.3] = np.nan   # left alone: must stay NaN
    scale = rng.random((B, H)).astype(np.float32)
    positions = rng.permutation(Np * ps)[:B].astype(np.int32)
    if B > 2:
        positions[rng.integers(B)] = -1               # no token
        positions[(rng.integers(B) + 1) % B] = Np * ps + int(rng.integers(1, 4 * ps))  # past
    return keys, scales, vals, scale, positions


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,H,Np,ps,D,dtype", [(4, 2, 6, 4, 8, np.int8), (3, 3, 5, 8, 16, np.int8),
                                               (1, 1, 2, 16, 8, np.int8),
                                               (2, 2, 4, 4, 8, jnp.bfloat16)])
def test_store_key_copy_matches_numpy(impl, B, H, Np, ps, D, dtype):
    rng = fresh_rng()
    L = 3
    dtype = np.dtype(dtype)
    keys, scales, vals, scale, positions = _case(rng, L, B, H, Np, ps, D, dtype)
    layer = int(rng.integers(L))
    got_k, got_s = key_copy.store_key_copy(jnp.asarray(keys), jnp.asarray(scales), jnp.int32(layer),
                                           jnp.asarray(vals), jnp.asarray(scale),
                                           jnp.asarray(positions), page_size=ps,
                                           implementation=impl, num_warps=2)
    want_k, want_s = store_numpy(keys, scales, layer, vals, scale, positions, ps)
    bits = lambda a: np.asarray(a).view(f"u{np.dtype(a.dtype).itemsize}")  # noqa: E731 - NaN too
    np.testing.assert_array_equal(bits(got_k), bits(want_k))
    np.testing.assert_array_equal(np.asarray(got_s), want_s)


def test_store_key_copy_rejects_mismatched_shapes():
    keys = jnp.zeros((2, 2, 2, 4, 4, 8), jnp.int8)
    scales = jnp.zeros((2, 2, 2, 4, 4), jnp.float32)
    ok = dict(vals=jnp.zeros((2, 2, 8), jnp.int8), scale=jnp.zeros((2, 2)),
              positions=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="page_size"):
        key_copy.store_key_copy(keys, scales, 0, page_size=8, **ok)
    with pytest.raises(ValueError, match="vals"):
        key_copy.store_key_copy(keys, scales, 0, page_size=4,
                                **dict(ok, vals=jnp.zeros((2, 8), jnp.int8)))


@pytest.mark.parametrize("name,L,B,H,Np,ps,D", [("qwen_b8_128k_p16", 28, 8, 2, 8212, 16, 64),
                                                ("8b_b1_128k_p16", 32, 1, 8, 8212, 16, 128)])
def test_store_key_copy_lowers_for_h200(no_interpret, name, L, B, H, Np, ps, D):
    """The Triton lowering at the decode shapes, the copy padded past 2**32 bytes where the
    int8 array is 2-4 GiB (``spec.alloc_rows``) as the selector allocates it."""
    La = alloc_rows(L, B * H * Np * ps * D, 1)
    s = jax.ShapeDtypeStruct
    fn = functools.partial(key_copy.store_key_copy, page_size=ps, implementation="pallas")
    text = lower_for_h200(fn, s((La, B, H, Np, ps, D), jnp.int8), s((La, B, H, Np, ps), jnp.float32),
                          s((), jnp.int32), s((B, H, D), jnp.int8), s((B, H), jnp.float32),
                          s((B,), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1 and "scatter" not in text, name


CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=3)


@pytest.mark.parametrize("mode", ["resident", "host"])
def test_engine_store_methods_give_the_same_tokens(mode):
    """``Tuning.rescore_store_method``: the kernel and XLA's scatters store the same bytes,
    so the two-stage selector's tokens are the same (a first stage that chooses: 24 of 64
    candidate pages)."""
    rng = fresh_rng()
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in (200, 157)]
    out = {}
    for method in ("xla", "pallas"):
        cache = CacheConfig(mode=mode, selector="quest_rescore8", page_size=4, selected_pages=3,
                            candidate_pages=24, tuning=Tuning(rescore_store_method=method))
        out[method] = jaxkv.generate(CFG, PARAMS, prompts, max_new_tokens=6, stop_tokens=[],
                                     cache=cache).tokens
    assert out["pallas"] == out["xla"]


def test_tuning_rejects_an_unknown_store_method():
    with pytest.raises(ValueError, match="rescore_store_method"):
        Tuning(rescore_store_method="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("L,B,H,Np,ps,D", [(4, 8, 2, 8212, 16, 64), (3, 1, 8, 8212, 16, 128),
                                           (2, 3, 3, 100, 8, 64)])
def test_gpu_store_key_copy_kernel(L, B, H, Np, ps, D):
    """The kernel on the GPU against the reference at decode shapes (same bytes)."""
    rng = fresh_rng()
    keys, scales, vals, scale, positions = _case(rng, L, B, H, Np, ps, D, np.dtype(np.int8))
    layer = int(rng.integers(L))
    fn = jax.jit(functools.partial(key_copy.store_key_copy, page_size=ps, implementation="pallas"))
    got_k, got_s = fn(jnp.asarray(keys), jnp.asarray(scales), jnp.int32(layer), jnp.asarray(vals),
                      jnp.asarray(scale), jnp.asarray(positions))
    want_k, want_s = store_numpy(keys, scales, layer, vals, scale, positions, ps)
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_s), want_s)


@pytest.mark.gpu
def test_gpu_store_key_copy_past_2_gib():
    """Qwen-like B=8 at 128k: the int8 copy of 3.5 GiB, padded past 2**32 bytes as the
    selector allocates it; the last layer's last request written near the array's end lands
    where the reference puts it, nothing else changes."""
    L, B, H, Np, ps, D = 28, 8, 2, 8212, 16, 64
    La = alloc_rows(L, B * H * Np * ps * D, 1)
    rng = fresh_rng()
    vals = jnp.asarray(rng.integers(-127, 128, size=(B, H, D)).astype(np.int8))
    scale = jnp.asarray(rng.random((B, H)).astype(np.float32) + 0.5)
    positions = jnp.asarray(Np * ps - 1 - rng.permutation(64)[:B], jnp.int32)
    out = {}
    for impl in ("pallas", "xla"):
        keys = jnp.zeros((La, B, H, Np, ps, D), jnp.int8)
        scales = jnp.zeros((La, B, H, Np, ps), jnp.float32)
        fn = jax.jit(functools.partial(key_copy.store_key_copy, page_size=ps, implementation=impl),
                     donate_argnums=(0, 1))
        k, s = fn(keys, scales, jnp.int32(L - 1), vals, scale, positions)
        page, slot = positions // ps, positions % ps
        b = jnp.arange(B)[:, None]
        out[impl] = (np.asarray(k[L - 1, b, jnp.arange(H)[None], page[:, None], slot[:, None]]),
                     np.asarray(s[L - 1, b, jnp.arange(H)[None], page[:, None], slot[:, None]]),
                     int(jnp.abs(k.astype(jnp.int32)).sum()), float(s.sum()))
        del k, s
    np.testing.assert_array_equal(out["pallas"][0], np.asarray(vals))
    np.testing.assert_array_equal(out["pallas"][1], np.asarray(scale))
    assert out["pallas"][2:] == out["xla"][2:]
