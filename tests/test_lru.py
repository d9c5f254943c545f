"""jaxkv.lru.ensure against the plain-Python model (tests/lru_model.py) on random streams,
for every implementation ("dense", "sort", and "pallas": the one-kernel version of "dense",
interpret mode on CPU), and the implementations against each other; the Pallas kernel's
Triton lowering for an abstract H200; GPU-only: "pallas" == "dense" on the device."""
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from jaxkv import lru
from jaxkv.lru import ensure
from lru_model import LruModel

METHODS = ("dense", "sort")
_JIT = {m: jax.jit(functools.partial(ensure, method=m)) for m in METHODS + ("pallas",)}


def _run_stream(L, P, S, R, Q, steps, seed, p_dup=0.3, p_pad=0.2, locality=0.7, method="sort"):
    _ensure = _JIT[method]
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
            # compacted: the fetched pages in ascending order first, -1 after
            n = len(fetched)
            assert src[l, :n].tolist() == sorted(fetched) and (src[l, n:] == -1).all(), (t, l)
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


@pytest.mark.parametrize("method", METHODS + ("pallas",))
def test_stream_pool_larger_than_requests(method):
    totals = _run_stream(L=3, P=64, S=24, R=8, Q=2, steps=60, seed=0, method=method)
    assert totals[0] > 0 and totals[1] > 0 and totals[2] > 0 and totals[3] == 0


@pytest.mark.parametrize("method", METHODS + ("pallas",))
def test_stream_pool_smaller_than_requests_drops_and_counts(method):
    totals = _run_stream(L=2, P=40, S=6, R=12, Q=3, steps=40, seed=1, p_dup=0.1, p_pad=0.0,
                         locality=0.2, method=method)
    assert totals[3] > 0  # something was dropped and counted


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(1, 2), P=st.integers(4, 48), S=st.integers(1, 16), R=st.integers(1, 12),
    Q=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
    p_dup=st.floats(0, 0.6), p_pad=st.floats(0, 0.6), locality=st.floats(0, 1),
)
@pytest.mark.parametrize("method", METHODS)
def test_property_matches_model(method, L, P, S, R, Q, seed, p_dup, p_pad, locality):
    S = min(S, P)
    _run_stream(L, P, S, R, Q, steps=12, seed=seed, p_dup=p_dup, p_pad=p_pad, locality=locality,
                method=method)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    L=st.integers(1, 3), P=st.integers(4, 48), S=st.integers(1, 12), R=st.integers(1, 10),
    Q=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
    p_dup=st.floats(0, 0.6), p_pad=st.floats(0, 0.6), locality=st.floats(0, 1),
)
def test_property_pallas_matches_model(L, P, S, R, Q, seed, p_dup, p_pad, locality):
    """Fewer examples than the jnp methods: each shape compiles an interpret-mode kernel."""
    _run_stream(L, P, min(S, P), R, Q, steps=10, seed=seed,
                p_dup=p_dup, p_pad=p_pad, locality=locality, method="pallas")


_FIELDS = ("page_table", "slot_owner", "last_used", "slots", "fetch_src", "fetch_dst",
           "fetch_payload", "hits", "misses", "evictions", "dropped")


@pytest.mark.parametrize("L,P,S,R,Q,p_dup,p_pad,locality", [
    (2, 200, 16, 12, 3, 0.3, 0.2, 0.8),   # pool larger than a step's request, churn
    (3, 40, 5, 14, 4, 0.4, 0.1, 0.3),     # pool smaller than the request: drops
    (1, 30, 30, 8, 2, 0.5, 0.5, 0.5),     # pool as large as the page space: no evictions
    (2, 64, 3, 1, 1, 0.0, 0.3, 0.2),      # single request, tiny pool
])
def test_dense_equals_sort_on_long_streams(L, P, S, R, Q, p_dup, p_pad, locality):
    """Both methods, fed the same stream from the same state, give identical EnsureResults
    (fetch entries in the same order too), including payloads of duplicated requests."""
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh each run; printed on failure
    rng = np.random.default_rng([L, P, S, R, Q, seed])
    state = (jnp.full((L, P), -1, jnp.int32), jnp.full((L, S), -1, jnp.int32),
             jnp.full((L, S), -1, jnp.int32))
    prev = rng.integers(0, P, (L, R))
    drops = evictions = 0
    for t in range(60):
        req = np.where(rng.random((L, R)) < locality, prev, rng.integers(0, P, (L, R)))
        req = np.where(rng.random((L, R)) < p_dup, np.roll(req, 1, axis=1), req)
        req = np.where(rng.random((L, R)) < p_pad, -1, req)
        prev = np.where(req >= 0, req, prev)
        prot = np.where(rng.random((L, Q)) < 0.5, rng.integers(0, P, (L, Q)), -1)
        pay = rng.integers(-1, 1000, (L, R))  # distinct per copy: exposes which copy is used
        args = (*state, jnp.asarray(req, jnp.int32), jnp.asarray(prot, jnp.int32), t,
                jnp.asarray(pay, jnp.int32))
        d, s = _JIT["dense"](*args), _JIT["sort"](*args)
        for f in _FIELDS:
            np.testing.assert_array_equal(getattr(d, f), getattr(s, f), err_msg=f"{f} step {t} seed {seed}")
        state = (s.page_table, s.slot_owner, s.last_used)
        drops += int(s.dropped)
        evictions += int(s.evictions)
    assert (evictions > 0) == (S < P)
    if S < R:
        assert drops > 0


def test_auto_picks_dense_for_small_pools_and_sort_for_large(monkeypatch):
    monkeypatch.delenv("JAXKV_IMPL", raising=False)
    monkeypatch.setattr(lru._common, "on_gpu", lambda: True)   # XLA on the GPU
    monkeypatch.setenv("JAXKV_IMPL", "xla")
    assert lru.resolve_method("auto", R=32, S=64, Q=4) == "dense"   # bench_fetch section_ensure
    assert lru.resolve_method("auto", R=1024, S=2304, Q=4) == "sort"
    monkeypatch.delenv("JAXKV_IMPL")
    monkeypatch.setattr(lru._common, "on_gpu", lambda: False)  # XLA:CPU: sort from ~2k elements
    assert lru.resolve_method("auto", R=16, S=24, Q=4) == "dense"
    assert lru.resolve_method("auto", R=32, S=64, Q=4) == "sort"
    assert lru.resolve_method("auto", R=32, S=64, Q=4, dense_max_elems=2 ** 20) == "dense"
    assert lru.resolve_method("auto", R=1024, S=2304, Q=4) == "sort"
    assert lru.resolve_method("sort", R=1, S=1, Q=1) == "sort"
    with pytest.raises(ValueError):
        lru.resolve_method("fast", R=1, S=1, Q=1)

    def prims(L, P, R, S, Q, **kw):
        args = (jnp.zeros((L, P), jnp.int32), jnp.zeros((L, S), jnp.int32),
                jnp.zeros((L, S), jnp.int32), jnp.zeros((L, R), jnp.int32),
                jnp.zeros((L, Q), jnp.int32), 0)
        return _primitives(jax.make_jaxpr(functools.partial(ensure, **kw))(*args).jaxpr)

    small = prims(32, 256, 16, 24, 4)   # dense on the CPU too
    assert not small & {"sort", "cumsum", "reduce_window_sum", "reduce_window_max"}, small
    assert "sort" in prims(1, 4096, 1024, 2304, 4)
    assert "sort" in prims(2, 16, 4, 4, 1, method="sort")


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


# ------------------------------------------------------------ "pallas": one kernel, all layers


def _random_state(rng, L, P, S):
    """A consistent random LRU state: a random number of resident pages, a random page ->
    slot permutation, random last-used steps (also on empty slots, which must not matter)."""
    pt = np.full((L, P), -1, np.int32)
    so = np.full((L, S), -1, np.int32)
    lu = rng.integers(-1, 8, (L, S)).astype(np.int32)
    for l in range(L):
        n = int(rng.integers(0, min(S, P) + 1))
        pages, slots = rng.permutation(P)[:n], rng.permutation(S)[:n]
        pt[l, pages], so[l, slots] = slots, pages
    return jnp.asarray(pt), jnp.asarray(so), jnp.asarray(lu)


def _random_step(rng, L, P, R, Q, p_dup, p_pad):
    """Requests with duplicates, -1 padding and a few out-of-range pages (>= P, ignored);
    protect lists with padding and out-of-range entries; a distinct payload per copy."""
    req = rng.integers(0, P, (L, R))
    req = np.where(rng.random((L, R)) < p_dup, np.roll(req, 1, axis=1), req)
    req = np.where(rng.random((L, R)) < p_pad, -1, req)
    req = np.where(rng.random((L, R)) < 0.05, P + 3, req)
    prot = np.where(rng.random((L, Q)) < 0.5, rng.integers(0, P + 2, (L, Q)), -1)
    pay = rng.integers(-1, 1000, (L, R))
    return (jnp.asarray(req, jnp.int32), jnp.asarray(prot, jnp.int32),
            jnp.asarray(pay, jnp.int32))


def _compare_stream(L, P, S, R, Q, steps, seed, p_dup=0.3, p_pad=0.2, a="pallas", b="dense"):
    """Feed methods ``a`` and ``b`` the same random stream from a random state; every field
    of their EnsureResults must be identical. Returns the summed (evictions, dropped)."""
    rng = np.random.default_rng([L, P, S, R, Q, seed])
    state = _random_state(rng, L, P, S)
    evictions = drops = 0
    for t in range(10, 10 + steps):
        req, prot, pay = _random_step(rng, L, P, R, Q, p_dup, p_pad)
        args = (*state, req, prot, t, pay)
        x, y = _JIT[a](*args), _JIT[b](*args)
        for f in _FIELDS:
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f),
                                          err_msg=f"{f} step {t} seed {seed}")
        state = (y.page_table, y.slot_owner, y.last_used)
        evictions += int(y.evictions)
        drops += int(y.dropped)
    return evictions, drops


@pytest.mark.parametrize("L,P,S,R,Q,p_dup,p_pad", [
    (3, 40, 7, 5, 3, 0.3, 0.2),      # nothing a power of two
    (2, 40, 5, 14, 4, 0.3, 0.1),     # pool smaller than the request: drops
    (2, 64, 16, 8, 2, 0.4, 0.3),     # powers of two, pool larger than the request
    (1, 12, 12, 6, 1, 0.5, 0.5),     # pool as large as the page space
    (2, 50, 1, 1, 1, 0.0, 0.3),      # one slot, one request
])
def test_pallas_equals_dense_on_streams(L, P, S, R, Q, p_dup, p_pad):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh each run; in the message
    evictions, drops = _compare_stream(L, P, S, R, Q, 25, seed, p_dup, p_pad)
    assert evictions > 0 or S >= P
    if S < R and p_pad < 0.2:
        assert drops > 0


def test_pallas_method_resolution(monkeypatch):
    monkeypatch.setattr(lru._common, "on_gpu", lambda: True)
    monkeypatch.delenv("JAXKV_IMPL", raising=False)
    assert lru.resolve_method("auto", R=32, S=64, Q=4) == "pallas"   # bench_fetch section_ensure
    assert lru.resolve_method("auto", R=128, S=16, Q=128) == "pallas"
    assert lru.resolve_method("auto", R=64, S=130, Q=2) == "dense"    # padded to 256: slower
    assert lru.resolve_method("auto", R=1, S=1, Q=300) == "dense"    # over the kernel's cap
    assert lru.resolve_method("auto", R=1024, S=2304, Q=4) == "sort"
    monkeypatch.setenv("JAXKV_IMPL", "xla")
    assert lru.resolve_method("auto", R=32, S=64, Q=4) == "dense"
    monkeypatch.setattr(lru._common, "on_gpu", lambda: False)
    monkeypatch.setenv("JAXKV_IMPL", "pallas")
    assert lru.resolve_method("auto", R=32, S=64, Q=4) == "pallas"
    monkeypatch.delenv("JAXKV_IMPL")
    assert lru.resolve_method("auto", R=32, S=64, Q=4) == "sort"      # XLA:CPU's threshold
    assert lru.resolve_method("auto", R=16, S=24, Q=4) == "dense"
    assert lru.resolve_method("pallas", R=5, S=7, Q=3) == "pallas"
    with pytest.raises(ValueError):
        lru.resolve_method("pallas", R=8, S=257, Q=1)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("L,P,S,R,Q", [(32, 256, 64, 32, 4), (3, 37, 7, 5, 3)])
def test_pallas_lowers_to_one_triton_kernel(monkeypatch, L, P, S, R, Q):
    """The real Triton path (not interpret mode) lowers for an abstract H200: one kernel, no
    sort, the page table aliased in place."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    monkeypatch.setattr(lru._common, "interpret_mode", lambda: False)
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    sds = jax.ShapeDtypeStruct
    args = [sds((L, P), jnp.int32), sds((L, S), jnp.int32), sds((L, S), jnp.int32),
            sds((L, R), jnp.int32), sds((L, Q), jnp.int32), sds((), jnp.int32)]
    with use_abstract_mesh(mesh):
        txt = jax.jit(functools.partial(ensure, method="pallas"), donate_argnums=0).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.sort" not in txt and "stablehlo.scatter" not in txt
    assert "output_operand_aliases" in txt


@pytest.mark.gpu
@pytest.mark.parametrize("L,P,S,R,Q", [(32, 256, 64, 32, 4), (5, 100, 7, 5, 3),
                                       (4, 600, 256, 256, 8)])
def test_gpu_pallas_equals_dense(L, P, S, R, Q):
    """On the device: the Triton kernel == the dense XLA path, at the bench shape, a ragged
    one and the size cap."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    _compare_stream(L, P, S, R, Q, 30, seed)
    _compare_stream(L, P, S, R, Q, 10, seed, a="pallas", b="sort")


@pytest.mark.gpu
def test_gpu_pallas_in_jitted_loop_with_donation():
    """In a fori_loop carry (the page table updated in place), "pallas" and "dense" give the
    same final state and counters."""
    L, P, S, R, Q, T = 32, 256, 64, 32, 4, 40
    rng = np.random.default_rng(1)
    reqs = jnp.asarray(rng.integers(-1, P // 2, (T, L, R)), jnp.int32)
    prot = jnp.asarray(np.where(rng.random((L, Q)) < 0.5, rng.integers(0, P, (L, Q)), -1),
                       jnp.int32)

    def run(state, method):
        def body(t, c):
            pt, so, lu, n = c
            r = ensure(pt, so, lu, reqs[t], prot, t, method=method)
            return r.page_table, r.slot_owner, r.last_used, n + jnp.stack(
                [r.hits, r.misses, r.evictions, r.dropped])
        return jax.lax.fori_loop(0, T, body, state)

    outs = []
    for method in ("pallas", "dense"):
        state = (*_random_state(np.random.default_rng(2), L, P, S), jnp.zeros(4, jnp.int32))
        outs.append(jax.jit(functools.partial(run, method=method), donate_argnums=0)(state))
    for x, y in zip(*outs):
        np.testing.assert_array_equal(x, y)
    assert int(outs[0][3][2]) > 0  # evictions happened
