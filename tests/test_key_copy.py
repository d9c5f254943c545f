"""The two-stage selectors' key copy update (jaxkv.kernels.key_copy): the kernel
(interpret mode off the GPU) and the reference against numpy, fresh seeds, every element
outside the written token unchanged (NaN scales included)."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxkv.kernels import key_copy as kc
from tests.lowering import lower_for_h200

IMPLS = ["pallas", "xla"]


def _rng():
    return np.random.default_rng(np.random.SeedSequence().entropy)


def write_numpy(keys, scales, layer, k_new, positions, use_scales=None):
    """The update in numpy; ``use_scales`` [L, B, H, Np, ps]: quantize with these scales at
    the written tokens (an implementation's own) to check the rounding apart from the scale."""
    keys, scales = keys.copy(), scales.copy()
    _, B, H, Np, ps, D = keys.shape
    k = np.asarray(k_new if k_new.ndim == 3 else k_new[:, 0], np.float32)
    for b in range(B):
        p = int(positions[b])
        if p < 0 or p // ps >= Np:
            continue
        for h in range(H):
            if keys.dtype == np.int8:
                s = np.float32(np.max(np.abs(k[b, h])) * (np.float32(1) / np.float32(127)))
                if use_scales is not None:
                    s = use_scales[layer, b, h, p // ps, p % ps]
                q = np.round(k[b, h] / (s if s > 0 else np.float32(1.0)))
                keys[layer, b, h, p // ps, p % ps] = np.clip(q, -127, 127).astype(np.int8)
            else:
                s = 1.0
                keys[layer, b, h, p // ps, p % ps] = k[b, h].astype(keys.dtype)
            scales[layer, b, h, p // ps, p % ps] = s
    return keys, scales


def _case(rng, *, L=3, B=4, H=2, Np=5, ps=4, D=8, int8=True, stacked=True):
    if int8:
        keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
    else:
        keys = rng.normal(size=(L, B, H, Np, ps, D)).astype(np.float32)
    scales = rng.random((L, B, H, Np, ps)).astype(np.float32)
    scales[0] = np.nan  # never written at layer 1: must stay NaN
    shape = (B, 2, H, D) if stacked else (B, H, D)
    k_new = (rng.normal(size=shape) * rng.choice([0.01, 1.0, 30.0])).astype(np.float32)
    k_new[0] = 0.0  # a zero key: scale 0, values 0
    positions = np.array([7, -1, Np * ps - 1, Np * ps][:B], np.int32)  # last: past the copy
    return keys, scales, k_new, positions


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("int8,stacked,H", [(True, True, 2), (True, False, 4), (False, True, 2),
                                            (True, True, 3)])
def test_write_key_copy_matches_numpy(impl, int8, stacked, H):
    rng = _rng()
    keys, scales, k_new, positions = _case(rng, int8=int8, stacked=stacked, H=H)
    _, want_s = write_numpy(keys, scales, 1, k_new, positions)
    args = (jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1), jnp.asarray(k_new),
            jnp.asarray(positions))
    got_k, got_s = (np.asarray(x) for x in kc.write_key_copy(*args, implementation=impl))
    np.testing.assert_array_equal(got_s, want_s)  # NaN where unwritten stays NaN
    want_k, _ = write_numpy(keys, scales, 1, k_new, positions, use_scales=got_s)
    np.testing.assert_array_equal(got_k, want_k)
    if impl == "pallas":  # the kernel gives the reference's copy exactly (same XLA here)
        ref_k, ref_s = kc.write_key_copy(*args, implementation="xla")
        np.testing.assert_array_equal(got_k, np.asarray(ref_k))
        np.testing.assert_array_equal(got_s, np.asarray(ref_s))


def test_quantize_rounds_half_to_even():
    """The kernel's rounding (floor-based, Triton has no round) equals jnp.round, ties
    included."""
    x = jnp.asarray(np.concatenate([np.arange(-260, 260) * 0.5,
                                    _rng().normal(size=2000) * 60]), jnp.float32)
    np.testing.assert_array_equal(np.asarray(kc._round_half_even(x)), np.asarray(jnp.round(x)))


@pytest.mark.parametrize("shape", [(28, 8, 2, 2048, 64, 128), (32, 1, 8, 8192, 16, 128)])
def test_write_key_copy_lowers_for_gpu(shape):
    """One Triton call and no scatter (Qwen-like B=8 and 8B-like B=1 at 128k)."""
    S = jax.ShapeDtypeStruct
    B, H, D = shape[1], shape[2], shape[5]
    fn = functools.partial(kc.write_key_copy_pallas, interpret=False)
    txt = lower_for_h200(fn, S(shape, jnp.int8), S(shape[:5], jnp.float32), S((), jnp.int32),
                         S((B, 2, H, D), jnp.bfloat16), S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "scatter" not in txt


@pytest.mark.gpu
def test_gpu_write_key_copy():
    """The kernel on the GPU against numpy at a Qwen-like decode shape, bit for bit (bf16
    keys in: values at exact rounding ties, e.g. half of the largest, are common)."""
    rng = _rng()
    L, B, H, Np, ps, D = 4, 8, 2, 256, 64, 128
    keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
    scales = rng.random((L, B, H, Np, ps)).astype(np.float32)
    k_new = np.asarray(jnp.asarray(rng.normal(size=(B, 2, H, D)) * 3, jnp.bfloat16))
    positions = rng.integers(-1, Np * ps, size=B).astype(np.int32)
    _, want_s = write_numpy(keys, scales, 2, k_new.astype(np.float32), positions)
    got_k, got_s = (np.asarray(x) for x in kc.write_key_copy_pallas(
        jnp.asarray(keys), jnp.asarray(scales), jnp.int32(2), jnp.asarray(k_new),
        jnp.asarray(positions)))
    np.testing.assert_array_equal(got_s, want_s)
    want_k, _ = write_numpy(keys, scales, 2, k_new.astype(np.float32), positions,
                            use_scales=got_s)
    np.testing.assert_array_equal(got_k, want_k)
