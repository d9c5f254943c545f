"""Whole decode rounds, prefill layers and continued-turn layers lowered for an (abstract) H200
on the CPU, with jaxkv building for the GPU (:mod:`jaxkv.lowering`): every configuration the
engine can build goes through the Pallas -> Triton lowering as the GPU would take it, also where
no GPU test runs it. At the benchmark shapes (8B-like B=1 and Qwen-like B=8 at 128k) the state
is abstract (``jaxkv.state.abstract_state``), so the Triton limits are checked at full size.

What this does not check: Triton -> PTX compilation, XLA:GPU's passes, cuDNN's prefill
attention (the prefill lowers with the Pallas kernel here: no cuDNN on the CPU) and anything at
run time (the GPU tests, ``-m gpu``, through the device tool)."""
import dataclasses

import jax
import pytest

from jaxkv import CacheConfig, Tuning, engine, lowering, validation
from jaxkv.api import make_plan
from jaxkv.models import configs, llama

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TRITON = lowering.TRITON_CALL
LENS = [1000, 700]  # past the two-stage selector's 32 candidate pages of 16 tokens

ROUNDS = {
    "host_quest": dict(mode="host", selector="quest"),
    "host_quest_lag": dict(mode="host", selector="quest", selection_lag=1),
    "resident_quest": dict(mode="resident", selector="quest"),
    "host_dense": dict(mode="host", selector="dense"),
    "resident_dense": dict(mode="resident", selector="dense"),
    "host_indexer_lag": dict(mode="host", selector="indexer", selection_lag=1),
    "resident_oracle": dict(mode="resident", selector="oracle"),
    "host_rescore8": dict(mode="host", selector="quest_rescore8"),
    "host_rescore8_lag": dict(mode="host", selector="quest_rescore8", selection_lag=1),
    "resident_rescore8_block2": dict(mode="resident", selector="quest_rescore8",
                                     candidate_block=2),
    "host_rescore8_block4": dict(mode="host", selector="quest_rescore8", candidate_block=4),
    "host_rescore8_radix": dict(mode="host", selector="quest_rescore8",
                                tuning=Tuning(topk_method="radix")),
    "host_rescore8_topk_pallas": dict(mode="host", selector="quest_rescore8",
                                      tuning=Tuning(topk_method="pallas")),
    "host_rescore_xla": dict(mode="host", selector="quest_rescore",
                             tuning=Tuning(rescore_method="xla", rescore_select_method="xla")),
    "host_rescore8_int8": dict(mode="host", selector="quest_rescore8", kv_dtype="int8"),
    "host_quest_fp8_shift_dense0": dict(mode="host", selector="quest",
                                        kv_dtype="float8_e4m3fn", kv_key_shift=True,
                                        dense_layers=(0,)),
    "host_quest_scratch": dict(mode="host", selector="quest", schedule="scratch"),
    "host_quest_layer": dict(mode="host", selector="quest", schedule="layer"),
    "host_quest_small_pool": dict(mode="host", selector="quest", pool_pages=12),
}
PREFILLS = ("host_quest", "host_rescore8_int8", "host_indexer_lag",
            "host_quest_fp8_shift_dense0", "resident_rescore8_block2")


def _model(selector):
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_kv_heads=2, num_heads=8)
    return configs.with_indexer(cfg) if selector == "indexer" else cfg


@pytest.fixture(scope="module")
def params():
    return {s: llama.init_params(_model(s), seed=0) for s in ("quest", "indexer")}


def _plan(kw):
    return make_plan(_model(kw["selector"]), CacheConfig(page_size=16, selected_pages=4, **kw),
                     LENS, 8, num_stop=4)


def _params(params, kw):
    return params["indexer" if kw["selector"] == "indexer" else "quest"]


@pytest.mark.parametrize("name", sorted(ROUNDS))
def test_round_lowers_for_h200(params, name):
    kw = ROUNDS[name]
    with lowering.gpu_target():
        plan = _plan(kw)
        txt = lowering.lower_round(plan, _params(params, kw), engine.abstract_state(plan, LENS))
    assert txt.count(TRITON) >= plan.model.num_layers  # at least attention, every layer
    assert ('"pinned_host"' in txt) == (kw["mode"] == "host")


@pytest.mark.parametrize("name", PREFILLS)
@pytest.mark.parametrize("extend", [False, True], ids=["prefill", "extend"])
def test_prefill_layer_lowers_for_h200(params, name, extend):
    kw = ROUNDS[name]
    with lowering.gpu_target():
        plan = _plan(kw)
        st = engine.abstract_state(plan, LENS)
        txt = lowering.lower_prefill(plan, _params(params, kw)["layers"][0], st.kv,
                                     st.summaries, st.dense, extend=extend,
                                     tokens=64 if extend else None)
    assert TRITON in txt


def test_count_calls_follows_the_call_graph():
    """A jitted function used three times lowers once, as a private function (its symbol
    quoted) with three calls: ``count_calls`` counts its operations three times."""
    import jax.numpy as jnp
    inner = jax.jit(lambda x: jnp.sin(x))
    txt = lowering.lower(lambda x: inner(inner(inner(x))) + jnp.sin(x),
                         jax.ShapeDtypeStruct((4,), jnp.float32))
    assert txt.count("stablehlo.sine") == 2
    assert lowering.count_calls(txt, "stablehlo.sine") == 4
    assert lowering.count_calls("no functions: stablehlo.sine", "stablehlo.sine") == 1


@pytest.mark.parametrize("shape,batch,mode,changes,kernels", [
    ("8b", 1, "host", dict(selector="quest_rescore8"), 3),
    ("8b", 1, "host", dict(selector="quest_rescore8", candidate_block=4), 3),
    ("qwen1.5b", 8, "host", dict(selector="quest_rescore8"), 4),
    ("qwen1.5b", 8, "host", dict(selector="quest_rescore8", page_size=16, selected_pages=64), 4),
], ids=["8b_b1", "8b_b1_block4", "qwen_b8", "qwen_b8_page16"])
def test_benchmark_round_lowers_at_full_size(shape, batch, mode, changes, kernels):
    """The GPU benchmarks' shapes at 128k, 1024 tokens (``benchmarks/ab_step.py``): a 16 GiB
    (8B-like) / 14 GiB (Qwen-like B=8) host tier that exists only as a shape. Per layer at
    least the scores, second stage and attention kernels, and at Qwen-like B=8 the first
    stage's top-k kernel too (16 rows of 2048 pages in 2 pieces; of 8212 in 8 pieces in
    CacheConfig()'s 16-token pages; one program per piece, ``select_top_pieces``), counted
    along the call graph (``count_calls``: a jitted function lowers once and is called per
    layer)."""
    import decode_lib as bd
    ctx = 131072
    with lowering.gpu_target():
        cfg = bd.model_config(shape)
        ps = 64 if shape == "qwen1.5b" else 16
        cache = dataclasses.replace(
            CacheConfig(mode=mode, page_size=ps, selected_pages=1024 // ps, round_steps=32,
                        max_context=ctx + 1024), **changes)
        plan = engine.Plan(model=cfg, batch=batch, prompt_len=ctx + 1024, cache=cache,
                           max_context=ctx + 1024, num_stop=4)
        state = engine.abstract_state(plan, [ctx] * batch)
        assert state.kv.host_kv.shape == plan.spec.host_shape
        txt = lowering.lower_round(plan, jax.eval_shape(lambda: llama.init_params(cfg, 0)),
                                   state)
    assert lowering.count_calls(txt) >= kernels * cfg.num_layers
    if shape == "qwen1.5b":
        assert lowering.count_calls(txt, 'name = "select_top_pieces"') == cfg.num_layers


@pytest.mark.parametrize("mode", ["host", "resident"])
def test_abstract_state_matches_the_built_one(mode):
    """``abstract_state``: the shapes, dtypes and memory spaces of ``start_state``'s leaves,
    and so the same bytes by memory space."""
    import jax.numpy as jnp
    cfg = configs.tiny()
    plan = make_plan(cfg, CacheConfig(page_size=4, selected_pages=4, mode=mode,
                                      selector="quest_rescore8"), [30, 17], 8, num_stop=4)
    built = engine.start_state(plan, engine.init_kv(plan), engine.init_summaries(plan), [30, 17],
                               jnp.zeros((2,), jnp.int32), jax.random.key(0),
                               dense=engine.init_dense(plan))
    abst = engine.abstract_state(plan, [30, 17])
    a, b = jax.tree.leaves(lowering.abstract(built)), jax.tree.leaves(abst)
    assert [(x.shape, x.dtype, x._memory_space) for x in a] == \
        [(x.shape, x.dtype, x._memory_space) for x in b]
    fp = validation.nbytes_by_space(abst)
    assert fp == validation.nbytes_by_space(built) and (fp["host"] > 0) == (mode == "host")
