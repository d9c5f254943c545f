"""The two-stage selectors' second stage (jaxkv.kernels.candidate_mass) against numpy: fresh
seeds, NaN in every key and scale the op must not read, candidates in any order."""
import numpy as np
import pytest

import jax.numpy as jnp

from jaxkv.kernels import candidate_mass as cm


def _rng():
    return np.random.default_rng(np.random.SeedSequence().entropy)


def mass_numpy(q, keys, scales, layer, cand, positions):
    """Float64 masses: per KV head and query head, softmax over the candidates' valid tokens."""
    _, B, H, Np, ps, D = keys.shape
    G = q.shape[1] // H
    out = np.full(cand.shape, -np.inf)
    for b in range(B):
        for h in range(H):
            c = cand[b, h]
            toks = [(i, p, t) for i, p in enumerate(c) if p >= 0 for t in range(ps)
                    if p * ps + t <= positions[b]]
            mass = np.zeros(len(c))
            for g in range(G):
                if not toks:
                    break
                s = np.array([keys[layer, b, h, p, t].astype(np.float64) * scales[layer, b, h, p, t]
                              @ q[b, h * G + g].astype(np.float64) for _, p, t in toks]) / np.sqrt(D)
                w = np.exp(s - s.max())
                for (i, _, _), wi in zip(toks, w / w.sum()):
                    mass[i] += wi
            out[b, h] = np.where(c >= 0, mass, -np.inf)
    return out


def _case(rng, *, L=2, B=3, H=2, G=3, Np=10, ps=4, D=8, C=5, int8=True):
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    if int8:
        keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
        scales = (rng.random((L, B, H, Np, ps)) * 0.05).astype(np.float32)
    else:
        keys = rng.normal(size=(L, B, H, Np, ps, D)).astype(np.float32)
        scales = np.ones((L, B, H, Np, ps), np.float32)
    positions = np.array([Np * ps - 3, 13, -1][:B], np.int32)
    cand = np.full((B, H, C), -1, np.int32)
    for b in range(B):
        n = max(0, -(-(positions[b] + 1) // ps))
        for h in range(H):
            pick = rng.permutation(n)[:rng.integers(0, min(C, n) + 1)]  # any order, some -1
            cand[b, h, :len(pick)] = pick
    return q, keys, scales, cand, positions


def _poison(keys, scales, cand, positions, layer, ps):
    """NaN keys / scales everywhere the op must not read: other layers, non-candidate pages,
    tokens past the position (float keys; int8 keys get NaN scales only)."""
    scales = scales.copy()
    keys = keys.copy()
    L, B, H, Np = keys.shape[:4]
    read = np.zeros((L, B, H, Np, ps), bool)
    for b in range(B):
        for h in range(H):
            for p in cand[b, h][cand[b, h] >= 0]:
                read[layer, b, h, p] = p * ps + np.arange(ps) <= positions[b]
    scales[~read] = np.nan
    if keys.dtype != np.int8:
        keys[~read] = np.nan
    return keys, scales


@pytest.mark.parametrize("int8", [True, False])
def test_candidate_mass_matches_numpy_with_poison(int8):
    rng = _rng()
    q, keys, scales, cand, positions = _case(rng, int8=int8)
    want = mass_numpy(q, keys, scales, 1, cand, positions)
    keys, scales = _poison(keys, scales, cand, positions, 1, 4)
    got = np.asarray(cm.candidate_mass(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales),
                                       jnp.int32(1), jnp.asarray(cand), jnp.asarray(positions)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    G = q.shape[1] // keys.shape[2]
    for b, h in np.ndindex(cand.shape[:2]):  # a row's candidates hold its G heads' mass
        ok = cand[b, h] >= 0
        assert np.all(got[b, h][~ok] == -np.inf)
        if ok.any() and positions[b] >= 0:
            np.testing.assert_allclose(got[b, h][ok].sum(), G, rtol=1e-5)
