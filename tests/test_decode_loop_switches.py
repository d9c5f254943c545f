"""Trace-time switches of the decode loop that must not change a token (CPU, tiny model).

* ``engine.STEPS_PER_ITERATION``: several decode steps per iteration of the round's while
  loop; the steps past the round's end or after every request finished are no-ops, so the
  tokens, the random stream and the lagged pages are those of one step per iteration.
* ``engine.INSTALL_AFTER_LAYERS``: the "step" schedule's install of the previous step's pages
  after the first sparse layers instead of at the step start.
"""
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, Sampling, engine
from models import configs, llama

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng(77)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (29, 44, 13)]


def _gen(monkeypatch, steps, cache, install_after=0, **kw):
    monkeypatch.setattr(engine, "STEPS_PER_ITERATION", steps)
    monkeypatch.setattr(engine, "INSTALL_AFTER_LAYERS", install_after)
    engine._round_fn.cache_clear()  # the switches are read when a round is traced
    kw.setdefault("max_new_tokens", 11)
    kw.setdefault("stop_tokens", [])
    return jaxkv.generate(CFG, PARAMS, PROMPTS, cache=cache, **kw)


@pytest.mark.parametrize("cache", [
    dict(mode="resident"),
    dict(mode="host", pool_pages=6),
    dict(mode="host", selection_lag=1, pool_pages=6),
    dict(mode="resident", selection_lag=1),
    dict(mode="host", schedule="scratch", pool_pages=6),
], ids=["resident", "host", "host-lagged", "resident-lagged", "scratch"])
def test_steps_per_iteration_keep_the_tokens(monkeypatch, cache):
    """round_steps 5 with 2 or 3 steps per iteration: rounds end on a no-op step past the
    round's end, and the next round continues from it (sampled at temperature 1, so a moved
    random key would show)."""
    cc = CacheConfig(page_size=4, selected_pages=3, round_steps=5, **cache)
    sampling = Sampling.make(temperature=1.0)
    ref = _gen(monkeypatch, 1, cc, sampling=sampling, seed=3)
    for steps in (2, 3):
        got = _gen(monkeypatch, steps, cc, sampling=sampling, seed=3)
        assert got.tokens == ref.tokens, steps
        assert got.stats["dropped"] == ref.stats["dropped"] == 0


def test_steps_after_every_request_stopped(monkeypatch):
    """Requests stop on a stop token mid-iteration: the following steps of the iteration are
    no-ops (no token, no length change)."""
    cc = CacheConfig(mode="host", page_size=4, selected_pages=3, round_steps=8, pool_pages=6)
    ref = _gen(monkeypatch, 1, cc, max_new_tokens=12)
    stop = [ref.tokens[0][3], ref.tokens[1][5]]
    ref = _gen(monkeypatch, 1, cc, max_new_tokens=12, stop_tokens=stop)
    got = _gen(monkeypatch, 4, cc, max_new_tokens=12, stop_tokens=stop)
    assert got.tokens == ref.tokens
    assert [len(t) for t in got.tokens] == [len(t) for t in ref.tokens]


@pytest.mark.parametrize("cache", [
    dict(),
    dict(selection_lag=1),
    dict(dense_layers=1),
], ids=["exact", "lagged", "dense-first-layer"])
def test_install_after_the_first_layers(monkeypatch, cache):
    """A pool that churns (6 slots per layer): installing after layer 1 or after every layer
    gives the tokens of the resident cache; the first layers then miss the pages the previous
    step missed, so hits + misses stay equal and the misses do not fall."""
    base = dict(page_size=4, selected_pages=3, round_steps=4, **cache)
    resident = _gen(monkeypatch, 1, CacheConfig(mode="resident", **base))
    host = CacheConfig(mode="host", pool_pages=6, **base)
    start = _gen(monkeypatch, 1, host)
    assert start.tokens == resident.tokens
    for after in (1, 2):
        got = _gen(monkeypatch, 1, host, install_after=after)
        assert got.tokens == resident.tokens, after
        s, g = start.stats, got.stats
        assert g["hits"] + g["misses"] == s["hits"] + s["misses"], after
        assert g["misses"] >= s["misses"] and g["dropped"] == 0, after
        assert g["tokens_written"] == s["tokens_written"], after


def test_install_after_layers_needs_the_step_schedule(monkeypatch):
    """The "scratch" schedule installs from scratch rows its layers overwrite: it keeps the
    install at the step start (and its tokens)."""
    monkeypatch.setattr(engine, "INSTALL_AFTER_LAYERS", 1)
    plan = engine.Plan(model=CFG, batch=2, prompt_len=64, max_context=128, num_stop=1,
                       cache=CacheConfig(mode="host", schedule="scratch", page_size=4,
                                         selected_pages=3))
    assert engine.install_after_layers(plan) == 0
    plan = engine.Plan(model=CFG, batch=2, prompt_len=64, max_context=128, num_stop=1,
                       cache=CacheConfig(mode="host", page_size=4, selected_pages=3))
    assert engine.install_after_layers(plan) == 1
