"""jaxkv.lru.ensure against the plain-Python model (tests/lru_model.py) on random streams."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from jaxkv import lru
from jaxkv.lru import ensure
from lru_model import LruModel

_ensure = jax.jit(ensure)


def _run_stream(L, P, S, R, Q, steps, seed, p_dup=0.3, p_pad=0.2, locality=0.7):
    rng = np.random.default_rng(seed)
    pt = jnp.full((L, P), -1, jnp.int32)
    so = jnp.full((L, S), -1, jnp.int32)
    lu = jnp.full((L, S), -1, jnp.int32)
    models = [LruModel(P, S) for _ in range(L)]
    prev = rng.integers(0, P, (L, R))
    totals = np.zeros(4, np.int64)
    for t in range(steps):
        req = np.where(rng.random((L, R)) < locality, prev, rng.integers(0, P, (L, R)))
        dup = rng.random((L, R)) < p_dup
        req = np.where(dup, np.roll(req, 1, axis=1), req)
        req = np.where(rng.random((L, R)) < p_pad, -1, req)
        prev = np.where(req >= 0, req, prev)
        prot = np.where(rng.random((L, Q)) < 0.5, rng.integers(0, P, (L, Q)), -1)
        out = _ensure(pt, so, lu, jnp.asarray(req, jnp.int32), jnp.asarray(prot, jnp.int32), t)
        pt, so, lu = out.page_table, out.slot_owner, out.last_used
        slots = np.asarray(out.slots)
        src, dst = np.asarray(out.fetch_src), np.asarray(out.fetch_dst)
        counts = np.zeros(4, np.int64)
        for l in range(L):
            m_slots, fetched, h, mi, ev, dr = models[l].step(req[l].tolist(), prot[l].tolist(), t)
            assert slots[l].tolist() == m_slots, (t, l)
            got = {int(s): int(d) for s, d in zip(src[l], dst[l]) if s >= 0}
            assert got == fetched, (t, l)
            assert all((s >= 0) == (d >= 0) for s, d in zip(src[l], dst[l]))
            counts += (h, mi, ev, dr)
            # state consistency: page_table and slot_owner are inverse maps
            pt_l, so_l = np.asarray(pt[l]), np.asarray(so[l])
            for s in range(S):
                if so_l[s] >= 0:
                    assert pt_l[so_l[s]] == s
            assert (pt_l >= 0).sum() == (so_l >= 0).sum()
            assert so_l.tolist() == models[l].owner
        assert counts.tolist() == [int(out.hits), int(out.misses), int(out.evictions), int(out.dropped)]
        totals += counts
    return totals


def test_stream_pool_larger_than_requests():
    totals = _run_stream(L=3, P=64, S=24, R=8, Q=2, steps=60, seed=0)
    assert totals[0] > 0 and totals[1] > 0 and totals[2] > 0 and totals[3] == 0


def test_stream_pool_smaller_than_requests_drops_and_counts():
    totals = _run_stream(L=2, P=40, S=6, R=12, Q=3, steps=40, seed=1, p_dup=0.1, p_pad=0.0,
                         locality=0.2)
    assert totals[3] > 0  # something was dropped and counted


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(1, 2), P=st.integers(4, 48), S=st.integers(1, 16), R=st.integers(1, 12),
    Q=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
    p_dup=st.floats(0, 0.6), p_pad=st.floats(0, 0.6), locality=st.floats(0, 1),
)
def test_property_matches_model(L, P, S, R, Q, seed, p_dup, p_pad, locality):
    S = min(S, P)
    _run_stream(L, P, S, R, Q, steps=12, seed=seed, p_dup=p_dup, p_pad=p_pad, locality=locality)


def test_pinned_pages_are_never_evicted():
    P, S = 32, 4
    pt = jnp.full((1, P), -1, jnp.int32)
    so = jnp.full((1, S), -1, jnp.int32)
    lu = jnp.full((1, S), -1, jnp.int32)
    out = ensure(pt, so, lu, jnp.array([[0, 1, 2, 3]]), jnp.array([[-1]]), 0)
    pt, so, lu = out.page_table, out.slot_owner, out.last_used
    for t in range(1, 20):  # page 0 is pinned; others churn
        req = jnp.array([[4 + t % 20, 5 + t % 20, -1, -1]], jnp.int32)
        out = ensure(pt, so, lu, req, jnp.array([[0]]), t)
        pt, so, lu = out.page_table, out.slot_owner, out.last_used
        assert int(pt[0, 0]) >= 0
    assert int(out.dropped) == 0


def test_duplicates_and_padding_share_one_slot():
    out = ensure(jnp.full((1, 8), -1, jnp.int32), jnp.full((1, 4), -1, jnp.int32),
                 jnp.full((1, 4), -1, jnp.int32), jnp.array([[3, -1, 3, 5, 3]]), jnp.array([[-1]]), 0)
    s = np.asarray(out.slots[0])
    assert s[1] == -1 and s[0] == s[2] == s[4] >= 0 and s[3] >= 0 and s[3] != s[0]
    assert int(out.misses) == 2 and int(out.hits) == 0
    assert int((np.asarray(out.fetch_src) >= 0).sum()) == 2


def _primitives(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_fixed_shapes_and_no_loops():
    args = (jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32),
            jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 2), jnp.int32), 0)
    prims = _primitives(jax.make_jaxpr(ensure)(*args).jaxpr)
    assert not prims & {"while", "scan", "nonzero", "cond"}, prims
    out = jax.eval_shape(ensure, *args)
    assert out.slots.shape == (2, 6) and out.fetch_src.shape == (2, 6)


@pytest.mark.parametrize("n", [1, 7, 64, 65, 256, 1000, 4097])
def test_prefix_scans_match_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.integers(-50, 50, (3, n)).astype(np.int32)
    np.testing.assert_array_equal(lru.prefix_sum(jnp.asarray(x)), np.cumsum(x, axis=-1))
    np.testing.assert_array_equal(lru.prefix_max(jnp.asarray(x)), np.maximum.accumulate(x, axis=-1))
