"""Tests of benchmarks/synthetic.py (synthetic decode states, selection traces, overlap
calibration) and a smoke run of benchmarks/decode_lib.py, on the tiny model (CPU)."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_lib  # benchmarks/ (tests/conftest.py puts it on sys.path)
import synthetic
from jaxkv import cache as kvcache
from jaxkv import engine
from jaxkv.api import make_plan
from jaxkv.config import CacheConfig, Sampling
from jaxkv.models import configs, llama
from jaxkv.kernels import quest

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
PS = 4
SEED = int(np.random.default_rng().integers(0, 2**31))
LENGTHS = [37, 50]           # partial last pages on purpose
STOP = jnp.full((4,), -1, jnp.int32)


def _plan(mode="host", selector="quest", k=4, batch=2, max_context=64, cfg=CFG, **kw):
    cache = CacheConfig(mode=mode, selector=selector, page_size=PS, selected_pages=k, **kw)
    return engine.Plan(model=cfg, cache=cache, batch=batch, prompt_len=max_context,
                       max_context=max_context, num_stop=4)


def _tier(plan, state):
    """The filled tier as numpy [L, B, Np, 2, H, ps, D]."""
    c = plan.model
    arr = np.asarray(state.kv.host_kv if plan.cache.mode == "host" else state.kv.pool)
    return arr.reshape(c.num_layers, plan.batch, plan.pages_per_seq, 2, c.num_kv_heads, PS,
                       c.head_dim)


def _decode(plan, state, rounds=1):
    toks = []
    for _ in range(rounds):
        state, buf, _ = engine.decode_round(plan, PARAMS, state, Sampling.make(), STOP,
                                            jnp.int32(1000))
        toks.append(np.asarray(buf))
    return state, np.concatenate(toks, axis=1)


def _poison_after(plan, state, lengths):
    """NaN in every token slot at positions >= lengths[b] (host tier or resident pool)."""
    arr = _tier(plan, state).copy()
    pos = np.arange(plan.pages_per_seq)[:, None] * PS + np.arange(PS)[None, :]   # [Np, ps]
    for b, n in enumerate(lengths):
        arr[:, b] = np.where((pos >= n)[None, :, None, None, :, None], np.nan, arr[:, b])
    flat = arr.reshape(-1, arr.shape[3] * arr.shape[4] * PS * arr.shape[-1])
    if plan.cache.mode == "host":
        kv = dataclasses.replace(state.kv, host_kv=jax.device_put(flat, kvcache.host_sharding()))
    else:
        kv = dataclasses.replace(state.kv, pool=jax.device_put(flat, kvcache.device_sharding()))
    return dataclasses.replace(state, kv=kv)


def test_fill_matches_summaries_and_is_chunking_invariant():
    synth = synthetic.Synthetic(salience=0.4)
    plan = _plan("host")
    a = synthetic.build_state(plan, LENGTHS, synth=synth, seed=SEED,
                              chunk_bytes=plan.spec.page_bytes)          # one page per call
    rplan = _plan("resident")
    b = synthetic.build_state(rplan, LENGTHS, synth=synth, seed=SEED)  # one call
    ta, tb = _tier(plan, a), _tier(rplan, b)
    np.testing.assert_array_equal(ta, tb)
    for x, y in zip(a.summaries, b.summaries):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    kmax, kmin = (np.asarray(s) for s in a.summaries)
    L, B, Np = CFG.num_layers, plan.batch, plan.pages_per_seq
    for layer in range(L):
        keys = ta[layer, :, :, 0].transpose(0, 1, 3, 2, 4).reshape(B, Np * PS, CFG.num_kv_heads,
                                                                    CFG.head_dim)
        rmax, rmin = quest.quest_summarize(jnp.asarray(keys), PS, jnp.asarray(LENGTHS))
        for bb, n in enumerate(LENGTHS):
            nv = -(-n // PS)
            np.testing.assert_array_equal(kmax[layer, bb, :nv], np.asarray(rmax)[bb, :nv])
            np.testing.assert_array_equal(kmin[layer, bb, :nv], np.asarray(rmin)[bb, :nv])
            assert np.all(kmax[layer, bb, nv:] == -np.inf) and np.all(kmin[layer, bb, nv:] == np.inf)
            assert np.all(ta[layer, bb, nv:] == 0)                       # unused pages untouched
            assert np.isfinite(ta[layer, bb, :nv]).all() and ta[layer, bb, :nv].std() > 0.5
    # different requests / layers / seeds get different data
    assert not np.array_equal(ta[0, 0, 0], ta[0, 1, 0]) and not np.array_equal(ta[0, 0, 0], ta[1, 0, 0])
    c = synthetic.build_state(plan, LENGTHS, synth=synth, seed=SEED + 1)
    assert not np.array_equal(_tier(plan, c)[0, 0, 0], ta[0, 0, 0])


def test_rescore_key_copy_is_the_tiers_keys_quantized():
    """A two-stage selector's fill: Quest's summaries as for Quest, and the key copy
    [L, B, H, Np, ps, D] equal to the tier's keys quantized (int8 with a scale per token)."""
    from jaxkv.selectors import rescore
    synth = synthetic.Synthetic(salience=0.4)
    q = synthetic.build_state(_plan("resident"), LENGTHS, synth=synth, seed=SEED)
    plan = _plan("resident", "quest_rescore", bounds_dtype="float")   # Quest's per-page bounds
    st = synthetic.build_state(plan, LENGTHS, synth=synth, seed=SEED)
    for x, y in zip(q.summaries, st.summaries[:2]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # blocks of four pages: the bounds of each block's tokens, the same key copy
    blocks = synthetic.build_state(_plan("resident", "quest_rescore", candidate_block=4,
                                         bounds_dtype="float"), LENGTHS, synth=synth, seed=SEED)
    assert blocks.summaries[0].shape[2] == plan.pages_per_seq // 4
    for x, y in zip(blocks.summaries[2:], st.summaries[2:]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    want = []
    for i, red in ((0, np.max), (1, np.min)):
        per_page = np.asarray(st.summaries[i])                         # [L, B, Np, H, D]
        L_, B_, Np_, H_, D_ = per_page.shape
        want.append(red(per_page.reshape(L_, B_, Np_ // 4, 4, H_, D_), axis=3))
        np.testing.assert_array_equal(np.asarray(blocks.summaries[i]), want[-1])
    # the default's int8 bounds (shift 0 here), per page and per block of four, a chunk of
    # one page's bytes and of all: the float bounds quantized (empty pages / blocks 0)
    for r in (1, 4):
        for chunk in (plan.spec.page_bytes, synthetic.DEFAULT_CHUNK_BYTES):
            i8 = synthetic.build_state(_plan("resident", "quest_rescore", candidate_block=r),
                                       LENGTHS, synth=synth, seed=SEED, chunk_bytes=chunk)
            ref = (st.summaries[:2] if r == 1 else want)
            exp = quest.quantize_bounds(*map(jnp.asarray, ref))
            for b, n in enumerate(LENGTHS):
                nv = -(-n // (PS * r))
                for got, e in zip(i8.summaries[:3], exp):
                    np.testing.assert_array_equal(np.asarray(got)[:, b, :nv],
                                                  np.asarray(e)[:, b, :nv])
                for got in i8.summaries[:2]:                       # blocks past the sequence
                    assert not np.asarray(got)[:, b, nv:].any()
            assert not np.asarray(i8.summaries[3]).any()
            for b, n in enumerate(LENGTHS):                        # the key copy's used pages
                for x, y in zip(i8.summaries[4:], st.summaries[2:]):
                    np.testing.assert_array_equal(np.asarray(x)[:, b, :, :-(-n // PS)],
                                                  np.asarray(y)[:, b, :, :-(-n // PS)])
    keys = _tier(plan, st)[:, :, :, 0].transpose(0, 1, 3, 2, 4, 5)       # [L, B, H, Np, ps, D]
    vals, scale = rescore.quantize(jnp.asarray(keys), 8)
    for b, n in enumerate(LENGTHS):
        nv = -(-n // PS)
        np.testing.assert_array_equal(np.asarray(st.summaries[2])[:, b, :, :nv],
                                      np.asarray(vals)[:, b, :, :nv])
        np.testing.assert_array_equal(np.asarray(st.summaries[3])[:, b, :, :nv],
                                      np.asarray(scale)[:, b, :, :nv])


def test_a_shared_cache_gets_the_same_data_and_summaries(monkeypatch):
    """build_state(kv=another resident state's cache) fills that cache in place with the same
    data and gives the selector the summaries of a state of its own; a host plan or another
    layout is refused."""
    quest_plan = _plan(mode="resident")
    rescore_plan = _plan(mode="resident", selector="quest_rescore8", candidate_pages=8)
    own = synthetic.build_state(rescore_plan, LENGTHS, seed=SEED)
    first = synthetic.build_state(quest_plan, LENGTHS, seed=SEED)
    want_tier = _tier(quest_plan, first)
    real_init_kv = engine.init_kv

    def no_new_cache(*a, **k):   # the layout check's abstract call (eval_shape) is fine
        if not isinstance(jnp.zeros(()), jax.core.Tracer):
            raise AssertionError("a second cache was allocated")
        return real_init_kv(*a, **k)

    monkeypatch.setattr(engine, "init_kv", no_new_cache)
    shared = synthetic.build_state(rescore_plan, LENGTHS, seed=SEED, kv=first.kv)
    monkeypatch.setattr(engine, "init_kv", real_init_kv)
    np.testing.assert_array_equal(_tier(rescore_plan, shared), want_tier)
    np.testing.assert_array_equal(_tier(rescore_plan, shared), _tier(rescore_plan, own))
    for a, b in zip(jax.tree.leaves(shared.summaries), jax.tree.leaves(own.summaries)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for plan in (_plan(mode="host"), _plan(mode="resident", max_context=128)):
        with pytest.raises(ValueError, match="kv= takes a resident cache"):
            synthetic.build_state(plan, LENGTHS, seed=SEED, kv=shared.kv)


def test_indexer_page_sums_cover_valid_tokens_only():
    cfg = configs.with_indexer(CFG, heads=4, dim=16)
    synth = synthetic.Synthetic(salience=0.3)
    plan = _plan("host", "indexer", cfg=cfg)
    st = synthetic.build_state(plan, LENGTHS, synth=synth, seed=SEED, chunk_bytes=3 * plan.spec.page_bytes)
    sums = np.asarray(st.summaries[0])                                  # [L, B, Np, dI]
    for layer in range(cfg.num_layers):
        for b, n in enumerate(LENGTHS):
            nv = -(-n // PS)
            for p in (0, nv - 1):
                ik = synthetic._page_index_keys(synthetic._page_key(np.uint32(SEED), layer, b, p),
                                                jnp.float32(0.3), dI=16, ps=PS)
                valid = (p * PS + np.arange(PS)) < n
                want = np.asarray(ik)[valid].sum(0)
                np.testing.assert_allclose(sums[layer, b, p], want, rtol=1e-5, atol=1e-5)
            assert np.all(sums[layer, b, nv:] == 0)


def test_host_and_resident_states_decode_identically_with_poison():
    synth = synthetic.Synthetic(salience=0.3)
    # 14 slots per layer for 23 context pages: the LRU churns
    host = _plan("host", pool_pages=14, round_steps=6)
    res = _plan("resident", round_steps=6)
    hs = synthetic.build_state(host, LENGTHS, synth=synth, seed=SEED, poison=True)
    rs = synthetic.build_state(res, LENGTHS, synth=synth, seed=SEED, poison=True)
    hs, rs = _poison_after(host, hs, LENGTHS), _poison_after(res, rs, LENGTHS)
    hs, th = _decode(host, hs, rounds=2)
    rs, tr = _decode(res, rs, rounds=2)
    np.testing.assert_array_equal(th, tr)
    assert (th >= 0).all()
    c = hs.kv.counters.as_dict(host.spec)
    assert c["misses"] > 0 and c["hits"] > 0 and c["evictions"] > 0
    np.testing.assert_array_equal(np.asarray(hs.lengths), np.asarray(LENGTHS) + 12)


def test_selecting_every_page_equals_dense_resident():
    synth = synthetic.Synthetic(salience=0.2)
    full = _plan("host", k=16, round_steps=5)                     # k = pages_per_seq
    dense = _plan("resident", "dense", round_steps=5)
    _, a = _decode(full, synthetic.build_state(full, LENGTHS, synth=synth, seed=SEED))
    _, b = _decode(dense, synthetic.build_state(dense, LENGTHS, synth=synth, seed=SEED))
    np.testing.assert_array_equal(a, b)


def test_reuse_state_restarts_deterministically_across_pool_sizes():
    synth = synthetic.Synthetic(salience=0.3)
    p_big = _plan("host", pool_pages=30, round_steps=6)
    p_small = _plan("host", pool_pages=14, round_steps=6)
    st = synthetic.build_state(p_big, LENGTHS, synth=synth, seed=SEED)
    st, t1 = _decode(p_big, st)
    st = synthetic.reuse_state(p_small, st, LENGTHS, seed=SEED)   # new pool, cold LRU
    assert st.kv.pool.shape == p_small.spec.pool_shape
    assert int(st.kv.counters.misses) == 0 and np.all(np.asarray(st.kv.page_table) == -1)
    st, t2 = _decode(p_small, st)
    np.testing.assert_array_equal(t1, t2)
    # resident -> dense keeps the pool and drops the summaries
    rp = _plan("resident", round_steps=6)
    rs = synthetic.build_state(rp, LENGTHS, synth=synth, seed=SEED)
    ds = synthetic.reuse_state(_plan("resident", "dense", round_steps=6), rs, [20, 30], seed=SEED)
    assert ds.summaries == () and np.asarray(ds.lengths).tolist() == [20, 30]
    with pytest.raises(ValueError, match="does not match"):
        synthetic.reuse_state(_plan("host", max_context=128), ds, LENGTHS)
    with pytest.raises(ValueError, match="lengths"):
        synthetic.reuse_state(rp, ds, [64, 3])


def test_trace_selections_mirrors_the_engine():
    synth = synthetic.Synthetic(salience=0.3)
    plan = _plan("resident", round_steps=6)
    st = synthetic.build_state(plan, LENGTHS, synth=synth, seed=SEED)
    first = np.asarray(st.last_token)
    _, toks = _decode(plan, st)                                   # greedy engine tokens
    st = synthetic.build_state(plan, LENGTHS, synth=synth, seed=SEED)
    fed = np.concatenate([first[:, None], toks[:, :-1]], axis=1)
    st, pages, greedy = synthetic.trace_selections(plan, PARAMS, st, fed)
    np.testing.assert_array_equal(np.asarray(greedy), toks)
    pages = np.asarray(pages)                                     # [T, L, B, H, k]
    assert pages.shape == (6, CFG.num_layers, 2, CFG.num_kv_heads, 4)
    for t in range(6):
        for b, n in enumerate(LENGTHS):
            cur = (n + t) // PS
            row = pages[t, :, b]
            assert (row[..., 0] == 0).all() and (row == cur).any(-1).all()
            assert (row <= cur).all() and (np.diff(row, axis=-1) > 0).all()
    with pytest.raises(ValueError, match="resident"):
        synthetic.trace_selections(_plan("host"), PARAMS, st, fed)


def test_forced_ahead_and_lagged_state_decode():
    """Lagged selection: a synthetic state's first step reads the forced pages only."""
    cache = CacheConfig(mode="host", selector="quest", selection_lag=1, page_size=4,
                        selected_pages=4, sink_pages=2, max_context=64, round_steps=4)
    plan = make_plan(CFG, cache, [9, 30], 8, num_stop=1)
    ahead = np.asarray(synthetic.forced_ahead(plan, jnp.asarray([1, 30], jnp.int32)))
    assert ahead.shape == (CFG.num_layers, 2, CFG.num_kv_heads, 4)
    np.testing.assert_array_equal(ahead[0, 0, 0], [0, -1, -1, -1])  # the sink page 0 is page 0
    np.testing.assert_array_equal(ahead[-1, 1, 1], [0, 1, 7, -1])    # sinks, then page 30 // 4
    st = synthetic.build_state(plan, [9, 30])
    np.testing.assert_array_equal(np.asarray(st.summaries[-1][:, 0, 0]),
                                  np.broadcast_to([0, 1, 2, -1], (CFG.num_layers, 4)))
    st, toks, steps = engine.decode_round(plan, PARAMS, st, Sampling.make(),
                                          jnp.full((1,), -1, jnp.int32), jnp.int32(4))
    assert int(steps) == 4 and (np.asarray(toks) >= 0).all()
    # a lagged state is rebound to the exact plan (and back) without its pages
    exact = make_plan(CFG, dataclasses.replace(cache, selection_lag=0), [9, 30], 8, num_stop=1)
    st = synthetic.reuse_state(exact, st, [9, 30])
    assert len(st.summaries) == 2
    st = synthetic.reuse_state(plan, st, [9, 30])
    assert len(st.summaries) == 3


def test_selection_overlap_counts():
    base = np.array([0, 3, 5, 9])
    same = np.broadcast_to(base, (3, 2, 1, 2, 4))
    s = synthetic.selection_overlap(same)
    assert s["mean"] == 1.0 and s["union_mean"] == 1.0 and s["selected_mean"] == 4
    half = np.stack([base, [0, 3, 6, 10], [0, 3, 7, -1]])[:, None, None, None, :]
    s = synthetic.selection_overlap(half, num_sink_pages=1)
    assert s["per_step"] == pytest.approx([0.5, 2 / 3])
    # without the sink (0) and each step's last page: {3, 5} -> {3, 6} -> {3}: 1/2 then 1/1
    assert s["excl_forced_mean"] == pytest.approx(0.75)


def test_salience_sets_the_overlap_and_calibrates():
    kw = dict(model=CFG, page_size=PS, num_pages=64, k=8, steps=12, seed=0)  # fixed: a statistical calibration, not a kernel check
    low = synthetic.simulate_overlap(1e-4, **kw)
    high = synthetic.simulate_overlap(5.0, **kw)
    assert low < 0.5 and high > 0.9
    sal, got = synthetic.calibrate_salience(0.7, **kw)
    assert abs(got - 0.7) < 0.08 and 1e-4 < sal < 5
    assert abs(synthetic.simulate_overlap(sal, **kw) - got) < 1e-9     # deterministic


def test_two_stage_simulation_needs_more_salience():
    """A two-stage selector's simulated overlap (Quest's candidates re-ranked by their
    attention mass from the int8 key copy) grows with the salience too, but more slowly than
    Quest's: independent queries move exact masses more than Quest's bound. At the salience
    that gives Quest a high overlap it is lower; the calibration reaches a target with a
    larger salience. An unknown selector is refused by name."""
    kw = dict(model=CFG, page_size=PS, num_pages=64, k=8, steps=12, seed=0)  # fixed: a statistical calibration
    two = dict(kw, selector="quest_rescore")                                # 4 x 8 of 64 pages
    lo, hi = (synthetic.simulate_overlap(s, **two) for s in (1e-4, 5.0))
    assert 0 <= lo < 0.5 < 0.9 < hi <= 1
    sal_q, _ = synthetic.calibrate_salience(0.8, **kw)
    assert synthetic.simulate_overlap(sal_q, **two) < synthetic.simulate_overlap(sal_q, **kw)
    sal_r, got = synthetic.calibrate_salience(0.8, **two)
    assert abs(got - 0.8) < 0.08 and sal_r > sal_q
    with pytest.raises(ValueError, match="two-stage selector"):
        synthetic.simulate_overlap(1.0, **dict(kw, selector="oracle"))


def test_measure_overlap_on_tiny_model():
    toks = np.random.default_rng(SEED).integers(3, CFG.vocab_size, 64)
    r = decode_lib.measure_overlap(CFG, PARAMS, toks, context=64, steps=6, page_size=PS,
                                   selected_tokens=64)            # k = every page
    # only the page that opens at position 60 is new
    assert r["excl_forced_mean"] == 1.0 and r["mean"] > 0.95
    assert r["prompt_tokens"] == 58 and len(r["per_layer"]) == CFG.num_layers
    assert r["chance_overlap"] == 1.0 and 0 <= r["next_token_accuracy"] <= 1
    two = decode_lib.measure_overlap(CFG, PARAMS, toks, context=64, steps=6, page_size=PS,
                                     selected_tokens=16, selector="quest_rescore8")
    assert two["selector"] == "quest_rescore8" and 0 < two["mean"] <= 1
    assert decode_lib.overlap_file("quest_rescore8") == "selection_overlap_quest_rescore8.json"


def test_bench_decode_quick_smoke(tmp_path):
    st = decode_lib.Settings(configs=("c2", "d"), probe_steps=0)
    res = decode_lib.run(str(tmp_path), quick=True, batches=[2], settings=st, prefill=(),
                         overlap_target=0.7, plot=False)
    case = res["cases"][0]
    assert "error" not in case, case
    got = {r["config"]: r for r in case["results"]}
    assert set(got) == {"c2", "d"}
    assert got["d"]["hit_rate"] == 0 and got["c2"]["hit_rate"] > 0
    assert all(r["tokens_per_s"] > 0 and set(r["split_ms"]) >= {"selector", "fetch", "rest"}
               for r in got.values())
    assert res["targets"]["no_recompilation_within_bucket"] is True
    assert os.path.exists(tmp_path / "bench_decode.json")
    for k in ("device", "date", "commit", "jax_version"):
        assert res[k]


@pytest.mark.gpu
def test_gpu_fill_and_decode_host_equals_resident():
    """Pallas kernels on the GPU (bf16, 16-token pages, several fill chunks per sequence)."""
    cfg = configs.tiny(dtype="bfloat16", num_heads=8, num_kv_heads=2, head_dim=64)
    params = llama.init_params(cfg, seed=0)

    def mk(mode, **kw):
        cache = CacheConfig(mode=mode, selector="quest", page_size=16, selected_pages=8,
                            round_steps=8, **kw)
        return engine.Plan(model=cfg, cache=cache, batch=2, prompt_len=4096, max_context=4096,
                           num_stop=4)

    host, res = mk("host", pool_pages=40), mk("resident")
    lengths = [3001, 4000]
    synth = synthetic.Synthetic(salience=0.3)
    hs = synthetic.build_state(host, lengths, synth=synth, seed=SEED,
                               chunk_bytes=64 * host.spec.page_bytes)
    rs = synthetic.build_state(res, lengths, synth=synth, seed=SEED)
    np.testing.assert_array_equal(np.asarray(hs.kv.host_kv.astype(jnp.float32)),
                                  np.asarray(rs.kv.pool.astype(jnp.float32)))
    for x, y in zip(hs.summaries, rs.summaries):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                      np.asarray(y.astype(jnp.float32)))
    sampling, stop = Sampling.make(), jnp.full((4,), -1, jnp.int32)
    hs, th, _ = engine.decode_round(host, params, hs, sampling, stop, jnp.int32(100))
    rs, tr, _ = engine.decode_round(res, params, rs, sampling, stop, jnp.int32(100))
    np.testing.assert_array_equal(np.asarray(th), np.asarray(tr))
    c = hs.kv.counters.as_dict(host.spec)
    assert c["misses"] > 0 and c["hits"] > 0


@pytest.mark.gpu
def test_gpu_bench_decode_quick(tmp_path):
    """The whole benchmark path (fills, calibration, probe, a-d, splits, prefill) at tiny size."""
    res = decode_lib.run(str(tmp_path), quick=True, overlap_target=0.8, plot=False)
    assert all("error" not in c for c in res["cases"]), res["cases"]
    assert all("error" not in p for p in res["prefill"]), res["prefill"]
    got = {r["config"] for r in res["cases"][0]["results"]}
    assert got == {"a", "b", "c1", "c2", "c4", "d"}
    assert res["targets"]["no_recompilation_within_bucket"] is True


def test_probe_host_capacity_runs_tiny(tmp_path):
    """benchmarks/probes/probe_host_capacity.py (the GPU probe for host tiers larger than the free
    device memory) runs its stages on the tiny model, so the script stays working off the GPU."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.probes import probe_host_capacity

    rec = probe_host_capacity.main(["--tiny", "--out", str(tmp_path)])
    assert [r["stage"] for r in rec["stages"]] == ["alloc_prog", "fill_prog", "variants", "fill",
                                                  "decode", "generate"]
    assert all(r["ok"] for r in rec["stages"]), rec["stages"]
    assert "temp_size_in_bytes" in rec["stages"][1]["memory_analysis"]
    assert (tmp_path / "hlo" / "fill_chunk.txt").exists()
    assert (tmp_path / "probe_host_capacity_tiny.json").exists()
