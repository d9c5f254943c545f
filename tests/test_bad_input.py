"""Bad input, second pass (issue 29): explicit pool sizes on a short context, NaN / Inf
params, seeds of any size, streams, strict mode's result, generate()'s keyword arguments,
and random arguments to generate() / CacheConfig (docs/failure_modes.md).

Every call that runs uses one plan (``RUN``, batch 1, a prompt of 33-64 tokens, up to 4 stop
ids), so the file compiles one prefill and one decode round; the rest fail before compiling.
The command line and the GGUF / tokenizer cases are in tests/test_validation.py (they use
its tiny GGUF writer).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import CacheConfig, Sampling, StrictModeError, api, validation
from jaxkv.models import configs, llama

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
PROMPT = list(np.random.default_rng(0).integers(3, CFG.vocab_size, 37))
# selected_pages 32 (the README's --budget 512 --page-size 16) over a 256-token context of
# 16 pages: the pool holds all of them, short of the 32 + 2 a long context would need
RUN = CacheConfig(page_size=16, selected_pages=32, pool_pages=16)


def run(prompts=(PROMPT,), cache=RUN, **kw):
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("stop_tokens", [])
    return jaxkv.generate(CFG, PARAMS, list(prompts) if isinstance(prompts, tuple) else prompts,
                          cache=cache, **kw)


# ------------------------------------------------------------------------------ pool_pages
def test_explicit_pool_pages_on_a_short_context_run():
    """An explicit pool_pages is clamped to the host tier and then only needs one request's
    pages of that context (it was refused: "raise pool_pages")."""
    want = run().tokens
    for pool in (96, 10**9):
        res = run(cache=dataclasses.replace(RUN, pool_pages=pool))
        assert res.tokens == want and res.stats["pool_pages"] == 16
    for pool in (16, 96, 10**9):     # the README's command line: quest, 32 pages of 16 tokens
        plan = api.make_plan(CFG, CacheConfig(selector="quest", page_size=16, selected_pages=32,
                                              pool_pages=pool, schedule="layer"), [60], 48, 4)
        assert plan.pool_pages == plan.pages_per_seq == 16
    # a pool below one request's pages of the context is still refused, with the fix
    with pytest.raises(ValueError, match=r"pool_pages \(15\) is smaller.*raise pool_pages to at least 16"):
        run(cache=dataclasses.replace(RUN, pool_pages=15))


def test_max_context_below_the_pinned_pages_names_max_context():
    with pytest.raises(ValueError, match=r"max_context \(16\) holds 1 page\(s\) of 16 tokens, fewer "
                                         r"than the 2 pinned pages.*raise max_context to at least 32"):
        run([PROMPT[:4]], cache=CacheConfig(page_size=16, max_context=16), max_new_tokens=4)
    # without max_context the context grows to hold them (page_size 256: two pages)
    plan = api.make_plan(CFG, CacheConfig(page_size=256, prefill_chunk=256), [5], 8, 4)
    assert plan.max_context == 512 and plan.pages_per_seq == 2


def test_impossible_sizes_fail_before_allocating():
    """On a CPU the RAM bounds the device memory check (it reports no figure of its own)."""
    with pytest.raises(ValueError, match=r"resident KV cache needs .* GiB of device memory is free"):
        run(cache=CacheConfig(mode="resident", page_size=16, max_context=2**40))
    # a round longer than the context runs no more steps: its buffer is clamped, not allocated
    plan = api.make_plan(CFG, dataclasses.replace(RUN, round_steps=2**40), [37], 8, 4)
    assert plan.cache.round_steps == plan.max_context == 256


def test_host_cap_message_names_the_backends_variable():
    with pytest.raises(ValueError, match=f"set {validation.HOST_LIMIT_OVERRIDE_ENV} "):
        validation.check_host_capacity(2**20, limit_bytes=2**10, backend="cpu")
    with pytest.raises(ValueError, match=f"set {validation.HOST_LIMIT_ENV} "):
        validation.check_host_capacity(2**20, limit_bytes=2**10, backend="gpu")


# ------------------------------------------------------------------------------ params
@pytest.mark.parametrize("where, value", [("final_norm", np.nan), ("layer1", np.inf)])
def test_params_with_nan_or_inf_fail_early(where, value):
    if where == "final_norm":
        params = dict(PARAMS, final_norm=PARAMS["final_norm"].at[3].set(value))
        match = r"params\['final_norm'\] holds NaN or Inf"
    else:
        lay = dict(PARAMS["layers"][1], w_down=PARAMS["layers"][1]["w_down"].at[0, 5].set(value))
        params = dict(PARAMS, layers=(PARAMS["layers"][0], lay) + tuple(PARAMS["layers"][2:]))
        match = r"params\['layers'\]\[1\]\['w_down'\] holds NaN or Inf"
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(CFG, params, [PROMPT], max_new_tokens=4, cache=RUN)
    validation.check_params_finite(PARAMS)


# ------------------------------------------------------------------------------ seeds
def test_seeds_of_any_size_give_distinct_keys():
    data = lambda seed: tuple(np.asarray(jax.random.key_data(api.prng_key(seed))).tolist())  # noqa: E731
    assert data(5) == tuple(np.asarray(jax.random.key_data(jax.random.key(5))).tolist())
    seeds = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64, 2**64 + 2**32, 10**40]
    assert len({data(s) for s in seeds}) == len(seeds)


def test_seed_2_to_the_32_does_not_alias_0():
    hot = Sampling.make(temperature=5.0)
    tok = {s: run(sampling=hot, seed=s).tokens[0] for s in (0, 2**32, 2**64 + 7)}
    assert tok[0] != tok[2**32] and tok[2**32] != tok[2**64 + 7]
    assert run(sampling=hot, seed=2**32).tokens[0] == tok[2**32]     # reproducible
    for seed in (-1, 1.5, "7", True):
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            run(seed=seed)


# ------------------------------------------------------------------------------ streams
def test_stream_resumes_after_break_and_result_says_when_ready():
    want = run().tokens[0]
    stream = run(stream=True)
    got = []
    for new in stream:
        got += new[0]
        break
    with pytest.raises(RuntimeError, match="the stream has not ended.*keep iterating"):
        stream.result
    for new in stream:   # resumes where the first loop stopped
        got += new[0]
    assert got == want == stream.result.tokens[0]
    assert list(stream) == [] and stream.result.tokens[0] == want   # ended: nothing more


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kw, exc, match", [
    (dict(temperature="0.7"), TypeError, r"temperature must be a number, got str '0.7': pass temperature=0.7"),
    (dict(temperature=None), TypeError, "temperature must be a number, got NoneType"),
    (dict(top_p="0.9"), TypeError, "top_p must be a number.*pass top_p=0.9"),
    (dict(top_k=99999999999), ValueError, r"top_k must be an int >= 0 and < 2\*\*31"),
    (dict(temperature=np.array([0.7, 0.2])), TypeError, "temperature must be a number.*per-request"),
    (dict(top_k=True), TypeError, "top_k must be a number"),
    (dict(top_k=2**70), ValueError, rf"top_k must be an int >= 0 and < 2\*\*31.*got {2**70}"),
    (dict(temperature=2**1100), ValueError, r"Sampling.temperature: 1358.* overflows float32"),
    (dict(min_p=-2**1100), ValueError, r"Sampling.min_p: -1358.* overflows float32"),
    (dict(top_k=np.array(2.0)), ValueError, "top_k must be an int >= 0.*got 2.0"),
    (dict(top_k=np.array(True)), TypeError, "top_k must be a number, got bool True"),
])
def test_sampling_make_names_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        Sampling.make(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=2**70), rf"Sampling.top_k: top_k must be an int >= 0 and < 2\*\*31.*got {2**70}"),
    (dict(temperature=2**1100), r"Sampling.temperature: 1358.* overflows float32"),
    (dict(top_p=np.array(2**1100, dtype=object)), r"Sampling.top_p: 1358.* overflows float32"),
])
def test_sampling_constructor_names_huge_ints(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)


def test_sampling_takes_0d_arrays_as_their_value():
    """0-d numpy / jax arrays are their scalar value, in Sampling.make as in Sampling(...),
    and in seed lists as in a seed."""
    arrays = dict(temperature=np.array(0.5), top_k=jnp.array(7), top_p=jnp.array(0.75),
                  min_p=np.array(0.25))
    plain = dict(temperature=0.5, top_k=7, top_p=0.75, min_p=0.25)
    assert repr(Sampling.make(**arrays)) == repr(Sampling(**arrays)) == repr(Sampling.make(**plain))
    assert np.array_equal(jax.random.key_data(api.request_keys([2**80, np.array(3)], 2)),
                          jax.random.key_data(api.request_keys([2**80, 3], 2)))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(stop_tokens=2), TypeError, r"stop_tokens must be a list of token ids, got int 2: pass \[2\]"),
    (dict(stop_tokens=2.0), TypeError, "stop_tokens must be a list of token ids, got float"),
    (dict(stop_tokens="2"), TypeError, "stop_tokens is text"),
    (dict(stop_tokens=np.array(2)), TypeError, r"stop_tokens must be a list .* got ndarray "
                                               r"array\(2\): pass \[2\]"),
    (dict(stop_tokens=jnp.array(2)), TypeError, r"stop_tokens must be a list .*: pass \[2\]"),
    (dict(stop_tokens=np.array(2.0)), TypeError, r"stop_tokens must be a list .* array\(2\.\)$"),
    (dict(stop_tokens=[[2]]), ValueError, r"stop_tokens must be a 1-D list .* at index 0: pass a flat"),
    (dict(stream=1), ValueError, r"stream must be False, True, 'round' or 'step', got 1$"),
    (dict(stream=None), ValueError, "stream must be False, True, 'round' or 'step', got None"),
    (dict(stream="tokens"), ValueError, "stream must be .* got 'tokens'"),
    (dict(stream=np.array([1, 2])), ValueError, r"stream must be .* got array\(\[1, 2\]\)"),
    (dict(progress="yes"), ValueError, r"progress must be None \(a bar .*\) or a bool, got 'yes'"),
    (dict(progress=1), ValueError, "progress must be None .* or a bool, got 1"),
])
def test_generate_keywords_name_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        run(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=jnp.array([0.7, 0.0])), "Sampling.temperature must be a number"),
    (dict(top_k="3"), "Sampling.top_k must be an int"),
    (dict(top_p=None), "Sampling.top_p must be a number"),
])
def test_sampling_constructor_names_the_field(kw, match):
    """Per-request arrays, text and None fail when the Sampling is built, naming the field."""
    with pytest.raises(TypeError, match=match):
        Sampling(**kw)


def test_jax_array_prompts_accepted_like_numpy():
    want = run().tokens
    assert run(jnp.asarray([PROMPT], jnp.int32)).tokens == want
    assert run(np.asarray([PROMPT], np.int64)).tokens == want
    assert run(stop_tokens=jnp.asarray([200])).stats["generated_tokens"] >= 1


def test_context_with_bad_prompts_or_deleted_arrays_fails_early():
    """With a context, bad prompts get the errors they get without one (not len() of an int
    or np.stack of nothing), and a context whose arrays were deleted is named, not JAX's
    "Array has been deleted" from inside the copy."""
    ctx = run(keep=True).context
    for prompts, exc, match in ((5, ValueError, "or a non-empty list of requests"),
                                ([], ValueError, "or a non-empty list of requests"),
                                ([[5, 6.5]], TypeError, r"prompt 0 holds a float \(6.5\)")):
        with pytest.raises(exc, match=match):
            run(prompts, context=ctx)
    for name in ("kv_pages", "summaries"):
        ctx = run(keep=True).context
        jax.tree.leaves(getattr(ctx, name))[0].delete()
        with pytest.raises(ValueError, match=rf"context: its {name} arrays have been deleted"):
            run([[5]], context=ctx)


# ------------------------------------------------------------------------------ strict mode
def test_strict_error_carries_the_result():
    err = StrictModeError("strict mode: x", result="r")
    assert isinstance(err, RuntimeError) and err.result == "r"
    with pytest.raises(StrictModeError, match="dropped.*in this exception's .result") as e:
        validation.check_strict(dict(dropped=1, pool_pages=4), result="the result")
    assert e.value.result == "the result"
    # the generate() path is covered by tests/test_validation.py::test_strict_dropped_counted_warned_and_raised


# ------------------------------------------------------------------------------ random arguments
ALLOWED = (ValueError, TypeError)
_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                    st.lists(st.integers(-2, 300), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(
    ["mode", "selector", "page_size", "selected_pages", "pool_pages", "sink_pages", "recent_pages",
     "max_context", "strict", "dtype", "prefill_chunk", "round_steps", "schedule",
     "selection_lag", "dense_layers", "reuse", "candidate_pages"]), _values, max_size=4),
    st.integers(1, 600))
def test_random_cache_configs_fail_early_or_plan(kw, new):
    """CacheConfig(...) and the plan of a call either hold or raise ValueError / TypeError."""
    try:
        cache = CacheConfig(**kw)
        plan = api.make_plan(CFG, cache, [len(PROMPT)], new, 4)
    except ALLOWED:
        return
    assert plan.max_context >= len(PROMPT) + new and plan.spec.num_slots >= 1


# valid values (every call with them shares RUN's programs: batch 1, prompts of 33-64
# tokens, at most 4 stop ids, a context of 256 tokens) and, per argument, junk
VALID = dict(prompt=st.lists(st.integers(3, 255), min_size=33, max_size=64),
             max_new_tokens=st.integers(1, 8), temperature=st.floats(0, 3),
             top_k=st.integers(0, 300), top_p=st.floats(0.05, 1),
             stop_tokens=st.lists(st.integers(0, 255), max_size=4), seed=st.integers(0, 2**80))
JUNK = dict(prompt=st.one_of(st.lists(st.integers(-1, 260), min_size=33, max_size=64),
                             st.lists(st.floats(), min_size=33, max_size=64), st.just([]),
                             st.none(), st.text(), st.integers(), st.floats()))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_generate_arguments_give_tokens_or_early_errors(data):
    """One argument at a time (or none) gets a random value of any type: each call returns
    valid tokens or raises ValueError / TypeError (never from inside JAX)."""
    bad = data.draw(st.sampled_from([None, *VALID]), label="junk argument")
    a = {k: data.draw(JUNK.get(k, _values) if k == bad else v, label=k) for k, v in VALID.items()}
    try:
        sampling = Sampling.make(a["temperature"], a["top_k"], a["top_p"])
        res = jaxkv.generate(CFG, PARAMS, [a["prompt"]], max_new_tokens=a["max_new_tokens"],
                             sampling=sampling, cache=RUN, stop_tokens=a["stop_tokens"],
                             seed=a["seed"])
    except ALLOWED:
        assert bad is not None, "valid arguments were refused"
        return
    (toks,) = res.tokens
    assert 1 <= len(toks) <= a["max_new_tokens"] and all(0 <= t < CFG.vocab_size for t in toks)
