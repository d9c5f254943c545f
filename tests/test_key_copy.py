"""The two-stage selectors' key copy (jaxkv.selectors.rescore): its quantizer against numpy,
and the decode step's write (two XLA scatters) against numpy on fresh seeds, with NaN in
every scale the write must leave alone, positions in any order, dropped ones (-1, past the
pages) included."""
import numpy as np
import pytest

import jax.numpy as jnp

from jaxkv.selectors import rescore
from page_kernel_util import fresh_rng

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
    way)."""
    got, want = np.asarray(got).astype(np.int32), np.asarray(want).astype(np.int32)
    assert np.abs(got - want).max() <= 1
    assert (got != want).mean() < 0.02


def test_quantize_matches_numpy():
    rng = fresh_rng()
    k = (rng.normal(size=(5, 3, 64)) * rng.uniform(0.01, 50, size=(5, 3, 1))).astype(np.float32)
    k[0, 0] = 0.0
    k[1, 1, :3] = [127.0, 0.5, -1.5]
    vals, scale = rescore.quantize(jnp.asarray(k), 8)
    want_v, want_s = quantize_numpy(k, 8)
    assert_same_to_rounding(vals, want_v)
    np.testing.assert_allclose(np.asarray(scale), want_s, rtol=1e-6)
    assert not np.asarray(vals)[0, 0].any() and float(scale[0, 0]) == 0.0
    vals, scale = rescore.quantize(jnp.asarray(k), 16)
    np.testing.assert_array_equal(np.asarray(vals), k)
    np.testing.assert_array_equal(np.asarray(scale), 1.0)


@pytest.mark.parametrize("B,H,Np,ps,D,dtype", [(4, 2, 6, 4, 8, np.int8), (3, 3, 5, 8, 16, np.int8),
                                               (1, 1, 2, 16, 8, np.int8),
                                               (2, 2, 4, 4, 8, jnp.bfloat16)])
def test_scatter_keys_matches_numpy(B, H, Np, ps, D, dtype):
    rng = fresh_rng()
    L = 3
    dtype = np.dtype(dtype)
    keys, scales, k_new, positions = _case(rng, L, B, H, Np, ps, D, dtype)
    layer = int(rng.integers(L))
    got_k, got_s = rescore.scatter_keys(jnp.asarray(keys), jnp.asarray(scales), jnp.int32(layer),
                                        jnp.asarray(k_new), jnp.asarray(positions))
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
