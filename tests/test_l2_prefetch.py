"""l2_prefetch: an identity on its passthrough whatever the weights hold; lowers to one Triton
call; the model and the decode loop give the same tokens with it (interpret mode on CPU, the
real kernel under ``@pytest.mark.gpu``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, engine
from lowering import lower_for_h200
from models import configs, llama
from pallas_kernels import l2_prefetch as l2

S = jax.ShapeDtypeStruct


def _rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("seed", seed)
    return np.random.default_rng(seed)


def _weights(rng, dtype):
    """Three weights: all-NaN, random with infs, and one whose size has no power-of-two
    factor above 1 (blocks of one element)."""
    a = jnp.full((64, 96), jnp.nan, dtype)
    b = rng.standard_normal((32, 40)).astype(np.float32)
    b[rng.integers(0, 32, 5), rng.integers(0, 40, 5)] = np.inf
    c = rng.standard_normal((3, 5, 7)).astype(np.float32)
    return a, jnp.asarray(b, dtype), jnp.asarray(c, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("nbytes", [0, 1000, (4096, 0, 1 << 30), 1 << 40])
def test_kernel_returns_passthrough(dtype, nbytes):
    rng = _rng()
    x = jnp.asarray(rng.standard_normal((4, 1, 48)), dtype)
    after = jnp.asarray(rng.standard_normal((4, 1, 2, 8)), dtype)
    ws = _weights(rng, dtype)
    for impl in ("xla", "pallas"):
        y = l2.l2_prefetch(x, after, ws, nbytes=nbytes, block=64, programs=3, unroll=2,
                           implementation=impl)
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))


def test_bad_arguments():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="non-empty tuple"):
        l2.l2_prefetch(x, x, (), nbytes=10)
    with pytest.raises(ValueError, match="one per weight"):
        l2.l2_prefetch(x, x, (x, x), nbytes=(1, 2, 3))
    with pytest.raises(ValueError, match="one per weight"):
        l2.l2_prefetch(x, x, (x,), nbytes=-1)


def test_prefetch_bytes():
    ws = (S((1536, 1536), jnp.bfloat16), S((1536, 17920), jnp.bfloat16))
    assert l2.prefetch_bytes(ws, (1 << 40, 32 << 20)) == 1536 * 1536 * 2 + (32 << 20)


@pytest.mark.parametrize("shape", [((1536, 1536), (1536, 17920)), ((64, 64), (64, 352))])
def test_lowers_for_gpu(no_interpret, shape):
    """One Triton call per prefetch, inside a loop, with the passthrough aliased."""
    def loop(x, k, wo, wgu):
        def body(i, x):
            return l2.l2_prefetch(x, k, (wo, wgu), nbytes=(1 << 40, 1 << 20),
                                  implementation="pallas") * 1.5
        return jax.lax.fori_loop(0, 3, body, x)
    txt = lower_for_h200(loop, S((8, 1, 1536), jnp.bfloat16), S((8, 1, 2, 128), jnp.bfloat16),
                         S(shape[0], jnp.bfloat16), S(shape[1], jnp.bfloat16))
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.while" in txt


def _generate(monkeypatch, prefetch, cfg, params, prompts, cache):
    monkeypatch.setattr(llama, "L2_PREFETCH", prefetch)
    engine._round_fn.cache_clear()  # the switch is read when the round is traced
    jax.clear_caches()
    return jaxkv.generate(cfg, params, prompts, cache=cache, max_new_tokens=6, stop_tokens=[])


def test_decode_with_prefetch_equals_without(monkeypatch):
    """The host-tier decode loop with every op on its Pallas kernel (interpret mode) and the
    prefetch on: the same tokens as without it."""
    monkeypatch.setenv("JAXKV_IMPL_" + l2.OP.upper(), "pallas")
    cfg = configs.tiny()
    params = llama.init_params(cfg, seed=0)
    rng = _rng()
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (29, 41)]
    cache = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4,
                        implementation="pallas")
    base = _generate(monkeypatch, (), cfg, params, prompts, cache)
    pf = (("wo", 1 << 40), ("w_gate_up", 1 << 12))
    with_pf = _generate(monkeypatch, pf, cfg, params, prompts, cache)
    assert with_pf.tokens == base.tokens
    engine._round_fn.cache_clear()


@pytest.mark.gpu
def test_gpu_prefetch_identity_and_decode(monkeypatch):
    rng = _rng()
    x = jnp.asarray(rng.standard_normal((8, 1, 1536)), jnp.bfloat16)
    wo = jnp.full((1536, 1536), jnp.nan, jnp.bfloat16)
    wgu = jnp.asarray(rng.standard_normal((1536, 17920)), jnp.bfloat16)
    f = jax.jit(lambda x, wo, wgu: l2.l2_prefetch(x, x, (wo, wgu), nbytes=(1 << 40, 32 << 20),
                                                  implementation="pallas"))
    np.testing.assert_array_equal(np.asarray(f(x, wo, wgu), np.float32), np.asarray(x, np.float32))
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2, num_layers=3)
    params = llama.init_params(cfg, seed=0)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (300, 170)]
    cache = CacheConfig(mode="host", selector="quest", page_size=16, selected_pages=6)
    base = _generate(monkeypatch, (), cfg, params, prompts, cache)
    with_pf = _generate(monkeypatch, (("wo", 1 << 40), ("w_gate_up", 1 << 16)), cfg, params,
                        prompts, cache)
    assert with_pf.tokens == base.tokens
    engine._round_fn.cache_clear()
