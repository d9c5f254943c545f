"""Tensor parallelism over KV heads (jaxkv.parallel, ``generate(mesh=...)``).

CPU: JAX fixes its device count at import, so the multi-device cases run in two concurrent
subprocesses with 4 virtual CPU devices (tests/parallel_cases.py) and the tests here check
their JSON results: N = 2 and 4 devices generate the single-device tokens token for token
(greedy and sampled; host tier and resident; Quest and dense; lagged selection; churning pool; schedules
"step" (host reads in attention), "scratch" and "layer"; XLA references and Pallas kernels in interpret mode), prefill logits,
host tiers and summaries agree within f32 tolerance, counters add up, the decode round over
the mesh is one program that never copies the host tier, bad meshes fail early.
GPU (marker ``gpu``, needs >= 2 GPUs): the same on the real kernels.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, parallel
from jaxkv.models import configs, llama

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "parallel_cases.py"
# two groups of about equal CPU time, run at once (2 cores)
GROUPS = (("host_quest", "host_churn", "sampled", "bad_mesh", "prefill", "one_program",
           "pallas"),
          ("resident_quest", "dense_layer_schedule", "bench_decode", "lagged", "fp8"))
COMPARE = ("host_quest", "host_churn", "sampled", "resident_quest", "dense_layer_schedule", "pallas",
           "lagged")
TOKENS = COMPARE + ("fp8",)   # fp8: the counters' byte rule below is float32's
CFG = configs.tiny(num_kv_heads=4, num_heads=8)   # as in parallel_cases.py


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               JAXKV_TEST_SEED=str(np.random.SeedSequence().entropy % 1000))
    procs = []
    for i, names in enumerate(GROUPS):
        out = d / f"g{i}.json"
        procs.append((out, subprocess.Popen([sys.executable, str(WORKER), str(out), *names],
                                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))
    res = {}
    for out, p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, log[-4000:]
        res.update(json.loads(out.read_text()))
    return res


@pytest.mark.parametrize("case", TOKENS)
def test_tokens_equal_single_device(results, case):
    r = results[case]
    base = r["1"]["tokens"]
    assert len(r) >= 2
    for n, run in r.items():
        assert run["tokens"] == base, (case, n, results["prompts"])
        assert run["stats"]["num_devices"] == int(n)


def _local_page_bytes(stats, n):
    # tiny f32: 2 (K, V) * H/n heads * page_size * head_dim * 4 bytes
    return 2 * (CFG.num_kv_heads // n) * stats["page_size"] * CFG.head_dim * 4


@pytest.mark.parametrize("case", COMPARE)
def test_counters_are_totals_and_consistent(results, case):
    r = results[case]
    one = r["1"]["stats"]
    for n, run in r.items():
        s, n = run["stats"], int(n)
        if n == 1:
            assert "per_device" not in s
            continue
        per = s["per_device"]
        for name, vals in per.items():
            assert len(vals) == n and sum(vals) == s[name], name
        # every device writes every new token (its heads' share of the row)
        assert per["tokens_written"] == [one["tokens_written"]] * n
        assert s["bytes_device_to_host"] == one["bytes_device_to_host"]
        assert s["dropped"] == 0 and s["truncated_requests"] == 0
        page = _local_page_bytes(s, n)     # a host read moves one KV head's part of a row
        assert s["bytes_host_to_device"] == (s["pages_fetched"] * page
                                             + s["host_reads"] * page // (CFG.num_kv_heads // n))
        assert s["generated_tokens"] == one["generated_tokens"]
        assert s["logical_kv_bytes"] == one["logical_kv_bytes"]
        assert s["host_kv_bytes"] == one["host_kv_bytes"]
        assert s["device_kv_bytes_per_device"] * n == s["device_kv_bytes"]
        if s["mode"] == "host" and case != "dense_layer_schedule":
            # per-step schedule: hits + misses count the selected (KV head, page) entries,
            # and each head lives on exactly one device
            assert s["hits"] + s["misses"] == one["hits"] + one["misses"]
            assert all(f <= m for f, m in zip(per["pages_fetched"], per["misses"]))
        if case == "dense_layer_schedule":
            assert s["misses"] > 0
        if case == "host_churn":
            assert s["evictions"] > 0 and s["overflow"] > 0


def test_prefill_logits_host_tier_and_summaries_agree(results):
    r = results["prefill"]
    assert r["argmax_equal"]
    assert r["logits_max_abs"] <= 2e-5 * max(1.0, r["logits_scale"])
    assert r["host_max_abs"] < 1e-5 and r["summary_max_abs"] < 1e-5
    assert r["summary_finite_equal"]
    assert r["host_memory_kind"] == "pinned_host"


def test_decode_round_is_one_program_over_the_mesh(results):
    r = results["one_program"]
    assert r["num_partitions"] == 4
    assert r["entry_whiles"] == 1                  # the decode loop; nothing runs outside it
    assert r["entry_all_reduces"] == 0 and r["all_reduces"] >= 3   # o_proj, down_proj, tokens
    assert r["host_copies"] == []
    assert r["host_param_pinned"] and r["host_kv_memory_kind"] == "pinned_host"


def test_bad_meshes_fail_early(results):
    r = results["bad_mesh"]
    assert r["three"].startswith("ValueError") and "num_kv_heads (4)" in r["three"]
    assert "1 / 2 / 4 devices" in r["three"]
    assert r["twice"].startswith("ValueError") and "twice" in r["twice"]
    assert r["not_devices"].startswith("TypeError")


def test_bench_decode_on_two_devices(results):
    r = results["bench_decode"]
    assert r["files"] == ["bench_decode_tp2.json"] and r["devices"] == 2 and not r["errors"]
    assert [x["config"] for x in r["results"]] == ["b", "c2"]
    for x in r["results"]:
        assert x["devices"] == 2 and x["tokens_per_s"] > 0 and x["steps"] > 0
    assert r["results"][1]["hit_rate"] > 0
    assert r["bucket"] == [0]
    assert [p["mode"] for p in r["prefill"]] == ["resident", "host"]
    assert all(p["devices"] == 2 and p["tokens_per_s"] > 0 for p in r["prefill"])


# ------------------------------------------------------------------ in process (1 device)
def test_local_model_and_divisibility():
    cfg = configs.tiny(num_kv_heads=4, num_heads=8, ffn_dim=96)
    loc = parallel.local_model(cfg, 2)
    assert (loc.num_heads, loc.num_kv_heads, loc.ffn_dim, loc.group_size) == (4, 2, 48, 2)
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\).*divisible by 3.*1 / 2 / 4 devices"):
        parallel.check_model(cfg, 3)
    with pytest.raises(ValueError, match=r"ffn_dim \(100\).*divisible by 8"):
        parallel.check_model(configs.tiny(num_kv_heads=8, num_heads=8, ffn_dim=100), 8)


def test_mesh_argument_single_device_is_todays_path():
    cfg = CFG
    assert parallel.TensorParallel.create(None, cfg) is None
    assert parallel.TensorParallel.create(jax.devices()[:1], cfg) is None
    mesh1 = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
    assert parallel.TensorParallel.create(mesh1, cfg) is None
    with pytest.raises(TypeError, match="mesh"):
        parallel.TensorParallel.create("gpu", cfg)
    params = llama.init_params(cfg, seed=0)
    prompts = [[5, 6, 7, 8, 9]]
    kw = dict(max_new_tokens=3, stop_tokens=[], cache=CacheConfig(page_size=4, selected_pages=2))
    a = jaxkv.generate(cfg, params, prompts, **kw)
    b = jaxkv.generate(cfg, params, prompts, mesh=jax.devices()[:1], **kw)
    assert a.tokens == b.tokens and b.stats["num_devices"] == 1 and "per_device" not in b.stats


# ------------------------------------------------------------------ GPU (>= 2 GPUs)
def _gpus():
    return [d for d in jax.devices() if d.platform == "gpu"]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_tensor_parallel_generate(n):
    if len(_gpus()) < n:
        pytest.skip(f"needs {n} GPUs")
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=4, num_layers=3,
                       ffn_dim=256)
    params = llama.init_params(cfg, seed=0)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(3, cfg.vocab_size, m)) for m in (300, 170, 513)]
    kw = dict(max_new_tokens=24, stop_tokens=[])
    base = CacheConfig(selector="quest", page_size=16, selected_pages=6)
    mesh = _gpus()[:n]
    res_n = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(base, mode="resident"),
                           mesh=mesh, **kw)
    host_n = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
        base, mode="host", pool_pages=3 * (1 * 6 + 2), strict=True), mesh=mesh, **kw)
    assert host_n.tokens == res_n.tokens            # same numerics: exact
    one = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(base, mode="resident"), **kw)
    agree = np.mean([a == b for x, y in zip(one.tokens, res_n.tokens) for a, b in zip(x, y)])
    assert agree > 0.9  # bf16: the psum of partial projections rounds differently
    assert host_n.stats["num_devices"] == n and len(host_n.stats["per_device"]["misses"]) == n


@pytest.mark.gpu
def test_gpu_decode_round_is_one_program_over_the_mesh():
    if len(_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    from jaxkv import Sampling, engine
    from jaxkv.api import make_plan
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=4)
    tp = parallel.TensorParallel.create(_gpus()[:2], cfg)
    lens = [300, 170]
    plan = tp.plan(make_plan(tp.local_model(cfg), CacheConfig(mode="host", selector="quest",
                                                              page_size=16, selected_pages=4),
                             lens, 8, 4))
    state = engine.start_state(plan, tp.init_kv(plan), tp.init_summaries(plan), lens,
                               jnp.ones((len(lens),), jnp.int32), jax.random.key(0),
                               lookahead=tp.init_lookahead(plan))
    hlo = tp.lower_decode_round(plan, tp.shard_params(llama.init_params(cfg, seed=0)), state,
                                Sampling.make(), jnp.full((4,), -1, jnp.int32),
                                jnp.int32(8)).compile().as_text()
    shapes = [plan.spec.host_shape, (1,) + plan.spec.host_shape]
    pats = [re.compile(r"\[" + ",".join(map(str, s)) + r"\]") for s in shapes]
    copies = [l for l in hlo.splitlines() if any(p.search(l) for p in pats)
              and re.search(r"\b(copy|copy-start|copy-done)\(", l)]
    assert not copies, copies[:3]
    assert re.search(r"\[1," + ",".join(map(str, plan.spec.host_shape)) + r"\][^\n]*S\(5\)", hlo)
