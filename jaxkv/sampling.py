"""Token sampling with traced parameters: greedy, temperature, top-k, top-p, min-p."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.config import Sampling


def per_request(key, batch: int):
    """Per-request keys [batch]: ``key`` itself when it already is one key per request, else
    (one key) ``fold_in(key, b)`` for request b."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise TypeError("sampling keys are typed PRNG keys (jax.random.key(seed)), got an array "
                        f"of {key.dtype} {key.shape}: wrap a raw key with jax.random.wrap_key_data")
    if key.ndim == 1:
        return key
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch, dtype=jnp.uint32))


def split(keys):
    """Per-request keys [B] -> (next keys [B], keys for this draw [B])."""
    both = jax.vmap(jax.random.split)(keys)
    return both[:, 0], both[:, 1]


def _categorical(keys, logits):
    """One draw per row, each with its request's key: keys [B], logits [B, V] -> [B]. A row's
    draw depends on its key and its logits only, never on the other rows."""
    return jax.vmap(jax.random.categorical)(keys, logits)


def _sample_filtered(logits, s: Sampling, key):
    """Temperature + top-k + top-p + min-p sampling. logits [B, V] f32 -> [B] int32."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(s.temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)                       # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V, dtype=jnp.int32)
    keep = (s.top_k <= 0) | (rank < s.top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                 # mass strictly before rank
    keep &= (before < s.top_p) | (rank == 0)
    # min-p: against the most likely token's probability (rank 0) of the tempered softmax
    full = jax.nn.softmax(sorted_logits, axis=-1)
    keep &= (full >= s.min_p * full[:, :1]) | (rank == 0)
    choice = _categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sample_plain(logits, s: Sampling, key):
    """Temperature sampling without top-k / top-p: no sort. logits [B, V] f32 -> [B] int32."""
    scaled = logits / jnp.maximum(s.temperature, 1e-6)
    return _categorical(key, scaled).astype(jnp.int32)


def sample(logits, s: Sampling, key):
    """Next tokens. logits [B, V] float32, ``key`` one PRNG key per request [B] (or one key:
    :func:`per_request`) -> [B] int32. Each request draws with its own key, so its tokens do
    not depend on the batch it is in.

    temperature == 0 is greedy (argmax); top_k == 0, top_p == 1 and min_p == 0 sample from the tempered
    softmax directly; otherwise the vocabulary is sorted once for the filters. The choice is
    one ``lax.switch`` on traced values, so switching modes never recompiles (and the sort,
    0.37 ms per step at 8 x 152k logits on the H200 (docs/decisions.md), runs only when a
    filter is on).
    """
    key = per_request(key, logits.shape[0])
    filtered = (s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0)
    branch = jnp.where(s.temperature > 0, jnp.where(filtered, 2, 1), 0)
    return jax.lax.switch(branch, [
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        lambda: _sample_plain(logits, s, key),
        lambda: _sample_filtered(logits, s, key),
    ])


def agree(tok, axis_name):
    """Tensor parallelism: every device takes the first device's tokens [B]. The devices
    compute identical logits and sample with the same key; this makes agreement (and so the
    shared while-loop condition) certain at the cost of one [B] int32 all-reduce."""
    if axis_name is None:
        return tok
    first = jax.lax.axis_index(axis_name) == 0
    return jax.lax.psum(jnp.where(first, tok, jnp.zeros_like(tok)), axis_name)
