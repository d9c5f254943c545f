"""CacheConfig.kv_dtype through generate() on the tiny model (CPU): a KV dtype other than the
model's (issue 29), and fp8 KV (issue 31): the host tier gives the resident run's tokens, token
for token, with the selector dense and Quest; bad values fail early, naming the fix."""
import dataclasses
import types

import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, validation
from jaxkv.models import configs, llama

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
CFG16 = dataclasses.replace(CFG, dtype="bfloat16")
PARAMS16 = llama.init_params(CFG16, seed=0)
RNG = np.random.default_rng(4321)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (37, 21)]


def _pair(cfg, params, **kw):
    """(host, resident) results of one cache configuration."""
    out = []
    for mode in ("host", "resident"):
        cache = CacheConfig(mode=mode, page_size=4, selected_pages=4, **kw)
        out.append(jaxkv.generate(cfg, params, PROMPTS, cache=cache, max_new_tokens=6,
                                  stop_tokens=[]))
    return out


@pytest.mark.parametrize("model,kv_dtype,selector", [
    ("float32", "bfloat16", "quest"),
    ("float32", "float16", "dense"),
    ("bfloat16", "float32", "quest"),
])
def test_kv_dtype_other_than_the_models(model, kv_dtype, selector):
    cfg, params = (CFG, PARAMS) if model == "float32" else (CFG16, PARAMS16)
    host, resident = _pair(cfg, params, kv_dtype=kv_dtype, selector=selector)
    assert host.tokens == resident.tokens
    assert all(len(t) == 6 for t in host.tokens)
    assert host.stats["misses"] > 0


@pytest.mark.parametrize("kv_dtype,selector", [("float8_e4m3fn", "quest"),
                                               ("float8_e5m2", "dense")])
def test_fp8_host_equals_resident(kv_dtype, selector):
    host, resident = _pair(CFG, PARAMS, kv_dtype=kv_dtype, selector=selector)
    assert host.tokens == resident.tokens
    s = host.stats
    assert s["misses"] > 0 and s["dropped"] == 0
    H, ps, D = CFG.num_kv_heads, 4, CFG.head_dim
    page_bytes = 2 * H * ps * (D + 1)  # fp8 payload + one scale byte per token, head, K/V
    assert s["bytes_host_to_device"] == (s["pages_fetched"] * page_bytes
                                         + s["host_reads"] * page_bytes // H)


def test_fp8_needs_a_capable_gpu():
    old = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="A100")
    with pytest.raises(ValueError, match=r"kv_dtype='float8_e4m3fn' needs a GPU of compute "
                                         r"capability >= 8.9.*A100.*kv_dtype='bfloat16'"):
        validation.check_kv_dtype("float8_e4m3fn", old)
    validation.check_kv_dtype("bfloat16", old)
    validation.check_kv_dtype("float8_e5m2",
                              types.SimpleNamespace(platform="gpu", compute_capability="9.0"))
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        CacheConfig(kv_dtype="fp8")
