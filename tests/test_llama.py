"""Tests for jaxkv.models.configs and jaxkv.models.llama (functional Llama-family model)."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import configs
from jaxkv.models import llama
from jaxkv.models.configs import ModelConfig, get_config, tiny, with_indexer

_fwd = jax.jit(llama.forward, static_argnums=(1, 4))
_rope = jax.jit(llama.apply_rope, static_argnums=(2, 3))

KNOWN_NUM_PARAMS = {  # published parameter counts
    "smollm2-135m": 134_515_008,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama3-8b": 8_030_261_248,
}


def _seed() -> int:
    """A fresh random seed per test (printed, so pytest shows it when a test fails)."""
    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"seed={seed}")
    return seed


def _cast(params, dtype):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), params)


def _relerr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --------------------------------------------------------------------------- configs

def _expected_shapes(cfg: ModelConfig) -> dict:
    L, d, V, F = cfg.num_layers, cfg.d_model, cfg.vocab_size, cfg.ffn_dim
    Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = Hq * D + 2 * H * D
    lay = {"attn_norm": (d,), "wqkv": (d, qkv), "wo": (Hq * D, d), "mlp_norm": (d,),
           "w_gate_up": (d, 2 * F), "w_down": (F, d)}
    if cfg.qkv_bias:
        lay |= {"bqkv": (qkv,)}
    if cfg.indexer_heads:
        hi, di = cfg.indexer_heads, cfg.indexer_dim
        lay |= {"idx_wq": (d, hi * di), "idx_wk": (d, di), "idx_knorm_w": (di,),
                "idx_knorm_b": (di,), "idx_ww": (d, hi)}
    out = {"embed": (V, d), "layers": tuple(dict(lay) for _ in range(L)), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (d, V)
    return out


@pytest.mark.parametrize("name", sorted(configs.PRESETS))
@pytest.mark.parametrize("indexer", [False, True])
def test_preset_param_shapes(name, indexer):
    cfg = get_config(name)
    if indexer:
        cfg = with_indexer(cfg, heads=64, dim=128)
    shapes = llama.param_shapes(cfg)
    got = jax.tree_util.tree_map(lambda s: tuple(s.shape), shapes)
    assert got == _expected_shapes(cfg)
    dts = {s.dtype for s in jax.tree_util.tree_leaves(shapes)}
    assert dts == {jnp.dtype(cfg.dtype)}
    n = llama.num_params(cfg)
    assert n == sum(math.prod(s) for s in jax.tree_util.tree_leaves(
        _expected_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)))
    if name in KNOWN_NUM_PARAMS and not indexer:
        assert n == KNOWN_NUM_PARAMS[name]


def test_preset_values():
    s = configs.smollm2_135m()
    assert (s.num_layers, s.d_model, s.ffn_dim, s.num_heads, s.num_kv_heads, s.head_dim) == \
        (30, 576, 1536, 9, 3, 64)
    assert (s.rope_theta, s.rms_eps, s.vocab_size, s.tie_embeddings, s.max_position,
            s.bos_id, s.eos_id, s.group_size) == (1e5, 1e-5, 49152, True, 8192, 1, 2, 3)
    q = configs.qwen2_5_1_5b()
    assert (q.num_layers, q.d_model, q.ffn_dim, q.num_heads, q.num_kv_heads, q.head_dim,
            q.rope_theta, q.rms_eps, q.vocab_size, q.qkv_bias, q.tie_embeddings) == \
        (28, 1536, 8960, 12, 2, 128, 1e6, 1e-6, 151936, True, True)
    m = configs.llama3_8b()
    assert (m.num_layers, m.d_model, m.ffn_dim, m.num_heads, m.num_kv_heads, m.head_dim,
            m.rope_theta, m.rms_eps, m.vocab_size, m.tie_embeddings) == \
        (32, 4096, 14336, 32, 8, 128, 5e5, 1e-5, 128256, False)
    for c in (s, q, m, tiny()):
        assert c.indexer_heads == 0 and c.indexer_dim == 0 and not c.has_indexer


def test_get_config_and_overrides():
    assert get_config("SmolLM2_135M") == configs.smollm2_135m()
    assert get_config("qwen2_5_1_5b") == configs.qwen2_5_1_5b()
    c = get_config("tiny", dtype="bfloat16", num_layers=3)
    assert c.dtype == "bfloat16" and c.num_layers == 3
    assert hash(c) == hash(get_config("tiny", dtype="bfloat16", num_layers=3))
    with pytest.raises(ValueError, match="unknown model preset"):
        get_config("gpt5")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        get_config("tiny", n_layers=3)
    ci = with_indexer(tiny(), heads=4, dim=8)
    assert (ci.indexer_heads, ci.indexer_dim, ci.has_indexer) == (4, 8, True)
    assert ci == dataclasses.replace(tiny(), indexer_heads=4, indexer_dim=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 1


@pytest.mark.parametrize("kw,match", [
    (dict(num_heads=5), "multiple of num_kv_heads"),
    (dict(dtype="float16"), "dtype must be one of"),
    (dict(head_dim=15), "even"),
    (dict(d_model=0), "d_model must be a positive int"),
    (dict(num_layers=2.0), "num_layers must be a positive int"),
    (dict(rope_theta=-1.0), "rope_theta must be a positive"),
    (dict(tie_embeddings=1), "tie_embeddings must be a bool"),
    (dict(eos_id=256), "must be < vocab_size"),
    (dict(indexer_heads=4), "both be 0"),
    (dict(indexer_dim=-1), "indexer_dim must be a non-negative"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(tiny(), **kw)


def test_init_params_seeded():
    cfg = tiny(qkv_bias=True)
    a, b, c = llama.init_params(cfg, 3), llama.init_params(cfg, 3), llama.init_params(cfg, 4)
    for x, y, z in zip(*(jax.tree_util.tree_leaves(t) for t in (a, b, c))):
        np.testing.assert_array_equal(x, y)
    sa, sc = llama.stacked_layers(a, cfg), llama.stacked_layers(c, cfg)
    for n in ("wq", "wo", "bk", "w_down"):
        assert not np.array_equal(sa[n], sc[n])
        std = float(np.std(sa[n]))
        assert 0 < std < 1 and np.isfinite(sa[n]).all()
    assert not np.array_equal(sa["wq"][0], sa["wq"][1])  # layers are drawn independently
    np.testing.assert_array_equal(sa["attn_norm"], 1.0)
    np.testing.assert_array_equal(a["final_norm"], 1.0)
    assert a["embed"].dtype == jnp.float32
    assert llama.init_params(tiny(dtype="bfloat16"), 3)["embed"].dtype == jnp.bfloat16
    with pytest.raises(TypeError):
        llama.init_params(cfg, 1.5)


# --------------------------------------------------------------------------- RoPE

def _np_rope(x, pos, theta):
    """Direct rotation: pair (j, j + D/2) rotated by pos * theta**(-2j/D), float64."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    half = D // 2
    out = np.empty_like(x)
    for j in range(half):
        ang = np.asarray(pos, np.float64) * theta ** (-2.0 * j / D)  # [B, T]
        c, s = np.cos(ang)[..., None], np.sin(ang)[..., None]
        rot = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)  # [B, T, 1, 2, 2]
        pair = np.stack([x[..., j], x[..., j + half]], -1)[..., None]  # [B, T, N, 2, 1]
        r = (rot @ pair)[..., 0]
        out[..., j], out[..., j + half] = r[..., 0], r[..., 1]
    return out


def _within_angle_bound(got, want, x):
    """Each output within rope_angles' documented angle error times the norm of its rotated
    pair (the error grows with the position): row 0 holds positions < 4096 (1.5e-4 rad), row
    1 positions < 200,000 (4e-4 rad)."""
    half = x.shape[-1] // 2
    pair = np.hypot(x[..., :half], x[..., half:])
    pair = np.concatenate([pair, pair], -1)
    for row, rad in ((0, 1.5e-4), (1, 4e-4)):
        err = np.abs(np.asarray(got[row], np.float64) - want[row])
        assert np.all(err <= rad * pair[row] + 1e-6), (row, float(np.max(err / pair[row])))


def test_rope_matches_numpy():
    rng = np.random.default_rng(_seed())
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    pos = np.stack([rng.integers(0, 4096, 5), rng.integers(0, 200_000, 5)]).astype(np.int32)
    theta = 10000.0
    got = _rope(x, pos, theta)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    _within_angle_bound(got, _np_rope(x, pos, theta), x)
    # large positions stay accurate (a plain f32 pos * freq product would be ~0.1 rad off)
    big = np.array([[1_000_000, 999_999, 123_457, 2**20, 7]], np.int32)
    xb = x[:1]
    np.testing.assert_allclose(_rope(xb, big, 1e6), _np_rope(xb, big, 1e6),
                               atol=3e-3, rtol=0)
    # partial rotation leaves the tail untouched
    part = _rope(x, pos, theta, 8)
    _within_angle_bound(part[..., :8], _np_rope(x[..., :8], pos, theta), x[..., :8])
    np.testing.assert_array_equal(part[..., 8:], x[..., 8:])


def test_attention_inputs_with_shared_rope_tables():
    """The tables computed once (``model_rope_tables``) give each layer the same q and k as
    computing them per call, yarn's attention factor included."""
    scaled = dataclasses.replace(configs.tiny(), rope_scaling=configs.RopeScaling(
        "yarn", factor=4.0, original_max_position=64))
    for cfg in (configs.tiny(), scaled):
        params = llama.init_params(cfg, seed=_seed() % 1000)
        rng = np.random.default_rng(_seed())
        x = jnp.asarray(rng.standard_normal((2, 3, cfg.d_model)), cfg.dtype)
        pos = jnp.asarray(rng.integers(0, 5000, (2, 3)), jnp.int32)
        tables = llama.model_rope_tables(cfg, pos)
        for lp in params["layers"][:2]:
            want = llama.attention_inputs(lp, cfg, x, pos)
            got = llama.attention_inputs(lp, cfg, x, pos, rope=tables)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="tables must be"):
        llama.apply_rope(jnp.zeros((1, 1, 2, 2 * cfg.head_dim)), pos[:1, :1], 1e4, tables=tables)


def test_rope_relative_position():
    """q(m) . k(n) depends only on m - n."""
    rng = np.random.default_rng(_seed())
    q = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
    dots = []
    for off in (0, 1, 4097, 300_000):
        m = np.array([[off + 37]], np.int32)
        n = np.array([[off + 5]], np.int32)
        qr, kr = (np.asarray(_rope(a, p, 1e5), np.float64) for a, p in ((q, m), (k, n)))
        dots.append(float(np.sum(qr * kr)))
    np.testing.assert_allclose(dots, dots[0], atol=2e-3 * np.abs(dots[0]) + 1e-3)


def test_attention_inputs_match_numpy():
    seed = _seed()
    cfg = tiny(qkv_bias=True)
    params = llama.init_params(cfg, seed)
    lp = params["layers"][1]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, cfg.d_model)).astype(np.float32)
    pos = rng.integers(0, 3000, (2, 4)).astype(np.int32)
    h, q, k, v = jax.jit(llama.attention_inputs, static_argnums=1)(lp, cfg, x, pos)
    np_lp = {n: np.asarray(a, np.float64) for n, a in llama.unfuse_layer(lp, cfg).items()}
    hn = x / np.sqrt(np.mean(np.float64(x) ** 2, -1, keepdims=True) + cfg.rms_eps) \
        * np_lp["attn_norm"]
    B, T, D = 2, 4, cfg.head_dim
    qn = _np_rope((hn @ np_lp["wq"] + np_lp["bq"]).reshape(B, T, cfg.num_heads, D), pos,
                  cfg.rope_theta)
    kn = _np_rope((hn @ np_lp["wk"] + np_lp["bk"]).reshape(B, T, cfg.num_kv_heads, D), pos,
                  cfg.rope_theta)
    vn = (hn @ np_lp["wv"] + np_lp["bv"]).reshape(B, T, cfg.num_kv_heads, D)
    assert h.shape == (B, T, cfg.d_model) and q.shape == (B, T, 4, D)
    assert k.shape == v.shape == (B, T, 2, D)
    for got, want in ((h, hn), (q, qn), (k, kn), (v, vn)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


# --------------------------------------------------------------------------- attention

def _np_attention(q, k, v, mask):
    """Reference with explicit repeat_kv: query head i uses KV head i // G."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    used = mask.any(1)[:, :, None, None]  # keys some query attends to
    k, v = np.where(used, k, 0), np.where(used, v, 0)
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    mx = np.max(s, -1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.where(mask[:, None], np.exp(s - mx), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.parametrize("hq,h", [(9, 3), (4, 2), (4, 4)])
def test_gqa_attention_matches_repeat_kv(hq, h):
    rng = np.random.default_rng(_seed())
    B, T, S, D = 2, 3, 8, 16
    q = rng.standard_normal((B, T, hq, D)).astype(np.float32)
    k = rng.standard_normal((B, S, h, D)).astype(np.float32)
    v = rng.standard_normal((B, S, h, D)).astype(np.float32)
    mask = rng.random((B, T, S)) < 0.6
    mask[0, 1] = False  # a query with no keys -> zeros
    mask[:, :, 6:] = False
    k[:, 6:] = np.nan  # keys no query uses may hold garbage
    v[:, 6:] = np.nan
    got = np.asarray(jax.jit(llama.gqa_attention)(q, k, v, mask))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _np_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[0, 1], 0.0)


# --------------------------------------------------------------------------- forward

@pytest.fixture(scope="module")
def tiny_params():
    return llama.init_params(tiny(), 1234)


B_, T_ = 2, 12  # the shape of most forward tests (one compile per config)


def _pos(B, T):
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def test_forward_f32_and_bf16(tiny_params):
    cfg = tiny()
    rng = np.random.default_rng(_seed())
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B_, T_)), jnp.int32)
    lf, carry = _fwd(tiny_params, cfg, tok, _pos(B_, T_), llama.dense_attend, None)
    assert carry is None and lf.shape == (B_, T_, cfg.vocab_size) and lf.dtype == jnp.float32
    assert np.isfinite(np.asarray(lf)).all() and float(jnp.std(lf)) > 0.1
    cb = dataclasses.replace(cfg, dtype="bfloat16")
    pb = _cast(tiny_params, jnp.bfloat16)
    lb, _ = _fwd(pb, cb, tok, _pos(B_, T_), llama.dense_attend, None)
    assert lb.dtype == jnp.float32 and lb.shape == lf.shape
    assert _relerr(lb, lf) < 3e-2
    # bf16 activations really are bf16
    lp0 = pb["layers"][0]
    x, q, k, v = jax.eval_shape(
        lambda p, lp, t, ps: (lambda x: (x,) + llama.attention_inputs(lp, cb, x, ps)[1:])(
            llama.embed(p, cb, t)), pb, lp0, tok, _pos(B_, T_))
    assert x.dtype == q.dtype == k.dtype == v.dtype == jnp.bfloat16


def test_untied_lm_head():
    cfg = tiny(tie_embeddings=False)
    params = llama.init_params(cfg, _seed())
    x = jnp.ones((1, 2, cfg.d_model))
    lg = jax.jit(llama.final_logits, static_argnums=1)(params, cfg, x)
    h = np.asarray(x) / np.sqrt(1.0 + cfg.rms_eps)  # final_norm is ones
    np.testing.assert_allclose(lg, h @ np.asarray(params["lm_head"]), rtol=1e-5, atol=1e-5)


def test_causal_masking(tiny_params):
    cfg = tiny()
    rng = np.random.default_rng(_seed())
    t0 = 7
    tok = rng.integers(0, cfg.vocab_size, (1, T_)).astype(np.int32)
    tok2 = tok.copy()
    tok2[0, t0] = (tok[0, t0] + 1 + rng.integers(0, cfg.vocab_size - 1)) % cfg.vocab_size
    both = jnp.asarray(np.concatenate([tok, tok2]))
    lg, _ = _fwd(tiny_params, cfg, both, _pos(B_, T_), llama.dense_attend, None)
    lg = np.asarray(lg)
    np.testing.assert_allclose(lg[0, :t0], lg[1, :t0], atol=1e-6, rtol=0)
    assert np.all(np.max(np.abs(lg[0, t0:] - lg[1, t0:]), axis=-1) > 1e-4)


def test_dense_attend_lengths(tiny_params):
    """Right padding with per-request lengths: the valid logits ignore the padding."""
    cfg = tiny()
    rng = np.random.default_rng(_seed())
    n0 = 5
    tok = rng.integers(0, cfg.vocab_size, (B_, T_)).astype(np.int32)
    tok_b = tok.copy()
    tok_b[0, n0:] = rng.integers(0, cfg.vocab_size, T_ - n0)  # other padding garbage
    lens = jnp.asarray([n0, T_], jnp.int32)
    lg, carry = _fwd(tiny_params, cfg, jnp.asarray(tok), _pos(B_, T_), llama.dense_attend, lens)
    np.testing.assert_array_equal(carry, lens)
    lg_b, _ = _fwd(tiny_params, cfg, jnp.asarray(tok_b), _pos(B_, T_), llama.dense_attend, lens)
    full, _ = _fwd(tiny_params, cfg, jnp.asarray(tok), _pos(B_, T_), llama.dense_attend, None)
    np.testing.assert_allclose(lg[0, :n0], lg_b[0, :n0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(lg[0, :n0], full[0, :n0], atol=1e-5, rtol=1e-5)  # causal
    np.testing.assert_allclose(lg[1], full[1], atol=1e-5, rtol=1e-5)
    # a request of length 0 stays finite
    lg0, _ = _fwd(tiny_params, cfg, jnp.asarray(tok), _pos(B_, T_), llama.dense_attend,
                  jnp.asarray([0, 3], jnp.int32))
    assert np.isfinite(np.asarray(lg0)).all()


# ----------------------------------------------------- forward == incremental decoding

def _cache_attend(layer, layer_params, h, q, k, v, carry):
    """A simple KV list cache: write this call's k/v at their positions, attend to <= pos.

    carry: {"k", "v": [L, B, Tmax, H, D], "pos": [B, T] int32 positions of this call}.
    """
    pos = carry["pos"]
    b = jnp.arange(pos.shape[0])[:, None]
    kc = carry["k"].at[layer, b, pos].set(k)
    vc = carry["v"].at[layer, b, pos].set(v)
    mask = jnp.arange(kc.shape[2])[None, None, :] <= pos[:, :, None]
    attn = llama.gqa_attention(q, kc[layer], vc[layer], mask)
    return attn, {"k": kc, "v": vc, "pos": pos}


@pytest.mark.parametrize("variant", ["f32", "gqa3_bias", "bf16"])
def test_forward_equals_incremental_decode(variant):
    """Dense forward over whole sequences == decoding with a KV cache through `attend`.

    "f32": prefill of different prompt lengths (3 and 6; request 0's prefill is padded), then
    token-by-token decode with the two requests at different positions in every step.
    Other variants: token-by-token from position 0. The cache starts NaN-poisoned.
    """
    seed = _seed()
    cfg = {"f32": tiny(), "gqa3_bias": tiny(num_heads=9, num_kv_heads=3, qkv_bias=True),
           "bf16": tiny(dtype="bfloat16")}[variant]
    if variant == "gqa3_bias":
        assert cfg.group_size == 3
    params = llama.init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompt_lens = np.array([3, 6]) if variant == "f32" else np.array([0, 0])
    P, Tmax = int(prompt_lens.max()), 16
    steps = T_ - P
    N = prompt_lens + steps  # full lengths; the longest is T_
    seqs = rng.integers(0, cfg.vocab_size, (B_, T_)).astype(np.int32)
    lens = None if N.min() == T_ else jnp.asarray(N, jnp.int32)
    ref, _ = _fwd(params, cfg, jnp.asarray(seqs), _pos(B_, T_), llama.dense_attend, lens)
    ref = np.asarray(ref)

    shape = (cfg.num_layers, B_, Tmax, cfg.num_kv_heads, cfg.head_dim)
    dt = jnp.dtype(cfg.dtype)
    cache = {"k": jnp.full(shape, jnp.nan, dt), "v": jnp.full(shape, jnp.nan, dt)}

    @jax.jit
    def step(params, cache, tok, pos):
        return llama.forward(params, cfg, tok, pos, _cache_attend, {**cache, "pos": pos})

    got = {}
    if P:  # prefill: request 0's tokens 3..5 are padding at positions 3..5 (overwritten later)
        pre_tok = seqs[:, :P].copy()
        pre_tok[0, prompt_lens[0]:] = rng.integers(0, cfg.vocab_size, P - prompt_lens[0])
        lg, carry = step(params, cache, jnp.asarray(pre_tok), _pos(B_, P))
        got |= {(b, t): np.asarray(lg[b, t]) for b in range(B_) for t in range(prompt_lens[b])}
        cache = {"k": carry["k"], "v": carry["v"]}
    for i in range(steps):
        pos = prompt_lens + i
        tok = seqs[np.arange(B_), pos][:, None]
        lg, carry = step(params, cache, jnp.asarray(tok), jnp.asarray(pos[:, None], jnp.int32))
        assert carry["k"].dtype == dt
        cache = {"k": carry["k"], "v": carry["v"]}
        got |= {(b, int(pos[b])): np.asarray(lg[b, 0]) for b in range(B_)}
    assert sorted(got) == [(b, t) for b in range(B_) for t in range(int(N[b]))]
    g = np.stack([got[key] for key in sorted(got)])
    r = np.stack([ref[key] for key in sorted(got)])
    assert np.isfinite(g).all()
    if variant == "bf16":
        assert _relerr(g, r) < 3e-2
    else:
        np.testing.assert_allclose(g, r, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("start,stop", [(0, 3), (1, 3)])
def test_rolled_weights_switch_equals_stack_and_unrolled(start, stop):
    """A rolled layer loop reading each matrix through a per-layer switch ("switch", the CPU
    default) == stacked weights ("stack") == the unrolled loop, with an attend that uses the
    layer index and the indexer's projections (their matrices are switched too)."""
    seed = _seed()
    cfg = with_indexer(tiny(num_layers=3, num_heads=9, num_kv_heads=3, qkv_bias=True),
                       heads=4, dim=16)
    params = llama.init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B_, 4, cfg.d_model)), jnp.float32)
    shape = (cfg.num_layers, B_, 4, cfg.num_kv_heads, cfg.head_dim)
    carry = {"k": jnp.zeros(shape), "v": jnp.zeros(shape), "pos": _pos(B_, 4)}

    def attend(layer, lp, h, q, k, v, c):
        attn, c = _cache_attend(layer, lp, h, q, k, v, c)
        qi, w, _ = llama.indexer_inputs(lp, cfg, h, c["pos"])
        return attn + 1e-3 * jnp.sum(w)[..., None, None, None] * qi.sum(), c

    def run(weights, unroll):
        f = lambda p, x, c: llama.run_layers(p, cfg, x, _pos(B_, 4), attend, c,  # noqa: E731
                                             start=start, stop=stop, unroll=unroll,
                                             weights=weights)
        return jax.jit(f)(params, x, carry), jax.jit(f).lower(params, x, carry).as_text()

    (x_sw, c_sw), txt = run("switch", 1)
    (x_st, c_st), _ = run("stack", 1)
    (x_un, c_un), _ = run(None, stop - start)
    assert "case" in txt  # one lax.switch per matrix product
    for got in ((x_st, c_st), (x_un, c_un)):
        np.testing.assert_allclose(x_sw, got[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(c_sw["k"], got[1]["k"], rtol=1e-6, atol=1e-6)
    assert llama.rolled_weights("stack") == "stack"
    assert llama.rolled_weights() == ("stack" if jax.default_backend() == "gpu" else "switch")
    with pytest.raises(ValueError, match="rolled_weights must be"):
        llama.rolled_weights("scan")


# --------------------------------------------------------------------------- indexer

def test_indexer_inputs():
    seed = _seed()
    cfg = with_indexer(tiny(), heads=8, dim=16)
    params = llama.init_params(cfg, seed)
    lp = params["layers"][0]
    rng = np.random.default_rng(seed)
    B, T = 2, 5
    h = rng.standard_normal((B, T, cfg.d_model)).astype(np.float32)
    pos = rng.integers(0, 1000, (B, T)).astype(np.int32)
    f = jax.jit(llama.indexer_inputs, static_argnums=1, static_argnames="rope_dims")
    q, w, k = f(lp, cfg, h, pos)
    assert q.shape == (B, T, 8, 16) and w.shape == (B, T, 8) and k.shape == (B, T, 16)
    assert q.dtype == k.dtype == jnp.float32 and w.dtype == jnp.float32
    np.testing.assert_allclose(q, (h @ np.asarray(lp["idx_wq"])).reshape(B, T, 8, 16),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(w, h @ np.asarray(lp["idx_ww"]) / np.sqrt(8), atol=1e-5,
                               rtol=1e-5)
    kr = h @ np.asarray(lp["idx_wk"], np.float64)
    kn = (kr - kr.mean(-1, keepdims=True)) / np.sqrt(kr.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(k, kn, atol=1e-4, rtol=1e-4)
    # optional RoPE on the first rope_dims features
    qr, wr, kr2 = f(lp, cfg, h, pos, rope_dims=8)
    np.testing.assert_array_equal(wr, w)
    np.testing.assert_allclose(qr[..., :8], _np_rope(q[..., :8], pos, cfg.rope_theta), atol=1e-4)
    np.testing.assert_array_equal(qr[..., 8:], q[..., 8:])
    np.testing.assert_allclose(kr2[..., :8], _np_rope(k[:, :, None, :8], pos,
                                                      cfg.rope_theta)[:, :, 0], atol=1e-4)
    # bf16 config: index vectors in bf16, weights f32
    cb = dataclasses.replace(cfg, dtype="bfloat16")
    qb, wb, kb = f(_cast(lp, jnp.bfloat16), cb, jnp.asarray(h, jnp.bfloat16), pos)
    assert qb.dtype == kb.dtype == jnp.bfloat16 and wb.dtype == jnp.float32
    with pytest.raises(ValueError, match="no indexer"):
        llama.indexer_inputs(lp, tiny(), h, pos)


def test_indexer_params_do_not_change_forward(tiny_params):
    """Indexer params ride along in the layer tree; the forward ignores them."""
    cfg = with_indexer(tiny(), heads=4, dim=8)
    p = llama.init_params(cfg, 1234)
    p = {**p, "embed": tiny_params["embed"], "final_norm": tiny_params["final_norm"],
         "layers": tuple({**a, **b} for a, b in zip(p["layers"], tiny_params["layers"]))}
    tok = jnp.arange(B_ * T_, dtype=jnp.int32).reshape(B_, T_)
    a, _ = _fwd(p, cfg, tok, _pos(B_, T_), llama.dense_attend, None)
    b, _ = _fwd(tiny_params, tiny(), tok, _pos(B_, T_), llama.dense_attend, None)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_smollm2_shape_forward_equals_decode():
    """SmolLM2-135M shapes (random bf16 weights): dense forward vs prefill + decode on GPU,
    and the tiny f32 model on GPU vs CPU (TF32 matmuls allowed)."""
    cfg = configs.smollm2_135m()
    params = llama.init_params(cfg, 0)
    rng = np.random.default_rng(0)
    B, P, steps, Tmax = 2, 48, 16, 64
    seqs = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P + steps)), jnp.int32)
    ref, _ = _fwd(params, cfg, seqs, _pos(B, P + steps), llama.dense_attend, None)
    shape = (cfg.num_layers, B, Tmax, cfg.num_kv_heads, cfg.head_dim)
    cache = {"k": jnp.zeros(shape, jnp.bfloat16), "v": jnp.zeros(shape, jnp.bfloat16)}

    @jax.jit
    def step(params, cache, tok, pos):
        return llama.forward(params, cfg, tok, pos, _cache_attend, {**cache, "pos": pos})

    lg, c = step(params, cache, seqs[:, :P], _pos(B, P))
    outs = [lg]
    for i in range(steps):
        pos = jnp.full((B, 1), P + i, jnp.int32)
        lg, c = step(params, {"k": c["k"], "v": c["v"]}, seqs[:, P + i:P + i + 1], pos)
        outs.append(lg)
    got = jnp.concatenate(outs, axis=1)
    assert _relerr(got, ref) < 5e-2

    cpu = jax.devices("cpu")[0]
    tc = tiny()
    tp = llama.init_params(tc, 1)
    tok = jnp.asarray(rng.integers(0, tc.vocab_size, (2, 32)), jnp.int32)
    g, _ = _fwd(tp, tc, tok, _pos(2, 32), llama.dense_attend, None)
    with jax.default_device(cpu):
        cref, _ = _fwd(jax.device_put(tp, cpu), tc, jax.device_put(tok, cpu),
                       jax.device_put(_pos(2, 32), cpu), llama.dense_attend, None)
    assert _relerr(g, cref) < 1e-2


@pytest.mark.gpu
def test_gpu_big_model_random_init():
    """Models over 2**28 parameters are initialised with jax.random on the device."""
    cfg = configs.qwen2_5_1_5b()
    assert llama.num_params(cfg) > llama._NUMPY_INIT_MAX
    params = llama.init_params(cfg, 0)
    got = jax.tree_util.tree_map(lambda a: (tuple(a.shape), a.dtype), params)
    want = jax.tree_util.tree_map(lambda s: (tuple(s.shape), s.dtype), llama.param_shapes(cfg))
    assert got == want
    wq = np.asarray(llama.unfuse_layer(params["layers"][0], cfg)["wq"], np.float32)
    assert np.isfinite(wq).all() and abs(float(wq.std()) * math.sqrt(cfg.d_model) - 1) < 0.05
    tok = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    lg, _ = _fwd(params, cfg, tok, _pos(2, 16), llama.dense_attend, None)
    assert lg.shape == (2, 16, cfg.vocab_size) and np.isfinite(np.asarray(lg)).all()
