"""The decode round is ONE compiled program with the host tier inside it.

CPU: the compiled module of a round has a while loop, takes the pinned_host array as a
parameter and returns it, and contains no copy of it. GPU (marker ``gpu``): the same on the
H200's compiled HLO, where a copy would be a real 'host array -> device' transfer.
"""
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheConfig, Sampling, Tuning, engine
from jaxkv.api import make_plan
from jaxkv.models import configs, llama


def _compiled_round(cfg, cache_cfg, prompt_lens, max_new=8):
    params = llama.init_params(cfg, seed=0)
    plan = make_plan(cfg, cache_cfg, prompt_lens, max_new, num_stop=4)
    state = engine.start_state(plan, engine.init_kv(plan), engine.init_summaries(plan),
                               prompt_lens, jnp.ones((plan.batch,), jnp.int32), jax.random.key(0))
    lowered = engine.lower_decode_round(plan, params, state, Sampling.make(),
                                        jnp.full((4,), -1, jnp.int32), jnp.int32(max_new))
    return plan, lowered.compile().as_text()


def _copies_of(hlo: str, shape) -> list[str]:
    dims = ",".join(str(d) for d in shape)
    pat = re.compile(r"\[" + re.escape(dims) + r"\]")
    return [l.strip()[:200] for l in hlo.splitlines()
            if pat.search(l) and re.search(r"\b(copy|copy-start|copy-done)\(", l)]


def _check(plan, hlo):
    assert " while(" in hlo or "while (" in hlo or re.search(r"\bwhile\b", hlo)
    assert not _copies_of(hlo, plan.spec.host_shape), _copies_of(hlo, plan.spec.host_shape)[:3]


def test_decode_round_is_one_program_cpu():
    cfg = configs.tiny()
    plan, hlo = _compiled_round(cfg, CacheConfig(mode="host", selector="quest", page_size=4,
                                                 selected_pages=4), [30, 17])
    _check(plan, hlo)
    # the host tier is an entry parameter of the one program (pinned host memory space S(5))
    dims = ",".join(str(d) for d in plan.spec.host_shape)
    assert re.search(r"\[" + dims + r"\][^\n]*S\(5\)", hlo) or "pinned_host" in hlo


@pytest.mark.parametrize("mode,selector,lens", [("host", "quest", [2000]),
                                                ("host", "quest", [300, 170]),
                                                ("resident", "quest", [2000]),
                                                ("resident", "dense", [2000])])
def test_cpu_round_copies_no_cache_array(mode, selector, lens):
    """CPU defaults (blocked attention, layers rolled with switched weights): no copy of the
    pool, the host tier or the Quest summaries anywhere in the round. (A view of the pool taken
    outside the attention's chunk loop, or the XLA Quest scores fused with the in-place
    summary update, each made XLA:CPU copy a whole array in every layer of every step; both
    show from about 2000 tokens, not at a few hundred.)"""
    cfg = configs.tiny(num_layers=3, max_position=4096)
    plan, hlo = _compiled_round(cfg, CacheConfig(mode=mode, selector=selector, page_size=16,
                                                 selected_pages=4), lens)
    shapes = [plan.spec.pool_shape, plan.spec.host_shape]
    shapes += [a.shape for a in jax.tree.leaves(engine.init_summaries(plan))]
    for shape in shapes:
        assert not _copies_of(hlo, shape), (shape, _copies_of(hlo, shape)[:3])

@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas"])
def test_decode_round_is_one_program_gpu(impl):
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_kv_heads=2, num_heads=8)
    plan, hlo = _compiled_round(cfg, CacheConfig(mode="host", selector="quest", page_size=16,
                                                 selected_pages=4, implementation=impl), [300, 170])
    _check(plan, hlo)
    dims = ",".join(str(d) for d in plan.spec.host_shape)
    assert re.search(r"\[" + dims + r"\][^\n]*S\(5\)", hlo)


@pytest.mark.gpu
def test_fused_quest_update_copies_no_summaries_gpu(monkeypatch):
    """With the chunk-maxima top-k (forced here at a small size) the Quest summaries are
    updated inside the scores kernel through an input/output alias: the compiled round must
    not copy the summaries (nor the host tier) to make that alias."""
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_kv_heads=2, num_heads=8)
    plan, hlo = _compiled_round(cfg, CacheConfig(mode="host", selector="quest", page_size=16,
                                                 selected_pages=4, implementation="pallas",
                                                 tuning=Tuning(topk_cmax_min_pages=1)),
                                [300, 170])
    _check(plan, hlo)
    summ = engine.init_summaries(plan)[0].shape
    assert "quest_update_quest_scores_cmax" in hlo
    assert not _copies_of(hlo, summ), _copies_of(hlo, summ)[:3]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["resident", "host"])
def test_lagged_quest_copies_no_summaries_gpu(monkeypatch, mode):
    """Lagged selection (Quest over all layers at once on the summaries viewed as
    [1, L * B, ...]) still updates the summaries in place: the compiled round copies neither
    them nor the KV cache, in both modes."""
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_kv_heads=2, num_heads=8)
    plan, hlo = _compiled_round(cfg, CacheConfig(mode=mode, selector="quest", page_size=16,
                                                 selected_pages=4, implementation="pallas",
                                                 selection_lag=1,
                                                 tuning=Tuning(topk_cmax_min_pages=1)),
                                [300, 170])
    _check(plan, hlo)
    summ = engine.init_summaries(plan)[0].shape
    assert "quest_update_quest_scores_cmax" in hlo
    assert not _copies_of(hlo, summ), _copies_of(hlo, summ)[:3]


def test_decode_round_is_one_program_lagged_cpu():
    cfg = configs.tiny()
    plan, hlo = _compiled_round(cfg, CacheConfig(mode="host", selector="quest", page_size=4,
                                                 selected_pages=4, selection_lag=1), [30, 17])
    _check(plan, hlo)


def _plan_with(tuning):
    return make_plan(configs.tiny(), CacheConfig(mode="resident", selector="quest", page_size=4,
                                                 selected_pages=4, tuning=tuning), [30], 8,
                     num_stop=4)


def test_round_compiler_options_defaults_and_override():
    """The round compiles with Tuning's XLA options: the default ones, or the plan's own."""
    default = Tuning().compiler_options
    assert engine.round_compiler_options(_plan_with(Tuning())) == dict(default)
    name = default[0][0]
    opts = ((name, "SERIALIZE"), ("xla_gpu_autotune_level", 0))
    got = engine.round_compiler_options(_plan_with(Tuning(compiler_options=opts)))
    assert got == {name: "SERIALIZE", "xla_gpu_autotune_level": 0}


def test_round_compiler_options_unknown_dropped():
    """An option this XLA does not know is left out with a warning, not an error."""
    default = Tuning().compiler_options
    plan = _plan_with(Tuning(compiler_options=(("xla_no_such_option_for_jaxkv", True),) + default))
    with pytest.warns(UserWarning, match="xla_no_such_option_for_jaxkv"):
        got = engine.round_compiler_options(plan)
    assert "xla_no_such_option_for_jaxkv" not in got
    assert got == dict(engine._accepted_options(default, jax.default_backend()))


def test_round_compiler_options_numpy_values_and_bad_types():
    """numpy scalars and 0-d arrays are their Python values (XLA rejects np.bool_(True), and
    a cached rejection would drop True as well); a value of another type is refused, naming
    the option."""
    opts = (("xla_cpu_enable_fast_math", np.bool_(False)), ("xla_gpu_autotune_level", np.int64(2)),
            ("xla_gpu_memory_limit_slop_factor", np.array(95)))
    t = Tuning(compiler_options=opts)
    assert t.compiler_options == (("xla_cpu_enable_fast_math", False),
                                  ("xla_gpu_autotune_level", 2),
                                  ("xla_gpu_memory_limit_slop_factor", 95))
    assert [type(v) for _, v in t.compiler_options] == [bool, int, int]
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # XLA takes all three
        assert engine.round_compiler_options(_plan_with(t)) == dict(t.compiler_options)
    for bad in ([1], {"a": 1}, None, np.array([1, 2])):
        with pytest.raises(ValueError, match="Tuning.compiler_options: the value of "
                                             "'xla_gpu_autotune_level' must be a str, bool, int "
                                             "or float"):
            Tuning(compiler_options=(("xla_gpu_autotune_level", bad),))


def _key_copy_round(implementation=None):
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_kv_heads=2, num_heads=8)
    plan, hlo = _compiled_round(cfg, CacheConfig(
        mode="host", selector="quest_rescore8", page_size=16, selected_pages=4,
        candidate_pages=16, implementation=implementation), [300, 170])
    _check(plan, hlo)
    for a in engine.init_summaries(plan)[2:]:   # the key copy and its scales
        assert not _copies_of(hlo, a.shape), (a.shape, _copies_of(hlo, a.shape)[:3])
    return hlo


def test_key_copy_store_copies_no_key_copy_cpu():
    """The two-stage selector's key copy is written in place: the round copies neither the
    copy nor its scales."""
    _key_copy_round()


@pytest.mark.gpu
def test_key_copy_store_copies_no_key_copy_gpu():
    """The same on the GPU's compiled HLO with the Pallas kernels, where a copy of the copy
    would cost GiBs at 128k in every layer."""
    _key_copy_round("pallas")
