"""CacheConfig.kv_dtype through generate() on the tiny model (CPU): a KV dtype other than the
model's (issue 29), and quantized KV, fp8 and int8 (issue 31): the host tier gives the resident run's tokens, token
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
                                               ("float8_e5m2", "dense"), ("int8", "quest")])
def test_fp8_host_equals_resident(kv_dtype, selector):
    host, resident = _pair(CFG, PARAMS, kv_dtype=kv_dtype, selector=selector)
    assert host.tokens == resident.tokens
    s = host.stats
    assert s["misses"] > 0 and s["dropped"] == 0
    H, ps, D = CFG.num_kv_heads, 4, CFG.head_dim
    page_bytes = 2 * H * ps * (D + 1)  # 1-byte payload + one scale byte per token, head, K/V
    assert s["bytes_host_to_device"] == (s["pages_fetched"] * page_bytes
                                         + s["host_reads"] * page_bytes // H)


def test_fp8_needs_a_capable_gpu():
    old = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="A100")
    with pytest.raises(ValueError, match=r"kv_dtype='float8_e4m3fn' needs a GPU of compute "
                                         r"capability >= 8.9.*A100.*kv_dtype='bfloat16'"):
        validation.check_kv_dtype("float8_e4m3fn", old)
    validation.check_kv_dtype("bfloat16", old)
    validation.check_kv_dtype("int8", old)                  # int8 converts on any GPU
    validation.check_kv_dtype("float8_e5m2",
                              types.SimpleNamespace(platform="gpu", compute_capability="9.0"))
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        CacheConfig(kv_dtype="fp8")


def test_fp8_page_arrays_avoid_wrapped_32_bit_offsets():
    """Pallas' Triton lowering addresses an array of at most 2**32 bytes with signed 32-bit
    element offsets, so an fp8 page array of 2-4 GiB gets unused rows up to just over 2**32
    bytes (``spec.alloc_rows``); the addressed rows and every other array are unchanged. The
    first case is the one that hit an illegal address on the H200: SmolLM2-135M, 160 requests
    of 2k tokens, resident dense fp8 (RULER harness)."""
    from jaxkv.spec import CacheSpec, alloc_rows
    base = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, max_requests=8)
    for dtype, pages in [("float8_e4m3fn", 160 * 130), ("float8_e5m2", 40 * 130),
                         ("float8_e4m3fn", 160 * 520), ("bfloat16", 160 * 130)]:
        spec = CacheSpec(dtype=dtype, num_logical_pages=pages, num_slots=pages // 2, **base)
        for shape, rows in ((spec.host_shape, 30 * pages), (spec.pool_shape, 30 * (pages // 2))):
            assert shape[0] >= rows and shape[1] == spec.row_elems
            window = spec.jnp_dtype.itemsize == 1 and 2**31 < rows * spec.page_bytes <= 2**32
            assert (shape[0] > rows) == window, (dtype, pages, shape)
            if window:
                assert 2**32 < shape[0] * spec.page_bytes <= 2**32 + spec.page_bytes
    smol = CacheSpec(dtype="float8_e4m3fn", num_logical_pages=160 * 130, num_slots=1, **base)
    assert smol.host_shape[0] > 30 * 160 * 130       # 3.9e9 bytes: padded
    assert alloc_rows(10, 3 * 2**28, 1) == 10 and alloc_rows(6, 2**29, 1) == 9
    assert alloc_rows(6, 2**29, 2) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("mode,selector", [("resident", "dense"), ("host", "quest")])
def test_gpu_fp8_cache_of_3_gib(mode, selector):
    """An fp8 cache of ~3.2 GiB (2-layer model, 8 KV heads of 128, 3 x 2**18 tokens): the last
    request's rows lie past 2**31 bytes. Three copies of one prompt give the tokens of a
    one-request run with the same context size (an illegal address or wrapped rows otherwise)."""
    cfg = configs.tiny(num_heads=8, num_kv_heads=8, head_dim=128, d_model=256,
                       max_position=2**19)
    params = llama.init_params(cfg, seed=1)
    prompt = list(RNG.integers(3, cfg.vocab_size, 300))
    cache = CacheConfig(mode=mode, selector=selector, page_size=16, selected_pages=8,
                        kv_dtype="float8_e4m3fn", max_context=2**18)
    one = jaxkv.generate(cfg, params, [prompt], cache=cache, max_new_tokens=8, stop_tokens=[])
    three = jaxkv.generate(cfg, params, [prompt] * 3, cache=cache, max_new_tokens=8,
                           stop_tokens=[])
    assert three.tokens == one.tokens * 3


def test_context_pages_copy_with_unused_rows():
    """A kept context's pages move to a new tier whose arrays may end with unused rows
    (``spec.alloc_rows``): the addressed rows are copied by request, the unused ones stay 0."""
    from jaxkv import context
    L, R = 2, 3
    old_plan = types.SimpleNamespace(batch=2, pages_per_seq=4)
    plan = types.SimpleNamespace(batch=3, pages_per_seq=3)
    used = L * old_plan.batch * old_plan.pages_per_seq
    old = np.arange((used + 5) * R, dtype=np.float32).reshape(used + 5, R) + 1
    shape = (L * plan.batch * plan.pages_per_seq + 7, R)
    out = np.asarray(context._copy_pages(old, shape, None, L, old_plan, plan, [1, 0, 1]))
    assert out.shape == shape and not out[L * plan.batch * plan.pages_per_seq:].any()
    a = old[:used].reshape(L, 2, 4, R)
    want = a[:, [1, 0, 1], :3].reshape(-1, R)
    np.testing.assert_array_equal(out[:L * 3 * 3], want)
