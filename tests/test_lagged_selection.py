"""Lagged selection (CacheConfig.selection_lag=1): each step attends to the pages chosen with
the previous token's queries, plus its own page (CPU, tiny model)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, Sampling, engine, selectors
from jaxkv.api import make_plan
from jaxkv.models import configs, llama
from jaxkv.kernels import quest

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng(4321)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (37, 21, 50)]
NEW = 10
BASE = dict(selector="quest", page_size=4, selected_pages=4)


def _gen(cache, cfg=CFG, params=PARAMS, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return jaxkv.generate(cfg, params, PROMPTS, cache=cache, stop_tokens=[], **kw)


def test_config_checks():
    with pytest.raises(ValueError, match="selection_lag"):
        CacheConfig(selection_lag=2)
    with pytest.raises(ValueError, match="selection_lag"):
        CacheConfig(selection_lag=True)
    with pytest.raises(ValueError, match="needs a scored selector"):
        CacheConfig(selector="dense", selection_lag=1)


@pytest.mark.parametrize("mode", ["resident", "host"])
def test_lag_changes_nothing_when_every_page_is_selected(mode):
    """k >= the pages of the context: the previous query selects every page up to the new
    token's, as the exact selection does, so the tokens are the same."""
    # the context holds <= 50 + 10 tokens: 15 pages
    every = dict(selector="quest", page_size=4, selected_pages=64)
    exact = _gen(CacheConfig(mode="resident", **every))
    lagged = _gen(CacheConfig(mode=mode, selection_lag=1, **every))
    assert lagged.tokens == exact.tokens


@pytest.mark.parametrize("cache", [
    dict(mode="host"),
    dict(mode="host", schedule="step", pool_pages=6),
    dict(mode="host", schedule="scratch", pool_pages=6),
    dict(mode="host", schedule="layer"),
    dict(mode="host", dense_layers=1),
], ids=["step", "step-small-pool", "scratch-small-pool", "layer", "dense-first-layer"])
def test_lagged_host_equals_lagged_resident(cache):
    dense = {"dense_layers": cache["dense_layers"]} if "dense_layers" in cache else {}
    resident = _gen(CacheConfig(mode="resident", selection_lag=1, **BASE, **dense))
    host = _gen(CacheConfig(selection_lag=1, **BASE, **cache))
    assert host.tokens == resident.tokens
    assert host.stats["dropped"] == 0 and host.stats["misses"] > 0
    assert host.stats["selection_lag"] == resident.stats["selection_lag"] == 1


def test_pool_only_reads_needs_room_for_every_request():
    """Attention drops its host operand only where no page can be dropped: the default pool
    (requests + pinned pages per layer) or larger."""
    kw = dict(model=CFG, batch=3, prompt_len=64, max_context=128, num_stop=1)
    cache = CacheConfig(mode="host", selection_lag=1, **BASE)
    plan = engine.Plan(cache=cache, **kw)
    assert engine.pool_only_reads(plan)
    need = plan.requests_per_layer + plan.batch * plan.num_pinned
    assert plan.spec.num_slots == need
    assert not engine.pool_only_reads(engine.Plan(
        cache=dataclasses.replace(cache, pool_pages=need - 1), **kw))


def test_pool_only_attention_counts_what_it_leaves_out(monkeypatch):
    """Were the pool-only bound wrong (forced here with a 6-slot pool), the pages attention
    could not read would be counted as dropped, and generate() warns about them."""
    from jaxkv import residency
    monkeypatch.setattr(residency, "pool_only_reads", lambda plan: True)  # a wrong bound
    cache = CacheConfig(mode="host", selection_lag=1, pool_pages=6, round_steps=7, **BASE)
    with pytest.warns(RuntimeWarning, match="dropped"):
        out = _gen(cache)  # round_steps of its own: a plan no other test has compiled
    engine._round_fn.cache_clear()
    assert out.stats["dropped"] > 0 and out.stats["host_reads"] == 0


@pytest.mark.parametrize("pool", [None, 6], ids=["default-pool", "small-pool"])
def test_install_of_the_steps_own_pages(pool):
    """Lagged selection: the step start installs the pages the step attends to. The tokens of
    the resident cache; with the default pool no page is read over PCIe (attention takes no
    host operand, engine.pool_only_reads), with a smaller one the overflow is read in place."""
    cache = CacheConfig(mode="host", selection_lag=1, pool_pages=pool, **BASE)
    resident = _gen(CacheConfig(mode="resident", selection_lag=1, **BASE))
    ahead = _gen(cache)
    assert ahead.tokens == resident.tokens
    # misses: entries not resident when the step starts (before its install)
    assert ahead.stats["misses"] > 0
    if pool is None:
        assert ahead.stats["host_reads"] == ahead.stats["overflow"] == 0
        assert ahead.stats["pages_fetched"] > 0
    else:
        assert ahead.stats["host_reads"] > 0 and ahead.stats["overflow"] > 0


@selectors.register
class _QuestPerLayer(selectors.get("quest").__class__):
    """Quest with lagged selection inside the layer loop (a test-only selector)."""
    name = "_test_quest_per_layer"
    selects_all_layers = False


def test_per_layer_and_batched_lagged_quest_agree():
    """Quest's lagged selection for all layers at once after the layer loop gives the tokens
    of the per-layer form inside the loop."""
    cache = CacheConfig(mode="host", selection_lag=1, round_steps=4, **BASE)
    batched = _gen(cache)
    per_layer = _gen(dataclasses.replace(cache, selector=_QuestPerLayer.name))
    assert per_layer.tokens == batched.tokens


def test_lagged_indexer_host_equals_resident():
    cfg = configs.with_indexer(CFG, heads=4, dim=16)
    params = llama.init_params(cfg, seed=3)
    base = dict(selector="indexer", page_size=4, selected_pages=3, selection_lag=1)
    runs = [_gen(CacheConfig(mode=m, **base), cfg, params) for m in ("resident", "host")]
    assert runs[0].tokens == runs[1].tokens
    exact = _gen(CacheConfig(mode="resident", **dict(base, selection_lag=0)), cfg, params)
    assert exact.tokens != runs[0].tokens  # k = 3 of up to 15 pages: the lag shows


def _prefill(plan, tokens, lengths):
    kv, summ = engine.init_kv(plan), engine.init_summaries(plan)
    x = engine.embed_prompt(plan, PARAMS, tokens)
    for layer in range(CFG.num_layers):
        x, kv, summ, _ = engine.prefill_layer(plan, PARAMS["layers"][layer], jnp.int32(layer),
                                              x, lengths, kv, summ)
    return kv, summ


def _layer0_query(tokens, positions):
    """Layer 0's queries [B, T, Hq, D] (they depend on the tokens only, not on attention)."""
    x = llama.embed(PARAMS, CFG, tokens)
    return llama.attention_inputs(PARAMS["layers"][0], CFG, x, positions)[1]


def test_pages_are_chosen_one_step_ahead():
    """Layer 0 (its query needs no attention output): after the prefill, ``ahead`` holds what
    the prompt's last query selects for position ``length``; after one decode step, what the
    step's query selects for the next position, on the updated summaries."""
    cache = CacheConfig(mode="resident", selection_lag=1, round_steps=1, **BASE)
    lens = [len(p) for p in PROMPTS]
    plan = make_plan(CFG, cache, lens, NEW, num_stop=1)
    tokens = np.zeros((len(lens), plan.prompt_len), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    lengths = jnp.asarray(lens, jnp.int32)
    kv, summ = _prefill(plan, jnp.asarray(tokens), lengths)
    sel = dict(k=plan.k, page_size=4, num_sink_pages=cache.sink_pages)
    pos = jnp.broadcast_to(jnp.arange(plan.prompt_len, dtype=jnp.int32), tokens.shape)
    q = _layer0_query(jnp.asarray(tokens), pos)
    q_last = q[jnp.arange(len(lens)), lengths - 1]
    want = quest.quest_select(q_last, summ[0], summ[1], 0, lengths + 1, **sel)
    np.testing.assert_array_equal(np.asarray(summ[2][0]), np.asarray(want))
    cur = np.asarray(lengths) // 4
    assert all(c in row for c, rows in zip(cur, np.asarray(want)) for row in rows)

    first = jnp.asarray([5, 6, 7], jnp.int32)
    st = engine.start_state(plan, kv, summ, np.asarray(lengths), np.asarray(first),
                            jax.random.key(0))  # copies: the state is donated
    st, toks, steps = engine.decode_round(plan, PARAMS, st, Sampling.make(),
                                          jnp.full((1,), -1, jnp.int32), jnp.int32(NEW))
    assert int(steps) == 1
    q1 = _layer0_query(first[:, None], lengths[:, None])[:, 0]
    kmax, kmin, ahead = st.summaries
    want1 = quest.quest_select(q1, kmax, kmin, 0, lengths + 2, **sel)
    np.testing.assert_array_equal(np.asarray(ahead[0]), np.asarray(want1))
    nxt = (np.asarray(lengths) + 1) // 4
    assert all(c in row for c, rows in zip(nxt, np.asarray(want1)) for row in rows)


@pytest.mark.gpu
def test_gpu_lagged_host_equals_resident_and_full_selection_equals_exact():
    """The Pallas kernels: lagged host tier (per-layer selection, churning pool) == lagged
    resident (all layers at once); selecting every page, lagged == exact."""
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2, num_layers=3)
    params = llama.init_params(cfg, seed=0)
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (300, 170, 513)]
    kw = dict(max_new_tokens=24, stop_tokens=[])
    base = CacheConfig(selector="quest", page_size=16, selected_pages=6, selection_lag=1)
    res = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(base, mode="resident"),
                         **kw)
    host = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
        base, mode="host", pool_pages=3 * (2 * 6 + 2), strict=True), **kw)
    assert host.tokens == res.tokens and host.stats["misses"] > 0
    every = dataclasses.replace(base, mode="resident", selected_pages=64)  # >= 34 pages
    lagged = jaxkv.generate(cfg, params, prompts, cache=every, **kw)
    exact = jaxkv.generate(cfg, params, prompts,
                           cache=dataclasses.replace(every, selection_lag=0), **kw)
    assert lagged.tokens == exact.tokens
