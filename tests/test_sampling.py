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


def test_switching_modes_does_not_recompile():
    logits = jnp.zeros((2, 16), jnp.float32)
    f = jax.jit(sample)
    f(logits, Sampling.make(), jax.random.key(0))
    n = f._cache_size()
    for s in (Sampling.make(temperature=1.0), Sampling.make(temperature=0.7, top_k=3),
              Sampling.make(temperature=1.0, top_p=0.5)):
        f(logits, s, jax.random.key(1))
    assert f._cache_size() == n
