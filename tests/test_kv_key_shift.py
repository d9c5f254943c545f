"""fp8 KV's key shift (``CacheConfig.kv_key_shift``, issue 31): the cache stores each key less
its request's mean prompt key (per layer and KV head, fixed at the prefill, kept by a
continued context), which the softmax cancels; on a tiny model whose keys share a large
common component (a K bias, as Qwen2's). CPU, Pallas kernels in interpret mode."""
import numpy as np
import pytest

import jax.numpy as jnp

import jaxkv
from jaxkv import CacheConfig, selectors
from jaxkv.kernels import kv_quant
from jaxkv.models import configs, llama
from jaxkv.prefill import key_mean

# a slow RoPE: the K bias stays a common component of the keys after it
CFG = configs.tiny(qkv_bias=True, rope_theta=1e8)


def _params():
    p = llama.init_params(CFG, seed=3)
    qd, kvd = CFG.q_dim, CFG.kv_dim
    bias = np.random.default_rng(0).normal(0.0, 4.0, kvd).astype(np.float32)
    for lp in p["layers"]:
        lp["bqkv"] = lp["bqkv"].at[qd:qd + kvd].add(bias)   # every key gets a large offset
    return p


PARAMS = _params()
RNG = np.random.default_rng(77)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (29, 18)]
FP8 = dict(kv_dtype="float8_e4m3fn", page_size=4, selected_pages=4, round_steps=8,
           max_context=64)


def test_key_mean_matches_numpy():
    rng = np.random.default_rng(1)
    k = rng.normal(size=(3, 10, 2, 8)).astype(np.float32)
    lengths = np.array([10, 4, 0], np.int32)
    got = np.asarray(key_mean(jnp.asarray(k), jnp.asarray(lengths)))
    want = np.stack([k[b, :max(n, 1)].mean(0) if n else np.zeros((2, 8), np.float32)
                     for b, n in enumerate(lengths)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _layer0_qkv(tokens):
    """Layer 0's q, k, v of a token sequence, [T, heads, D] each (its input is the embedding
    alone, so no earlier layer is needed)."""
    x = llama.embed(PARAMS, CFG, jnp.asarray([tokens], jnp.int32))
    pos = jnp.arange(len(tokens), dtype=jnp.int32)[None]
    _, q, k, v = llama.attention_inputs(PARAMS["layers"][0], CFG, x, pos)
    return np.asarray(q[0]), np.asarray(k[0]), np.asarray(v[0])


def _stored_layer0(ctx, b):
    """Request b's stored K and V of layer 0, dequantized, [n, H, D] each (n: cached tokens)."""
    plan = ctx.plan
    H, ps, D, Np = CFG.num_kv_heads, plan.page_size, CFG.head_dim, plan.pages_per_seq
    rows = np.asarray(kv_quant.unpack_rows(jnp.asarray(np.asarray(ctx.kv_pages)), H, ps, D))[b * Np:(b + 1) * Np]
    kv = rows.transpose(1, 0, 3, 2, 4).reshape(2, Np * ps, H, D)[:, :ctx.cached[b]]
    return kv[0], kv[1]


@pytest.mark.parametrize("mode,dt,rot", [("resident", "float8_e4m3fn", False),
                                         ("host", "float8_e4m3fn", False), ("host", "int8", False),
                                         ("resident", "int8", True)])
def test_stored_keys_are_the_keys_less_the_prompt_mean(mode, dt, rot):
    """Layer 0's stored keys, prompt and decoded tokens alike, are q(k - mean of the
    prompt's keys) (the numpy reference of the quantization, fp8 or int8), rotated by the
    normalized Hadamard matrix with ``kv_key_rotation``, and the shift the summaries carry is
    that mean; the values are stored as they are."""
    cache = CacheConfig(mode=mode, selector="quest", kv_key_rotation=rot,
                        **{**FP8, "kv_dtype": dt})
    r = jaxkv.generate(CFG, PARAMS, PROMPTS, cache=cache, max_new_tokens=6, stop_tokens=[],
                       keep=True)
    ctx = r.context
    plan = ctx.plan
    _, shift, _ = selectors.split(ctx.summaries, plan)
    for b, prompt in enumerate(PROMPTS):
        n = ctx.cached[b]
        assert n > len(prompt)                                   # decoded tokens are stored too
        _, k, v = _layer0_qkv(list(ctx.tokens[b][:n]))           # [n, H, D]
        mean = k[:len(prompt)].mean(0)
        np.testing.assert_allclose(np.asarray(shift[0, b]), mean, rtol=1e-5, atol=1e-4)
        k_st, v_st = _stored_layer0(ctx, b)
        R = hadamard_np(k.shape[-1]) if rot else np.eye(k.shape[-1], dtype=np.float32)
        want = kv_quant.dequantize_np(*kv_quant.quantize_np((k - mean) @ R, dt))
        # one step of tolerance: the engine's keys and these differ in float rounding
        err = np.abs(k_st - want)
        if dt == "int8":   # a step is the vector's scale, at most 1/106.8 of its largest element
            step = np.abs(want).max(-1, keepdims=True) / 106.7
            assert (err <= step + 1e-6).all()
        else:
            assert (err <= 0.13 * np.abs(want) + 1e-3 * np.abs(want).max()).all()
        assert np.abs(k_st - k).max() > 1.0                      # not the unshifted keys
        v_tol = 5e-3 if dt == "int8" else 1e-3     # int8: half a step, <= 1/213 of the largest
        np.testing.assert_allclose(v_st, v, rtol=0.07, atol=v_tol * np.abs(v).max())


def hadamard_np(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


def test_hadamard_matches_numpy_and_is_orthogonal():
    R = np.asarray(kv_quant.hadamard(16))
    np.testing.assert_array_equal(R, hadamard_np(16))
    np.testing.assert_allclose(R @ R, np.eye(16), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        kv_quant.hadamard(12)


@pytest.mark.parametrize("kw", [dict(selector="quest", selection_lag=1, dense_layers=1),
                                dict(selector="quest_rescore8", selected_pages=3),
                                dict(selector="quest", kv_dtype="int8", kv_key_rotation=True,
                                     selection_lag=1, dense_layers=1)])
def test_fp8_host_equals_resident_with_the_shift(kw):
    """The host tier gives the resident run's tokens with the shift (lagged selection and a
    dense first layer; the two-stage selector)."""
    out = []
    for mode in ("host", "resident"):
        cache = CacheConfig(mode=mode, **{**FP8, **kw})
        out.append(jaxkv.generate(CFG, PARAMS, PROMPTS, cache=cache, max_new_tokens=8,
                                  stop_tokens=[]))
    assert out[0].tokens == out[1].tokens
    assert out[0].stats["misses"] > 0


def test_shift_brings_fp8_attention_closer_to_float32():
    """Attention of layer 0's last query over the stored keys: with the shift its error
    against the float32 keys is a fraction of the error without it (the keys' common
    component is not quantized)."""
    err = {}
    for shift in (True, False):
        cache = CacheConfig(mode="resident", selector="dense", kv_key_shift=shift,
                            **{**FP8, "selected_pages": 16})
        ctx = jaxkv.generate(CFG, PARAMS, PROMPTS, cache=cache, max_new_tokens=2,
                             stop_tokens=[], keep=True).context
        e = []
        for b in range(len(PROMPTS)):
            k_st, _ = _stored_layer0(ctx, b)
            q, k, v = _layer0_qkv(list(ctx.tokens[b][:ctx.cached[b]]))
            G = CFG.num_heads // CFG.num_kv_heads

            def attend(kk, vv):
                s = np.einsum("hd,thd->ht", q[-1], np.repeat(kk, G, axis=1)) / np.sqrt(CFG.head_dim)
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                return np.einsum("ht,thd->hd", p, np.repeat(vv, G, axis=1))
            ref = attend(k, v)
            e.append(np.linalg.norm(attend(k_st, v) - ref) / np.linalg.norm(ref))  # keys' share
        err[shift] = max(e)
    assert err[True] < 0.7 * err[False], err


def test_rotated_int8_keys_read_with_rotated_queries():
    """Layer 0's last query over the stored int8 keys: rotated keys read with the rotated
    query give the float32 keys' attention more closely than unrotated ones (the rotation is
    exact, and it spreads the keys' large channels)."""
    err, toks = {}, {}
    G = CFG.num_heads // CFG.num_kv_heads
    for rot in (True, False):
        cache = CacheConfig(mode="resident", selector="dense", kv_key_rotation=rot,
                            **{**FP8, "kv_dtype": "int8", "selected_pages": 16})
        ctx = jaxkv.generate(CFG, PARAMS, PROMPTS, cache=cache, max_new_tokens=2,
                             stop_tokens=[], keep=True).context
        R = hadamard_np(CFG.head_dim) if rot else np.eye(CFG.head_dim, dtype=np.float32)
        e = []
        for b in range(len(PROMPTS)):
            k_st, _ = _stored_layer0(ctx, b)
            q, k, v = _layer0_qkv(list(ctx.tokens[b][:ctx.cached[b]]))

            def attend(qq, kk):
                s = np.einsum("hd,thd->ht", qq, np.repeat(kk, G, axis=1)) / np.sqrt(CFG.head_dim)
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                return np.einsum("ht,thd->hd", p, np.repeat(v, G, axis=1))
            ref = attend(q[-1], k)
            e.append(np.linalg.norm(attend(q[-1] @ R, k_st) - ref) / np.linalg.norm(ref))
        err[rot] = max(e)
    assert err[True] < err[False], err


def test_context_keeps_its_shift_and_checks_the_setting():
    """A continued fp8 context carries its requests' shift (not a new mean), and continuing it
    with kv_key_shift changed fails naming the setting."""
    cache = CacheConfig(mode="host", selector="quest", **FP8)
    r = jaxkv.generate(CFG, PARAMS, PROMPTS, cache=cache, max_new_tokens=4, stop_tokens=[],
                       keep=True)
    more = [list(RNG.integers(3, CFG.vocab_size, 5)) for _ in PROMPTS]
    r2 = jaxkv.generate(CFG, PARAMS, more, cache=cache, context=r.context, max_new_tokens=3,
                        stop_tokens=[], keep=True)
    s1 = selectors.split(r.context.summaries, r.context.plan)[1]
    s2 = selectors.split(r2.context.summaries, r2.context.plan)[1]
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    with pytest.raises(ValueError, match="kv_key_shift"):
        jaxkv.generate(CFG, PARAMS, more, cache=CacheConfig(mode="host", selector="quest",
                                                             kv_key_shift=False, **FP8),
                       context=r.context, max_new_tokens=2)
    with pytest.raises(ValueError, match="kv_key_rotation"):
        jaxkv.generate(CFG, PARAMS, more, cache=CacheConfig(mode="host", selector="quest",
                                                             kv_key_rotation=True, **FP8),
                       context=r.context, max_new_tokens=2)


def test_default_shifts_the_keys_of_models_with_a_k_bias():
    """kv_key_shift=None: with quantized KV (fp8, int8) on for a model with a K bias (qwen2),
    off without one (llama); never for other dtypes; an explicit value wins."""
    from jaxkv.plan import Plan
    plain = configs.tiny()

    def shift(cfg, **kw):
        return Plan(model=cfg, cache=CacheConfig(**kw), batch=1, prompt_len=16, max_context=64,
                    num_stop=1).key_shift
    assert shift(CFG, kv_dtype="float8_e4m3fn") and not shift(plain, kv_dtype="float8_e4m3fn")
    assert shift(plain, kv_dtype="float8_e4m3fn", kv_key_shift=True)
    assert not shift(CFG, kv_dtype="float8_e4m3fn", kv_key_shift=False)
    assert not shift(CFG) and not shift(CFG, kv_dtype="bfloat16", kv_key_shift=True)
    assert shift(CFG, kv_dtype="int8") and not shift(plain, kv_dtype="int8")
    assert shift(plain, kv_dtype="int8", kv_key_shift=True)


def test_default_rotates_fp8_keys_that_are_not_shifted():
    """kv_key_rotation=None: on for fp8 keys without the shift (SmolLM2 on RULER: 95.6% of the
    bf16 retrievals kept against 92.4%), off for shifted fp8 keys, int8 and unquantized KV;
    an explicit value wins."""
    from jaxkv.plan import Plan
    plain = configs.tiny()

    def rot(cfg, **kw):
        return Plan(model=cfg, cache=CacheConfig(**kw), batch=1, prompt_len=16, max_context=64,
                    num_stop=1).key_rotation
    for fp8 in ("float8_e4m3fn", "float8_e5m2"):
        assert rot(plain, kv_dtype=fp8) and not rot(CFG, kv_dtype=fp8)      # CFG: a K bias
        assert rot(CFG, kv_dtype=fp8, kv_key_shift=False)
        assert not rot(plain, kv_dtype=fp8, kv_key_shift=True)
        assert not rot(plain, kv_dtype=fp8, kv_key_rotation=False)
        assert rot(CFG, kv_dtype=fp8, kv_key_rotation=True)
    assert not rot(plain, kv_dtype="int8") and rot(plain, kv_dtype="int8", kv_key_rotation=True)
    assert not rot(plain) and not rot(plain, kv_dtype="bfloat16", kv_key_rotation=True)


def test_shift_only_with_fp8():
    """kv_key_shift changes nothing for other KV dtypes (no shift array either)."""
    a = jaxkv.generate(CFG, PARAMS, PROMPTS, cache=CacheConfig(
        mode="host", selector="quest", page_size=4, selected_pages=4, max_context=64),
        max_new_tokens=5, stop_tokens=[], keep=True)
    b = jaxkv.generate(CFG, PARAMS, PROMPTS, cache=CacheConfig(
        mode="host", selector="quest", page_size=4, selected_pages=4, max_context=64,
        kv_key_shift=False), max_new_tokens=5, stop_tokens=[], keep=True)
    assert a.tokens == b.tokens
    assert len(a.context.summaries) == len(b.context.summaries)
    with pytest.raises(ValueError, match="kv_key_shift must be None or a bool"):
        CacheConfig(kv_key_shift="yes")
    with pytest.raises(ValueError, match="kv_key_rotation must be None or a bool"):
        CacheConfig(kv_key_rotation="yes")
