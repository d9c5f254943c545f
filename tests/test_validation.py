"""Bad input, capacity limits and strict mode: every public entry point fails early with a
message that names the fix (jaxkv.generate, CacheConfig, Sampling, CacheSpec, the cache-level
validators, the GGUF loader and the command line). See docs/failure_modes.md.

All but one test fail before anything is compiled; ``test_strict_*`` runs generate() on the
tiny model (one compilation shared by its cases).
"""
from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # not installed on the GPU machine  # noqa: E402

import jaxkv
from jaxkv import CacheConfig, CacheSpec, Sampling, api, engine, validation
from jaxkv import cache as kvcache
from jaxkv.cli import main as cli_main
from jaxkv.models import configs, llama
from jaxkv.models.gguf_loader import GGUFError, load_gguf

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng()
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (37, 21, 50)]
SMALL = CacheConfig(page_size=4, selected_pages=4)


def gen(prompts=PROMPTS, cache=SMALL, model=CFG, params=PARAMS, **kw):
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("stop_tokens", [])
    return jaxkv.generate(model, params, prompts, cache=cache, **kw)


# ------------------------------------------------------------------------------ prompts
@pytest.mark.parametrize("prompts, exc, match", [
    ([], ValueError, "one request .* or a non-empty list of requests"),
    (iter([[5, 6]]), ValueError, "one request .* or a non-empty list of requests"),
    ("hello", TypeError, r"prompt 0 is text: pass token ids \(tokenizer.encode.*jaxkv.load"),
    ([[5, 6], "text"], TypeError, r"prompt 1 is text: pass token ids \(tokenizer.encode"),
    ([[5, 6], []], ValueError, "prompt 1 is empty.*BOS"),
    ([[5, 6, 7], [1.5, 2.0]], TypeError, r"prompt 1 holds a float \(1.5\) at index 0"),
    ([[5, 6, 7], [5, True]], TypeError, r"prompt 1 holds a bool \(True\) at index 1"),
    ([5, 6.0], TypeError, r"prompt 0 holds a float \(6.0\) at index 1"),    # one request
    ([True, False], TypeError, r"prompt 0 holds a bool \(True\) at index 0"),
    ([[5, None]], TypeError, r"prompt 0 holds a NoneType \(None\) at index 1"),
    ([[5, 6], np.array([1.5])], TypeError, "prompt 1 must hold integer token ids, got dtype float64"),
    ([[[1, 2], [3, 4]]], ValueError, r"prompt 0 must be a 1-D list of token ids, but holds list "
                                     r"\[1, 2\] at index 0"),
    ([[[1, 2], [3]]], ValueError, r"prompt 0 must be a 1-D list .* holds list \[1, 2\]"),  # ragged
    ([[5, 2**70]], ValueError, rf"prompt 0 has token id {2**70} at index 1, outside"),
    ([5, -2**70], ValueError, rf"prompt 0 has token id {-2**70} at index 1, outside"),
    ([[5, 6], [3, 256, 4]], ValueError, r"prompt 1 has token id 256 at index 1.*\[0, 256\).*tokenizer"),
    ([[5, -1]], ValueError, "prompt 0 has token id -1"),
])
def test_bad_prompts(prompts, exc, match):
    with pytest.raises(exc, match=match):
        gen(prompts)


@pytest.mark.parametrize("one", [[5, 6, 7], (5, 6, 7), np.array([5, 6, 7], np.int32),
                                 jnp.array([5, 6, 7]), [np.int64(5), np.array(6), jnp.int32(7)]],
                         ids=["list", "tuple", "array", "jax-array", "numpy-and-jax-scalars"])
def test_one_token_id_list_is_one_request(one):
    """A single token-id list (or 1-D integer array) is one request, like a single text."""
    assert gen(one).tokens == gen([[5, 6, 7]]).tokens


def test_2d_array_prompts_accepted():
    # a [B, T] array passes the prompt checks (the capacity check then fails, before compiling)
    with pytest.raises(ValueError, match="max_position"):
        gen(np.full((2, 5), 7, np.int32), max_new_tokens=CFG.max_position)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=2.5), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=True), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(seed=-1), ValueError, "seed must be an int >= 0"),
    (dict(stop_tokens=[2, 999]), ValueError, "stop_tokens has token id 999"),
    (dict(sampling=0.7), TypeError, r"Sampling.make"),
    (dict(cache={"page_size": 4}), TypeError, "jaxkv.CacheConfig"),
    (dict(model="tiny"), TypeError, "ModelConfig"),
])
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        gen(**kw)


# ------------------------------------------------------------------------------ params
def test_params_missing_or_extra_leaf():
    lay0 = {k: v for k, v in PARAMS["layers"][0].items() if k != "wqkv"}
    p = dict(PARAMS, layers=(lay0,) + tuple(PARAMS["layers"][1:]))
    with pytest.raises(ValueError, match=r"missing \[\"\['layers'\]\[0\]\['wqkv'\]\"\].*init_params"):
        gen(params=p)
    with pytest.raises(ValueError, match="unexpected.*lm_head"):
        gen(params=dict(PARAMS, lm_head=PARAMS["embed"].T))
    with pytest.raises(TypeError, match="params dict"):
        gen(params=[PARAMS])


def test_params_of_another_model():
    other = llama.init_params(configs.tiny(ffn_dim=96), seed=0)
    with pytest.raises(ValueError, match=r"'w_down'\] has shape \(96, 64\).*needs \(128, 64\).*another model"):
        gen(params=other)


def test_params_wrong_dtype():
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS)
    with pytest.raises(ValueError, match=r"dtype bfloat16.*says float32.*astype"):
        gen(params=p)


# ------------------------------------------------------------------------------ capacity
def test_over_max_context():
    cache = dataclasses.replace(SMALL, max_context=64)
    with pytest.raises(ValueError, match=r"\(50 tokens\) \+ max_new_tokens \(20\) = 70 exceeds "
                                         r"CacheConfig.max_context \(64\): raise max_context"):
        gen(cache=cache, max_new_tokens=20)


def test_over_model_max_position():
    with pytest.raises(ValueError, match=r"max_position \(1024\): shorten the prompt or lower max_new_tokens"):
        gen(max_new_tokens=1000)


def test_selection_over_pool():
    cache = dataclasses.replace(SMALL, pool_pages=5)  # k 4 + pinned 2 = 6 > 5
    with pytest.raises(ValueError, match=r"pool_pages \(5\) is smaller than one request's pages "
                                         r"in a step \(6: selected_pages 4 \+ pinned 2\): raise "
                                         r"pool_pages to at least 6"):
        gen(cache=cache)
    # a short context caps the working set at its own pages, and the message says so
    with pytest.raises(ValueError, match=r"\(4: selected_pages 8 \+ pinned 2, at most the "
                                         r"context's 4 pages\): raise pool_pages to at least 4"):
        gen([[5, 6, 7]], cache=dataclasses.replace(SMALL, pool_pages=2, selected_pages=8,
                                                   max_context=16), max_new_tokens=2)


def test_pinned_pages_over_pool():
    cache = CacheConfig(page_size=4, selected_pages=3, sink_pages=2, recent_pages=2, pool_pages=8)
    with pytest.raises(ValueError, match=r"pinned pages of 3 requests.*raise pool_pages, lower sink_pages"):
        gen(cache=cache)


def test_pool_larger_than_host_tier_is_clamped():
    plan = api.make_plan(CFG, dataclasses.replace(SMALL, pool_pages=10**6), [50, 20], 8, 4)
    assert plan.pool_pages == plan.spec.num_logical_pages == 2 * plan.pages_per_seq


def test_prefill_token_chunk_default_per_backend(monkeypatch):
    """None: 131072 tokens on the GPU, 512 elsewhere (at least a page); a value is kept."""
    cfg = configs.tiny()
    plan = lambda **kw: api.make_plan(cfg, CacheConfig(**kw), [40], 8, 4)  # noqa: E731
    assert CacheConfig().prefill_token_chunk is None
    assert plan().prefill_token_chunk == 512
    assert plan(mode="resident", selector="dense", page_size=1024, sink_pages=0,
                recent_pages=0, selected_pages=1).prefill_token_chunk == 1024
    assert plan(prefill_token_chunk=64).prefill_token_chunk == 64
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert plan().prefill_token_chunk == 131072


def test_host_tier_over_pinned_host_cap(monkeypatch):
    monkeypatch.setenv(validation.HOST_LIMIT_OVERRIDE_ENV, "0.0001")  # 100 KiB cap
    # on the CPU the cap is jaxkv's own variable: the message names it, not XLA's GPU one
    with pytest.raises(ValueError, match=r"pinned host memory, over the cap of 0.00 GiB: set "
                                         r"JAXKV_HOST_MEMORY_LIMIT_GB.*lower batch / max_context"):
        gen()
    # resident mode has no host tier: the cap does not apply (it fails later on purpose here)
    with pytest.raises(ValueError, match="max_position"):
        gen(cache=dataclasses.replace(SMALL, mode="resident"), max_new_tokens=2000)


def test_host_limit_rules(monkeypatch):
    for env in (validation.HOST_LIMIT_ENV, validation.HOST_LIMIT_OVERRIDE_ENV):
        monkeypatch.delenv(env, raising=False)
    assert validation.host_limit_bytes("cpu") is None              # no behaviour change on CPU
    assert validation.host_limit_bytes("gpu") == 64 * 2**30        # XLA's default on GPU
    monkeypatch.setenv(validation.HOST_LIMIT_ENV, "100")
    assert validation.host_limit_bytes("gpu") == 100 * 2**30
    monkeypatch.setenv(validation.HOST_LIMIT_OVERRIDE_ENV, "8")
    assert validation.host_limit_bytes("gpu") == 8 * 2**30          # the smaller cap wins
    assert validation.host_limit_bytes("cpu") == 8 * 2**30
    monkeypatch.setenv(validation.HOST_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='lots' is not a number"):
        validation.host_limit_bytes("gpu")
    validation.check_host_capacity(2**30, limit_bytes=2**30)
    with pytest.raises(ValueError, match="1.00 GiB of pinned host memory"):
        validation.check_host_capacity(2**30, limit_bytes=2**30 - 1)


def test_pinned_reservation_follows_the_allocators_doubling():
    GiB = 2**30
    # a 64.1 GiB tier: a 128 GiB region under a 140 GiB limit, the limit itself under 70
    assert validation.pinned_reservation_bytes(int(64.1 * GiB), 140 * GiB) == 128 * GiB
    assert validation.pinned_reservation_bytes(int(64.1 * GiB), 70 * GiB) == 70 * GiB
    assert validation.pinned_reservation_bytes(64 * GiB, 140 * GiB) == 64 * GiB
    assert validation.pinned_reservation_bytes(1, 140 * GiB) == 2 << 20


def test_host_tiers_over_ram_and_the_doubling_warning():
    GiB = 2**30
    tier = int(64.1 * GiB)
    with pytest.raises(ValueError, match=r"host tiers need 128.20 GiB .*\(2 devices\), more than "
                                         r"the machine's 100.00 GiB of RAM: lower batch"):
        validation.check_host_capacity(tier, limit_bytes=140 * GiB, devices=2, ram_bytes=100 * GiB,
                                       backend="gpu")
    # fits the RAM, but two doubled regions (2 x 128 GiB) do not: warn, naming a limit
    with pytest.warns(RuntimeWarning, match=r"reserves 128 GiB per device \(256 GiB in all\).*"
                                            r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=67 "):
        validation.check_host_capacity(tier, limit_bytes=140 * GiB, devices=2, ram_bytes=200 * GiB,
                                       backend="gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validation.check_host_capacity(tier, limit_bytes=70 * GiB, devices=2, ram_bytes=200 * GiB,
                                       backend="gpu")          # the suggested kind of limit
        validation.check_host_capacity(tier, limit_bytes=140 * GiB, devices=2, ram_bytes=200 * GiB,
                                       backend="cpu")          # no XLA GPU allocator
    assert validation.host_ram_bytes() is None or validation.host_ram_bytes() > 2**30


def test_host_only_settings_warn_in_resident_mode():
    """pool_pages / schedule / reuse do nothing to a resident cache: a warning says so."""
    with pytest.warns(UserWarning, match=r"CacheConfig\(pool_pages=10, schedule='layer'\) "
                                         r"applies to mode='host' only"):
        gen(cache=dataclasses.replace(SMALL, mode="resident", pool_pages=10, schedule="layer"),
            max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(cache=dataclasses.replace(SMALL, mode="resident"), max_new_tokens=2)


def test_params_on_another_device():
    """Weights committed to a device other than the default fail before any work, naming
    both devices and the fix (a subprocess with two CPU devices)."""
    import subprocess
    import sys
    code = ("import jax, jaxkv\n"
            "from jaxkv.models import configs, llama\n"
            "cfg = configs.tiny(); p = jax.device_put(llama.init_params(cfg, 0), jax.devices()[1])\n"
            "try:\n"
            "    jaxkv.generate(cfg, p, [[1, 2, 3]], max_new_tokens=2)\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300).stdout
    assert "params are on cpu:1, but generate() builds its cache on the default device cpu:0" in out


def test_indexer_selector_needs_indexer_weights():
    with pytest.raises(ValueError, match=r"selector='indexer'\) needs a model with lightning-"
                                         r"indexer weights.*'tiny' has none"):
        gen(cache=dataclasses.replace(SMALL, selector="indexer"))


def test_device_memory_too_small(monkeypatch):
    # a CPU device reports no memory figure: the RAM bounds it
    assert validation.device_free_bytes() == validation.host_ram_bytes() or jax.default_backend() == "gpu"
    monkeypatch.setattr(validation, "device_free_bytes", lambda device=None: 1000)
    with pytest.raises(ValueError, match=r"device pool needs .* GiB of device memory is free: "
                                         r"lower pool_pages / selected_pages / batch"):
        gen()
    with pytest.raises(ValueError, match=r"resident KV cache needs.*or use mode='host'"):
        gen(cache=dataclasses.replace(SMALL, mode="resident"))
    # the two-stage selector's key copy is named, with the selector that has none
    with pytest.raises(ValueError, match=r"device pool needs .*; the 'quest_rescore8' selector's "
                                         r"summaries .* take .* GiB of it: selector='quest'"):
        gen(cache=dataclasses.replace(SMALL, selector="quest_rescore8"))


def test_device_memory_counts_the_dense_layers_copy(monkeypatch):
    """On the host tier the dense layers' K/V stay on the device whole: the check counts them
    (the whole decode state's device leaves, ``engine.abstract_state``) and names them."""
    dense = dataclasses.replace(SMALL, dense_layers=(0,))
    plans = [api.make_plan(CFG, c, [40, 30], 8, num_stop=0) for c in (SMALL, dense)]
    need = [api._device_state_bytes(p)[0] for p in plans]
    assert need[1] - need[0] >= plans[1].dense_spec.host_bytes > 0
    stats = [gen(cache=c).stats["device_kv_bytes"] for c in (SMALL, dense)]
    assert stats[1] - stats[0] >= plans[1].dense_spec.host_bytes  # and the stats count them
    monkeypatch.setattr(validation, "device_free_bytes", lambda device=None: need[0])
    with pytest.raises(ValueError, match=r"device pool and dense layers needs .*the 1 dense "
                                         r"layers' K/V \(CacheConfig.dense_layers\)"):
        gen(cache=dense)


def test_device_memory_env_override(monkeypatch):
    monkeypatch.setenv(validation.DEVICE_LIMIT_OVERRIDE_ENV, "0.000001")
    assert validation.device_free_bytes() == int(1e-6 * 2**30)
    with pytest.raises(ValueError, match="device pool needs"):
        gen()
    validation.check_device_memory(10, what="x", fix="y", free_bytes=10)
    with pytest.raises(ValueError, match="the x needs .* free: y"):
        validation.check_device_memory(11, what="x", fix="y", free_bytes=10)


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("kw, match", [
    (dict(page_size=12), "power of two, got 12: use 8 or 16"),
    (dict(page_size=0), "page_size must be an int >= 1"),
    (dict(max_context=100), r"max_context \(100\) is not a multiple of page_size \(16\): use 112 or 96"),
    (dict(selected_pages=0), "selected_pages must be an int >= 1"),
    (dict(selected_pages=1, sink_pages=1), "must cover the sink pages.*raise selected_pages"),
    (dict(pool_pages=0), "pool_pages must be an int >= 1"),
    (dict(pool_pages=True), "pool_pages must be an int >= 1"),
    (dict(sink_pages=-1), "sink_pages must be an int >= 0"),
    (dict(kv_dtype="int4"), "kv_dtype must be one of"),
    (dict(kv_dtype="float8"), "kv_dtype must be one of.*float8_e4m3fn"),
    (dict(implementation="triton"), "'pallas', 'xla' or None"),
    (dict(strict="yes"), "strict must be a bool"),
    (dict(reuse="no"), "reuse must be a bool"),
    (dict(mode="device"), "'host' or 'resident'"),
    (dict(selector="topk"), r"selector must be one of \(.*'dense'.*'quest'.*\), got 'topk'"),
    (dict(prefill_chunk=24), "prefill_chunk must be a power of two"),
    (dict(selector="quest", candidate_pages=64),
     r"selector='quest' has none: leave candidate_pages=None"),
    (dict(selector="quest_rescore", selected_pages=32, candidate_pages=16),
     r"candidate_pages \(16\) must be at least selected_pages \(32\)"),
    (dict(selector="quest_rescore", candidate_pages=0), "candidate_pages must be an int >= 1"),
    (dict(prefill_token_chunk=8, page_size=16), "prefill_token_chunk must be a power of two >= page_size"),
])
def test_cache_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kw)


def test_cache_config_numpy_ints_normalised():
    c = CacheConfig(page_size=np.int64(8), pool_pages=np.int32(40))
    assert type(c.page_size) is int and type(c.pool_pages) is int and hash(c) == hash(
        CacheConfig(page_size=8, pool_pages=40))


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_k=2.5), "top_k must be an int >= 0"),
    (dict(top_k=-3), "top_k must be an int >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
])
def test_sampling_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling.make(**kw)
    with pytest.raises(ValueError, match=kw and next(iter(kw))):  # the constructor alike
        Sampling(**kw)


def test_kv_dtype_given_as_a_dtype_object():
    """np / jnp / ml_dtypes dtype objects name their dtype (the field stays a str)."""
    for d, name in ((np.dtype("int8"), "int8"), (jnp.int8, "int8"), (jnp.bfloat16, "bfloat16"),
                    (jnp.float8_e4m3fn, "float8_e4m3fn")):
        assert CacheConfig(kv_dtype=d).kv_dtype == name
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        CacheConfig(kv_dtype=jnp.int32)


def test_sampling_top_k_float_refused_alike():
    for build in (Sampling, Sampling.make):
        with pytest.raises(ValueError, match="top_k must be an int"):
            build(top_k=2.0)


SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32",
            num_logical_pages=12, num_slots=6, max_requests=8, num_sink_pages=1,
            num_recent_pages=1, max_batch=2)


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=24), "head_dim must be a power of two"),
    (dict(page_size=3), "page_size must be a power of two"),
    (dict(dtype="int4"), "dtype must be one of"),
    (dict(num_slots=3), r"pinned pages need 4 slots.*raise the pool size or pin fewer pages"),
    (dict(num_slots=13), "pool would be larger than the host tier"),
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(num_sink_pages=True), "num_sink_pages must be an int >= 0"),
])
def test_cache_spec_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheSpec(**{**SPEC, **kw})


# ------------------------------------------------------------------------------ cache level
@pytest.fixture(scope="module")
def small_cache():
    spec = CacheSpec(**SPEC)
    return spec, kvcache.init_cache(spec)


def test_cache_state_checks(small_cache):
    spec, cache = small_cache
    validation.check_cache_state(spec, cache)
    other = dataclasses.replace(spec, num_slots=4)
    with pytest.raises(ValueError, match=r"cache.pool is float32\[12, 256\].*float32\[8, 256\].*init_cache"):
        validation.check_cache_state(other, cache)
    with pytest.raises(TypeError, match="HostTierCache"):
        validation.check_cache_state(spec, kvcache.init_resident(spec))
    with pytest.raises(TypeError, match="jaxkv.CacheSpec"):
        validation.check_cache_state(SPEC, cache)


def test_page_request_checks(small_cache):
    spec, _ = small_cache
    req = jnp.array([[0, 3, -1], [11, 11, 2]], jnp.int32)
    prot = jnp.full((2, 2), -1, jnp.int32)
    validation.check_page_requests(spec, req, prot)
    validation.check_page_requests(spec, req[:1], prot[:1], jnp.array([1], jnp.int32))
    cases = [
        ((req.at[0, 0].set(12), prot, None), ValueError, r"requests holds page 12 outside \[0, 12\)"),
        ((req, prot.at[1, 1].set(-2), None), ValueError, "protect holds page -2"),
        ((req[:1], prot[:1], None), ValueError, "cache has 2 layers: pass layers"),
        ((req, prot, jnp.array([0, 2], jnp.int32)), ValueError, r"layers \[0, 2\] outside \[0, 2\)"),
        ((req, prot, jnp.array([1, 1], jnp.int32)), ValueError, "repeat a layer"),
        ((req.astype(jnp.float32), prot, None), TypeError, "requests must be an integer array"),
        ((req[0], prot, None), ValueError, "requests must have 2 dims"),
        ((req, prot[:1], None), ValueError, "protect has 1 rows, requests 2"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            validation.check_page_requests(spec, *args)
    # traced values: only static checks (shapes and dtypes), no error
    jax.jit(lambda r, p: validation.check_page_requests(spec, r, p))(req.at[0, 0].set(99), prot)


def test_token_write_checks(small_cache):
    spec, _ = small_cache
    pages = jnp.array([0, 11, -1], jnp.int32)
    offs = jnp.array([0, 3, 0], jnp.int32)
    kv = jnp.zeros((3, 2, 2, 16), jnp.float32)
    validation.check_token_writes(spec, jnp.int32(1), pages, offs, kv)
    cases = [
        ((jnp.int32(0), pages.at[0].set(12), offs, kv), ValueError,
         r"logical_pages holds 12 outside \[0, 12\)"),
        ((jnp.int32(2), pages, offs, kv), ValueError, r"layer holds 2 outside \[0, 2\)"),
        ((jnp.int32(0), pages, offs.at[1].set(4), kv), ValueError, r"offsets holds 4 outside \[0, 4\)"),
        ((jnp.int32(0), pages, offs, kv[:, :, :1]), ValueError, r"kv shape \(3, 2, 1, 16\) != \[M, 2, H, D\]"),
        ((jnp.int32(0), pages, offs[:2], kv), ValueError, "offsets shape"),
        ((jnp.int32(0), pages, offs, kv.astype(jnp.int32)), TypeError, "kv must be a float array"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            validation.check_token_writes(spec, *args)


# ------------------------------------------------------------------------------ strict mode
def test_strict_rules_and_messages():
    ok = dict(dropped=0, truncated_requests=0, pool_pages=10, max_context=256)
    assert validation.strict_violations(ok) == []
    validation.check_strict(ok)
    with pytest.raises(RuntimeError, match=r"strict mode: 3 selected pages were dropped.*raise CacheConfig.pool_pages"):
        validation.check_strict(dict(ok, dropped=3))
    with pytest.raises(RuntimeError, match=r"2 requests stopped at the context capacity.*raise CacheConfig.max_context"):
        validation.check_strict(dict(ok, truncated_requests=2))


def test_counter_overflow_is_detected():
    c = kvcache.CacheCounters(*[jnp.int32(v) for v in (5, -7, 0, 0, 0, 0, 0, 0)])
    kv = kvcache.ResidentCache(pool=jnp.zeros((1, 1)), counters=c)
    st = engine.DecodeState(kv=kv, summaries=(), lengths=jnp.zeros(1, jnp.int32),
                            last_token=jnp.zeros(1, jnp.int32), done=jnp.zeros(1, bool),
                            n_generated=jnp.zeros(1, jnp.int32), key=jax.random.key(0))
    totals = {f.name: 0 for f in dataclasses.fields(kvcache.CacheCounters)}
    with pytest.raises(RuntimeError, match="'misses' overflowed int32.*round_steps"):
        api._drain_counters(st, totals)
    assert set(totals.values()) == {0}
    c = kvcache.CacheCounters(*[jnp.int32(v) for v in (5, 7, 1, 2, 3, 4, 6, 8)])
    st = api._drain_counters(dataclasses.replace(st, kv=dataclasses.replace(kv, counters=c)), totals)
    assert list(totals.values()) == [5, 7, 1, 2, 3, 4, 6, 8]
    assert all(int(getattr(st.kv.counters, k)) == 0 for k in totals)


# One compiled plan for every strict-mode case (a pool too small for a step's working set).
DROPPY = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=5, pool_pages=7,
                     round_steps=16, schedule="layer")


def test_strict_dropped_counted_warned_and_raised():
    with pytest.warns(RuntimeWarning, match="selected pages were dropped.*strict=True"):
        res = gen(PROMPTS[2:], cache=DROPPY, max_new_tokens=40)
    s = res.stats
    assert s["dropped"] > 0 and s["truncated_requests"] == 0 and s["decode_rounds"] >= 3
    # counters summed over rounds (drained each round): every decode step wrote one token per layer
    assert s["tokens_written"] == CFG.num_layers * (s["generated_tokens"] - 1)
    assert s["bytes_device_to_host"] > 0
    # resident: the same rows are written on the device, so no byte goes to the host
    r = gen(PROMPTS[2:], cache=dataclasses.replace(DROPPY, mode="resident", pool_pages=None),
            max_new_tokens=40).stats
    assert r["tokens_written"] == s["tokens_written"] and r["bytes_device_to_host"] == 0
    with pytest.raises(RuntimeError, match="strict mode: .* dropped") as e:
        gen(PROMPTS[2:], cache=dataclasses.replace(DROPPY, strict=True), max_new_tokens=40)
    # the generated tokens are not lost: the exception (a StrictModeError) carries the result
    assert isinstance(e.value, jaxkv.StrictModeError) and e.value.result.tokens == res.tokens
    stream = gen(PROMPTS[2:], cache=dataclasses.replace(DROPPY, strict=True), max_new_tokens=40,
                 stream=True)
    with pytest.raises(jaxkv.StrictModeError):
        list(stream)
    assert stream.result.tokens == res.tokens


@pytest.mark.filterwarnings("ignore:.*selected pages were dropped")
def test_strict_truncation_counted(monkeypatch):
    # Bypass the capacity check (make_plan sizes the context for 40 new tokens, the call asks
    # for 1000): the loop must stop at the capacity and report it, never drop tokens silently.
    real = api.make_plan
    monkeypatch.setattr(api, "make_plan", lambda m, c, lens, n, s: real(m, c, lens, 40, s))
    with pytest.warns(RuntimeWarning, match="stopped at the context capacity"):
        res = gen(PROMPTS[2:], cache=DROPPY, max_new_tokens=1000)
    assert res.stats["truncated_requests"] == 1
    # the last token fed to the model sits at position max_context - 1 (the last cache slot)
    assert len(res.tokens[0]) == res.stats["max_context"] - len(PROMPTS[2]) + 1
    with pytest.raises(RuntimeError, match="requests stopped at the context capacity"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen(PROMPTS[2:], cache=dataclasses.replace(DROPPY, strict=True), max_new_tokens=1000)


# ------------------------------------------------------------------------------ GGUF loader
def _byte_tokens():
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def write_tiny_gguf(path, cfg=CFG, *, meta=None, replace=None, tokenizer=True):
    """A llama GGUF of ``cfg`` with random weights (values do not matter here), optional
    metadata overrides ``meta`` {key: int} and tensor replacements ``replace`` {name: array}."""
    replace = replace or {}
    p = jax.tree.map(np.asarray, llama.init_params(cfg, seed=1))
    w = gguf.GGUFWriter(str(path), "llama")
    fields = {"llama.block_count": cfg.num_layers, "llama.context_length": cfg.max_position,
              "llama.embedding_length": cfg.d_model, "llama.feed_forward_length": cfg.ffn_dim,
              "llama.attention.head_count": cfg.num_heads,
              "llama.attention.head_count_kv": cfg.num_kv_heads,
              "tokenizer.ggml.bos_token_id": cfg.bos_id, "tokenizer.ggml.eos_token_id": cfg.eos_id,
              **(meta or {})}
    for k, v in fields.items():
        w.add_uint32(k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    if tokenizer:
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "gpt2")
        w.add_array("tokenizer.ggml.tokens", _byte_tokens())
        w.add_array("tokenizer.ggml.token_type", [1] * 256)
    lay = jax.tree.map(np.asarray, llama.stacked_layers(p, cfg))
    tensors = {"token_embd.weight": p["embed"], "output_norm.weight": p["final_norm"]}
    names = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm"}
    mats = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
            "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
    for i in range(cfg.num_layers):
        for g, j in names.items():
            tensors[f"blk.{i}.{g}.weight"] = lay[j][i]
        for g, j in mats.items():
            tensors[f"blk.{i}.{g}.weight"] = lay[j][i].T
    tensors.update(replace)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_loader_reads_tiny(tmp_path):
    cfg, params = load_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    validation.check_params(cfg, params)


def test_loader_nan_tensor(tmp_path):
    bad = np.ones((CFG.d_model,), np.float32)
    bad[3] = np.nan
    path = write_tiny_gguf(tmp_path / "nan.gguf", replace={"blk.1.ffn_norm.weight": bad})
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_norm.weight' holds NaN or Inf.*re-download"):
        load_gguf(path)


@pytest.fixture
def header_only(monkeypatch):
    """load_gguf may not read any tensor's data: header errors fail before the weights."""
    from jaxkv.models import gguf_loader

    def refuse(t):
        raise AssertionError(f"tensor {t.name} read before the header checks failed")
    monkeypatch.setattr(gguf_loader, "_dequantize", refuse)


def test_loader_tensor_shape_mismatch(tmp_path, header_only):
    w = np.zeros((CFG.ffn_dim, CFG.d_model + 1), np.float32)
    path = write_tiny_gguf(tmp_path / "shape.gguf", replace={"blk.0.ffn_up.weight": w})
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up.weight' has shape \[128, 65\].*implies \[128, 64\]"):
        load_gguf(path)


@pytest.mark.parametrize("meta, match", [
    ({"llama.attention.head_count_kv": 3}, "head_count 4 is not a multiple of head_count_kv 3"),
    ({"llama.block_count": 0}, r"'llama.block_count' = 0 must be positive"),
    ({"tokenizer.ggml.eos_token_id": 300}, r"inconsistent metadata.*eos_id \(300\).*vocab_size \(256\)"),
    ({"llama.block_count": 1}, r"'llama.block_count' = 1, but the file has tensors of block\(s\) \[1\]"),
])
def test_loader_bad_metadata(tmp_path, meta, match, header_only):
    with pytest.raises(GGUFError, match=match):
        load_gguf(write_tiny_gguf(tmp_path / "meta.gguf", meta=meta))


# ------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "t.gguf")


def test_tokenizer_bad_ids_and_text(tiny_gguf):
    from jaxkv.models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(tiny_gguf)
    assert tok.decode(tok.encode("hi there")) == "hi there"
    cases = [
        (lambda: tok.decode([5, 256]), ValueError, r"decode: ids has token id 256 at index 1, outside "
                                                   r"the vocabulary \[0, 256\)"),
        (lambda: tok.decode([-1]), ValueError, "decode: ids has token id -1 at index 0"),
        (lambda: tok.decode([10**30]), TypeError, "decode: ids must be integer token ids"),
        (lambda: tok.decode([1.5]), TypeError, "decode: ids must be integer token ids"),
        (lambda: tok.decode("hi"), TypeError, "decode: ids is text"),
        (lambda: tok.token(10**6), ValueError, r"token: id 1000000 is outside the vocabulary \[0, 256\)"),
        (lambda: tok.token(-1), ValueError, "token: id -1 is outside"),
        (lambda: tok.token("a"), TypeError, "token: i must be an int"),
        (lambda: tok.encode("a\ud800b"), ValueError, r"encode: text has a lone surrogate '\\ud800' at index 1"),
    ]
    for f, exc, match in cases:
        with pytest.raises(exc, match=match):
            f()


def test_tokenizer_rejects_the_eos_id_load_gguf_rejects(tmp_path):
    from jaxkv.models.tokenizer import Tokenizer
    path = write_tiny_gguf(tmp_path / "eos.gguf", meta={"tokenizer.ggml.eos_token_id": 300})
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.eos_token_id = 300 is outside the vocabulary"):
        Tokenizer.from_gguf(path)


# ------------------------------------------------------------------------------ command line
def test_cli_bad_options_fail_before_loading(tmp_path, capsys):
    missing = str(tmp_path / "none.gguf")
    with pytest.raises(SystemExit) as e:
        cli_main(["hi", "--page-size", "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    for argv, match in [
        (["hi", "--page-size", "12"], "power of two, got 12: use 8 or 16"),
        (["hi", "--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["   "], "the prompt is empty"),
        (["--file", str(tmp_path / "nope.txt")], "does not exist"),
        (["--file", str(tmp_path)], "is a directory, not a file"),
        (["hi", "--top-k", "99999999999"], "top_k must be an int >= 0 and < 2**31"),
        # options that pass: the call reaches the (missing) model file
        (["hi", "--seed", "18446744073709551616"], "GGUF file not found"),
        (["hi", "--page-size", "4096"], "GGUF file not found"),
    ]:
        assert cli_main(argv + ["--gguf", missing]) == 2, argv
        assert match in capsys.readouterr().err, argv
    for argv in (["hi", "--seed", "-1"], ["hi", "--top-k", "-2"]):   # argparse, before loading
        with pytest.raises(SystemExit) as e:
            cli_main(argv + ["--gguf", missing])
        assert e.value.code == 2 and "must be >= 0" in capsys.readouterr().err
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    assert cli_main(["--file", str(binary), "--gguf", missing]) == 2
    assert "as UTF-8 text" in capsys.readouterr().err


def test_cli_missing_or_corrupt_model(tmp_path, capsys):
    assert cli_main(["hi", "--gguf", str(tmp_path / "none.gguf")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 10)
    assert cli_main(["hi", "--gguf", str(junk)]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err


def test_cli_prompt_over_capacity(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "t.gguf", configs.tiny(max_position=128))
    assert cli_main(["x" * 200, "--gguf", str(path), "--max-new-tokens", "8"]) == 1
    assert "exceeds the model's max_position (128)" in capsys.readouterr().err


def test_cli_readme_strict_command_runs(tiny_gguf, capsys):
    """The README's `--selector quest --budget 512 --page-size 16 --pool-pages 96 --strict`:
    the pool is clamped to the short context's 16 pages, which hold every selection."""
    argv = ["--selector", "quest", "--budget", "512", "--page-size", "16", "--pool-pages", "96",
            "--strict", "--gguf", str(tiny_gguf), "--max-new-tokens", "8"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert "dropped 0" in capsys.readouterr().out


def test_cli_strict_fires_and_keeps_the_text(tiny_gguf, capsys):
    """--strict selects the per-layer schedule, so a pool smaller than a step's working set
    drops pages: exit 1 after the text is printed."""
    argv = ["x" * 50, "--page-size", "4", "--budget", "20", "--pool-pages", "7", "--strict",
            "--gguf", str(tiny_gguf), "--max-new-tokens", "40"]
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    assert "strict mode:" in err and "dropped" in err and out.startswith("x" * 50)
