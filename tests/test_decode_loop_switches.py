"""``engine.STEPS_PER_ITERATION``, a trace-time switch of the decode loop that must not change
a token (CPU, tiny model): several decode steps per iteration of the round's while loop; the
steps past the round's end or after every request finished are no-ops, so the tokens, the
random stream and the lagged pages are those of one step per iteration.
"""
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, Sampling, engine
from jaxkv.models import configs, llama

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng(77)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (29, 44, 13)]


def _gen(monkeypatch, steps, cache, **kw):
    monkeypatch.setattr(engine, "STEPS_PER_ITERATION", steps)
    engine._round_fn.cache_clear()  # the switch is read when a round is traced
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
