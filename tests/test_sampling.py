"""The sampler: greedy, plain temperature sampling (no sort) and the top-k / top-p filters,
checked against their definitions on random logits (fresh seeds)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import Sampling
from jaxkv.sampling import sample

N = 4000  # draws per distribution check


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def draws(logits, s, n=N, seed=0):
    """n samples for each row: [n, B]."""
    keys = jax.random.split(jax.random.key(seed), n)
    return np.asarray(jax.jit(jax.vmap(lambda k: sample(logits, s, k)))(keys))


def test_greedy_is_argmax(rng):
    logits = jnp.asarray(rng.standard_normal((3, 50)), jnp.float32)
    got = sample(logits, Sampling.make(), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_plain_sampling_matches_tempered_softmax(rng, temperature):
    V = 8
    logits = jnp.asarray(rng.standard_normal((2, V)) * 1.5, jnp.float32)
    got = draws(logits, Sampling.make(temperature=temperature))
    p = np.asarray(jax.nn.softmax(logits / temperature, axis=-1))
    for b in range(2):
        freq = np.bincount(got[:, b], minlength=V) / N
        # 5 sigma of a binomial proportion: a wrong distribution fails, noise does not
        np.testing.assert_array_less(np.abs(freq - p[b]), 5 * np.sqrt(p[b] * (1 - p[b]) / N) + 1e-3)


def test_top_k_keeps_the_k_largest(rng):
    logits = jnp.asarray(rng.standard_normal((2, 30)), jnp.float32)
    got = draws(logits, Sampling.make(temperature=3.0, top_k=4), n=500)
    top = np.argsort(-np.asarray(logits), -1)[:, :4]
    for b in range(2):
        assert set(got[:, b].tolist()) <= set(top[b].tolist())
        assert len(set(got[:, b].tolist())) > 1  # it samples, it is not greedy


def test_top_p_keeps_the_nucleus(rng):
    logits = jnp.asarray(rng.standard_normal((2, 30)) * 2, jnp.float32)
    top_p = 0.6
    got = draws(logits, Sampling.make(temperature=1.0, top_p=top_p), n=500)
    p = np.asarray(jax.nn.softmax(logits, -1))
    for b in range(2):
        order = np.argsort(-p[b])
        before = np.cumsum(p[b][order]) - p[b][order]
        nucleus = set(order[(before < top_p) | (np.arange(30) == 0)].tolist())
        assert set(got[:, b].tolist()) <= nucleus


@pytest.mark.parametrize("s", [Sampling.make(temperature=1.0),
                               Sampling.make(temperature=1.0, top_k=5, top_p=0.9)],
                         ids=["plain", "filtered"])
def test_each_row_draws_with_its_own_key(rng, s):
    """Per-request keys [B]: a row's token depends on its key and logits only (the batch
    around it changes nothing); one key means fold_in(key, b) for row b."""
    logits = jnp.asarray(rng.standard_normal((4, 40)) * 2, jnp.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    got = np.asarray(sample(logits, s, keys))
    for b in range(4):
        assert int(sample(logits[b:b + 1], s, keys[b:b + 1])[0]) == got[b]
    key = keys[0]
    folded = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(4, dtype=jnp.uint32))
    np.testing.assert_array_equal(np.asarray(sample(logits, s, key)),
                                  np.asarray(sample(logits, s, folded)))


def test_switching_modes_does_not_recompile():
    logits = jnp.zeros((2, 16), jnp.float32)
    f = jax.jit(sample)
    f(logits, Sampling.make(), jax.random.key(0))
    n = f._cache_size()
    for s in (Sampling.make(temperature=1.0), Sampling.make(temperature=0.7, top_k=3),
              Sampling.make(temperature=1.0, top_p=0.5)):
        f(logits, s, jax.random.key(1))
    assert f._cache_size() == n


def test_min_p_keeps_tokens_near_the_most_likely(rng):
    logits = jnp.asarray(rng.standard_normal((2, 30)) * 2, jnp.float32)
    min_p = 0.3
    got = draws(logits, Sampling(temperature=1.0, min_p=min_p), n=500)
    p = np.asarray(jax.nn.softmax(logits, -1))
    for b in range(2):
        kept = set(np.nonzero(p[b] >= min_p * p[b].max())[0].tolist())
        assert set(got[:, b].tolist()) <= kept


def test_plain_constructor_is_traced_and_validated():
    s = Sampling(temperature=0.7, top_p=0.9)
    assert float(s.temperature) == pytest.approx(0.7) and float(s.top_p) == pytest.approx(0.9)
    assert int(s.top_k) == 0 and float(s.min_p) == 0.0
    leaves, tree = jax.tree.flatten(s)
    assert len(leaves) == 4 and isinstance(jax.tree.unflatten(tree, leaves), Sampling)
    f = jax.jit(sample)
    f(jnp.zeros((1, 8)), s, jax.random.key(0))
    n = f._cache_size()
    f(jnp.zeros((1, 8)), Sampling(temperature=1.2, min_p=0.1), jax.random.key(0))
    assert f._cache_size() == n  # new values, same program


@pytest.mark.parametrize("kw, exc, field", [
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature="0.7"), TypeError, "temperature"),
    (dict(temperature=None), TypeError, "temperature"),
    (dict(top_k=-3), ValueError, "top_k"),
    (dict(top_k=2.5), ValueError, "top_k"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_p=0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p="high"), TypeError, "top_p"),
    (dict(min_p=-0.5), ValueError, "min_p"),
    (dict(min_p=None), TypeError, "min_p"),
    (dict(temperature=1e39), ValueError, "temperature"),   # inf in float32
    (dict(top_p=1e-50), ValueError, "top_p"),              # 0 in float32
])
def test_bad_values_name_the_field(kw, exc, field):
    with pytest.raises(exc, match=rf"Sampling\.{field}"):
        Sampling(**kw)
