"""Functional Llama-family decoder over a params pytree (plain nested dicts of jnp arrays).

``params["layers"]`` holds one dict per layer (see "parameters" below) and `forward` runs
them in order, calling the caller's `attend` for attention, so the KV cache (in `attend`'s carry) is not this
module's business. Weights are stored input-major (`y = x @ W`, the transpose of a torch
`nn.Linear` weight). Query head `i` reads KV head `i // group_size`. RoPE is the half-split
(NeoX / HF `rotate_half`) convention. Shapes: `B` requests, `T` tokens, `d` d_model,
`Hq`/`H` query/KV heads, `D` head_dim, `F` ffn_dim, `V` vocab, `H_I`/`dI` indexer heads/dim.

Numerics: parameters and activations in `cfg.dtype`; matmuls accumulate in float32;
norms, RoPE, softmax and logits are computed in float32.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import _common
from ..kernels.prefill_attention import gqa_attention  # noqa: F401 - part of the model API
from .configs import ModelConfig, RopeScaling

Params = dict[str, Any]
# attend(layer i32[], layer_params, h [B,T,d], q [B,T,Hq,D], k [B,T,H,D], v [B,T,H,D], carry)
#   -> (attn [B,T,Hq,D], carry)
AttendFn = Callable[..., tuple[jax.Array, Any]]

INDEXER_LN_EPS = 1e-6  # eps of the indexer key LayerNorm
_ROPE_SPLIT = 1024  # positions are split as a * 1024 + b for accurate RoPE angles


def _dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


class LayerWeight:
    """One weight matrix per layer, chosen by a traced layer index inside a rolled layer loop
    (``run_layers(..., weights="switch")``): ``_matmul`` applies it as a ``lax.switch``
    over one product per layer, so each product reads its layer's array in place (no copy
    of a slice of stacked weights)."""

    def __init__(self, index, arrays: tuple):
        self.index, self.arrays = index, tuple(arrays)

    @property
    def dtype(self):
        return self.arrays[0].dtype


def _matmul(spec: str, x, w):
    """einsum in the operands' dtype, result float32 (``w``: an array or a ``LayerWeight``).

    For bf16 operands the product is returned in bf16 (the GPU kernels accumulate in f32)
    and then upcast: asking XLA for an f32 result directly (preferred_element_type) makes
    XLA:GPU convert the whole weight matrix to f32 on every call, which triples the bytes a
    memory-bound decode step reads."""
    if isinstance(w, LayerWeight):
        products = [functools.partial(_matmul, spec, w=a) for a in w.arrays]
        return jax.lax.switch(w.index, products, x)
    if x.dtype == jnp.float32 or w.dtype == jnp.float32:
        return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32),
                          preferred_element_type=jnp.float32)
    return jnp.einsum(spec, x, w.astype(x.dtype)).astype(jnp.float32)


def _proj(x, w, b=None):
    """x [..., i] @ w [i, o] (+ b [o]) -> [..., o] float32 (f32 accumulation)."""
    y = _matmul("...i,io->...o", x, w)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y


def rms_norm(x, w, eps: float):
    """RMSNorm over the last axis: x [..., n] (any float dtype), w [n] -> [..., n] float32."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return xf * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32)


def _layer_norm(x, w, b, eps: float):
    """LayerNorm over the last axis: x [..., n], w [n], b [n] -> [..., n] float32."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mu
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)


def rope_angles(positions, rot_dim: int, theta: float, scaling: RopeScaling | None = None):
    """Rotation angles `positions * inv[j]`: positions [B, T] int -> [B, T, rot_dim//2] f32, with
    `inv[j] = theta**(-2j/rot_dim)`, scaled by `scaling` (a `RopeScaling`) when given.

    Computed as `a * (S * inv mod 2pi) + b * inv` with `positions = a * S + b` (S = 1024), the
    constants in float64 on the host: the angle error is <= ~1e-4 rad up to 1e5 positions
    and ~7e-4 at 1e6 (a plain float32 `pos * inv` product: 7e-3 and 0.06 rad).
    """
    if scaling is None:
        inv = 1.0 / (float(theta) ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    else:
        inv = scaling.inv_freq(theta, rot_dim)
    big = np.mod(inv * _ROPE_SPLIT, 2 * np.pi)
    pos = positions.astype(jnp.int32)
    a = (pos // _ROPE_SPLIT).astype(jnp.float32)[..., None]
    b = (pos % _ROPE_SPLIT).astype(jnp.float32)[..., None]
    return a * jnp.asarray(big, jnp.float32) + b * jnp.asarray(inv, jnp.float32)


def rope_tables(positions, rot_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos and sin of the rotation angles (:func:`rope_angles`) at positions [B, T]:
    ([B, T, 1, rot_dim // 2] float32) * 2, multiplied by ``scaling.attention_factor`` (yarn)."""
    ang = rope_angles(positions, rot_dim, theta, scaling)[:, :, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def model_rope_tables(cfg: ModelConfig, positions):
    """The RoPE tables of the model's attention heads at positions [B, T] (one pair for every
    layer: :func:`attention_inputs` takes them as ``rope``)."""
    return rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def apply_rope(x, positions, theta: float, rot_dim: int | None = None,
               scaling: RopeScaling | None = None, *, tables=None):
    """Half-split (NeoX) RoPE on the first `rot_dim` (default all) features of each head.

    x [B, T, N, Dx] (any float dtype), positions [B, T] int32 -> [B, T, N, Dx] float32.
    With r = rot_dim // 2, features (j, j + r) rotate by angle pos * theta**(-2j / rot_dim)
    (frequencies scaled by `scaling`, a `RopeScaling`, when given):
    `out[j] = x[j] cos - x[j+r] sin`, `out[j+r] = x[j+r] cos + x[j] sin` (HF `rotate_half`);
    cos and sin are multiplied by `scaling.attention_factor` (yarn; 1 otherwise).
    ``tables``: (cos, sin) from :func:`rope_tables` at these positions, computed once for
    several calls (then ``positions``, ``theta`` and ``scaling`` are unused).
    """
    dx = x.shape[-1]
    rot = dx if rot_dim is None else int(rot_dim)
    if rot % 2 or not 0 < rot <= dx:
        raise ValueError(f"apply_rope: rot_dim must be even and in (0, {dx}], got {rot}")
    half = rot // 2
    if tables is None:
        cos, sin = rope_tables(positions, rot, theta, scaling)             # [B, T, 1, half]
        if _common.backend() != "gpu":  # XLA:CPU fuses cos / sin into the rotation and
            cos, sin = jax.lax.optimization_barrier((cos, sin))  # evaluates them once per head
    else:
        cos, sin = tables
        if cos.shape[-1] != half or sin.shape != cos.shape:
            raise ValueError(f"apply_rope: tables must be (cos, sin) of [..., {half}] for "
                             f"rot_dim {rot}, got {cos.shape} and {sin.shape} "
                             "(rope_tables(positions, rot_dim, ...))")
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:rot]
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rot < dx:
        out.append(xf[..., rot:])
    return jnp.concatenate(out, axis=-1)


# --------------------------------------------------------------------------- parameters
#
# Layout: ``params["layers"]`` is a tuple with one dict per layer (not arrays stacked on a
# layer axis), and the projections that read the same input are fused: ``wqkv`` = [wq | wk | wv]
# and ``w_gate_up`` = [w_gate | w_up] along the output axis. Both are measured choices
# (docs/decisions.md): an unrolled decode step would slice a stacked [L, ...] weight with a
# copy on every step (XLA cannot hand cuBLAS a sub-buffer), and XLA rewrites a single-token K
# or V projection on its own into a slow multiply-and-reduce.
# ``unfuse_layer`` / ``stacked_layers`` give the textbook view (wq, wk, wv, w_gate, w_up,
# stacked) for references and tests; ``fuse_layers`` builds the layout from it.

_FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def _layer_specs(cfg: ModelConfig):
    """[(name, shape, init std or 'ones'/'zeros')] of one layer, unfused, in a fixed order."""
    L, d, F = cfg.num_layers, cfg.d_model, cfg.ffn_dim
    qd, kvd = cfg.q_dim, cfg.kv_dim
    res = 1.0 / math.sqrt(2 * L)  # residual-branch output scaling
    lay = [("attn_norm", (d,), "ones"),
           ("wq", (d, qd), d ** -0.5),
           ("wk", (d, kvd), d ** -0.5),
           ("wv", (d, kvd), d ** -0.5)]
    if cfg.qkv_bias:
        lay += [("bq", (qd,), 0.1), ("bk", (kvd,), 0.1), ("bv", (kvd,), 0.1)]
    lay += [("wo", (qd, d), qd ** -0.5 * res),
            ("mlp_norm", (d,), "ones"),
            ("w_gate", (d, F), d ** -0.5),
            ("w_up", (d, F), d ** -0.5),
            ("w_down", (F, d), F ** -0.5 * res)]
    if cfg.has_indexer:
        hi, di = cfg.indexer_heads, cfg.indexer_dim
        lay += [("idx_wq", (d, hi * di), d ** -0.5),
                ("idx_wk", (d, di), d ** -0.5),
                ("idx_knorm_w", (di,), "ones"),
                ("idx_knorm_b", (di,), "zeros"),
                ("idx_ww", (d, hi), d ** -0.5)]
    return lay


def _top_specs(cfg: ModelConfig):
    d, V = cfg.d_model, cfg.vocab_size
    specs = [("embed", (V, d), d ** -0.5), ("final_norm", (d,), "ones")]
    if not cfg.tie_embeddings:
        specs.append(("lm_head", (d, V), d ** -0.5))
    return specs


def fuse_layer(unfused: dict, xp=jnp) -> dict:
    """One layer's unfused weights (wq, wk, wv, [bq, bk, bv], w_gate, w_up, ...) -> the
    fused layout (wqkv, [bqkv], w_gate_up, the rest unchanged). ``xp``: jnp or numpy."""
    out = {}
    for name, v in unfused.items():
        fused = next((f for f, parts in _FUSED.items() if name in parts), None)
        if fused is None:
            out[name] = v
        elif fused not in out:
            out[fused] = xp.concatenate([unfused[p] for p in _FUSED[fused]], axis=-1)
    return out


def unfuse_layer(layer: dict, cfg: ModelConfig) -> dict:
    """Inverse of ``fuse_layer``: the textbook names (wq, wk, wv, w_gate, w_up, ...)."""
    widths = {"wq": cfg.q_dim, "wk": cfg.kv_dim, "wv": cfg.kv_dim, "bq": cfg.q_dim,
              "bk": cfg.kv_dim, "bv": cfg.kv_dim, "w_gate": cfg.ffn_dim, "w_up": cfg.ffn_dim}
    out = {}
    for name, v in layer.items():
        if name not in _FUSED:
            out[name] = v
            continue
        start = 0
        for part in _FUSED[name]:
            out[part] = v[..., start:start + widths[part]]
            start += widths[part]
    return out


def fuse_layers(stacked: dict) -> tuple:
    """Textbook stacked layers {name: [L, ...]} -> the params["layers"] tuple."""
    n = len(next(iter(stacked.values())))
    xp = np if all(isinstance(v, np.ndarray) for v in stacked.values()) else jnp
    return tuple(fuse_layer({k: v[i] for k, v in stacked.items()}, xp) for i in range(n))


def stacked_layers(params: Params, cfg: ModelConfig) -> dict:
    """params["layers"] in the textbook view: {name: [L, ...]} with wq, wk, wv, w_gate, w_up
    (a copy; for references and tests)."""
    layers = [unfuse_layer(lp, cfg) for lp in params["layers"]]
    return {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]}


def stack_layer_tree(layers) -> dict:
    """The params["layers"] tuple stacked on a leading L axis (same names), for `lax.scan`."""
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def _draw(shape, init, dt, rng_or_key):
    if init in ("ones", "zeros"):
        return (jnp.ones if init == "ones" else jnp.zeros)(shape, dt)
    if isinstance(rng_or_key, np.random.Generator):
        return jnp.asarray((rng_or_key.standard_normal(shape, np.float32)
                            * np.float32(init)).astype(dt))
    return (jax.random.normal(rng_or_key, shape, jnp.float32) * init).astype(dt)


@functools.partial(jax.jit, static_argnums=0)
def _init_layer_jax(cfg: ModelConfig, key):
    """One layer with jax.random (big models; one program reused for every layer)."""
    dt = _dtype(cfg)
    return fuse_layer({n: _draw(s, i, dt, jax.random.fold_in(key, j))
                       for j, (n, s, i) in enumerate(_layer_specs(cfg))})


@functools.partial(jax.jit, static_argnums=0)
def _init_top_jax(cfg: ModelConfig, key):
    dt = _dtype(cfg)
    return {n: _draw(s, i, dt, jax.random.fold_in(key, j))
            for j, (n, s, i) in enumerate(_top_specs(cfg))}


def _init_numpy(cfg: ModelConfig, seed: int) -> Params:
    """All parameters with numpy on the host (small models: no XLA compile)."""
    dt = _dtype(cfg)
    top = {n: _draw(s, i, dt, np.random.default_rng([seed % 2**64, 0, j]))
           for j, (n, s, i) in enumerate(_top_specs(cfg))}
    layers = tuple(
        fuse_layer({n: _draw(s, i, dt, np.random.default_rng([seed % 2**64, 1 + layer, j]))
                    for j, (n, s, i) in enumerate(_layer_specs(cfg))})
        for layer in range(cfg.num_layers))
    return {**top, "layers": layers}


_NUMPY_INIT_MAX = 1 << 28  # models up to this many parameters are initialised with numpy


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Seeded random parameters (scaled normal; norm weights 1).

    Returns {"embed": [V, d], "layers": (one dict per layer: "attn_norm": [d],
    "wqkv": [d, Hq*D + 2*H*D], ("bqkv": [Hq*D + 2*H*D] if qkv_bias), "wo": [Hq*D, d],
    "mlp_norm": [d], "w_gate_up": [d, 2F], "w_down": [F, d], (if indexer: "idx_wq":
    [d, H_I*dI], "idx_wk": [d, dI], "idx_knorm_w"/"idx_knorm_b": [dI] (ones/zeros), "idx_ww":
    [d, H_I])), "final_norm": [d], ("lm_head": [d, V] if untied)}, all in cfg.dtype on the
    default device. Std: fan_in**-0.5 for projections and the embedding, times (2L)**-0.5
    for wo/w_down, 0.1 for biases. The values depend only on (cfg, seed): models up to
    2**28 parameters are drawn with numpy on the host (no compile), bigger ones with
    jax.random on the device, one layer at a time.
    """
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"init_params: seed must be an int, got {seed!r}")
    if num_params(cfg) <= _NUMPY_INIT_MAX:
        return _init_numpy(cfg, int(seed))
    key = jax.random.key(int(seed) % 2**32)
    layers = tuple(_init_layer_jax(cfg, jax.random.fold_in(key, 1 + i))
                   for i in range(cfg.num_layers))
    return {**_init_top_jax(cfg, jax.random.fold_in(key, 0)), "layers": layers}


def param_shapes(cfg: ModelConfig) -> Params:
    """The `init_params` tree as jax.ShapeDtypeStruct leaves (nothing is allocated)."""
    key = jax.random.key(0)
    layer = jax.eval_shape(functools.partial(_init_layer_jax, cfg), key)
    top = jax.eval_shape(functools.partial(_init_top_jax, cfg), key)
    return {**top, "layers": tuple(layer for _ in range(cfg.num_layers))}


def num_params(cfg: ModelConfig) -> int:
    """Total number of parameters (Python int)."""
    return (sum(math.prod(shape) for _, shape, _ in _top_specs(cfg))
            + cfg.num_layers * sum(math.prod(shape) for _, shape, _ in _layer_specs(cfg)))


# --------------------------------------------------------------------------- blocks

def embed(params: Params, cfg: ModelConfig, tokens) -> jax.Array:
    """tokens [B, T] int32 -> x [B, T, d] cfg.dtype (ids outside [0, V) are clamped)."""
    return jnp.take(params["embed"], tokens, axis=0, mode="clip").astype(_dtype(cfg))


def attention_inputs(layer_params: Params, cfg: ModelConfig, x, positions, *, rope=None):
    """Pre-attention RMSNorm, q/k/v projections and RoPE for one layer.

    layer_params: one layer's dict, params["layers"][i]; x [B, T, d];
    positions [B, T] int32 (may differ per request); ``rope``: the tables
    :func:`model_rope_tables` gives at ``positions`` (None: computed here).
    Returns (h [B, T, d], q [B, T, Hq, D], k [B, T, H, D], v [B, T, H, D]), all cfg.dtype;
    h is the normed x, q and k have RoPE (scaled by cfg.rope_scaling) applied at `positions`;
    with cfg.qkv_bias the q/k/v biases (qwen2) are added before RoPE.
    """
    dt = _dtype(cfg)
    B, T, _ = x.shape
    Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lp = layer_params
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps).astype(dt)
    qkv = _proj(h, lp["wqkv"], lp.get("bqkv"))
    qd, kvd = cfg.q_dim, cfg.kv_dim
    q = qkv[..., :qd].reshape(B, T, Hq, D)
    k = qkv[..., qd:qd + kvd].reshape(B, T, H, D)
    v = qkv[..., qd + kvd:].reshape(B, T, H, D)
    if rope is None:  # one pair of tables for q and k
        rope = model_rope_tables(cfg, positions)
        if _common.backend() != "gpu":  # XLA:CPU would fuse them into each rotation
            rope = jax.lax.optimization_barrier(rope)
    q = apply_rope(q, positions, cfg.rope_theta, scaling=cfg.rope_scaling, tables=rope)
    k = apply_rope(k, positions, cfg.rope_theta, scaling=cfg.rope_scaling, tables=rope)
    return h, q.astype(dt), k.astype(dt), v.astype(dt)


def indexer_inputs(layer_params: Params, cfg: ModelConfig, h, positions, *, rope_dims: int = 0):
    """Lightning-indexer projections (DSA-style) of the normed hidden state `h` [B, T, d].

    Returns (q_idx [B, T, H_I, dI] cfg.dtype, weights [B, T, H_I] f32 = (h @ idx_ww) * H_I**-0.5,
    k_idx [B, T, dI] cfg.dtype = LayerNorm(h @ idx_wk) with idx_knorm_w/_b, eps 1e-6).
    By default no RoPE is applied to the index vectors (`positions` is then unused); with
    `rope_dims > 0`, half-split RoPE rotates the first `rope_dims` features of q_idx and
    k_idx at `positions` [B, T] (DSA puts its RoPE dims first).
    """
    if not cfg.has_indexer:
        raise ValueError(f"indexer_inputs: config {cfg.name!r} has no indexer "
                         "(use configs.with_indexer)")
    dt = _dtype(cfg)
    B, T, _ = h.shape
    HI, dI = cfg.indexer_heads, cfg.indexer_dim
    lp = layer_params
    q = _proj(h, lp["idx_wq"]).reshape(B, T, HI, dI)
    w = _proj(h, lp["idx_ww"]) * (HI ** -0.5)
    k = _layer_norm(_proj(h, lp["idx_wk"]), lp["idx_knorm_w"], lp["idx_knorm_b"], INDEXER_LN_EPS)
    if rope_dims:
        q = apply_rope(q, positions, cfg.rope_theta, rope_dims)
        k = apply_rope(k[:, :, None, :], positions, cfg.rope_theta, rope_dims)[:, :, 0, :]
    return q.astype(dt), w, k.astype(dt)


def _psum(y, axis_name):
    return y if axis_name is None else jax.lax.psum(y, axis_name)


def layer_output(layer_params: Params, cfg: ModelConfig, x, attn, *, axis_name=None) -> jax.Array:
    """Output projection + residual, then RMSNorm + SwiGLU MLP + residual.

    x [B, T, d], attn [B, T, Hq, D] (any float dtype) -> x [B, T, d] cfg.dtype.
    ``axis_name`` (tensor parallelism inside ``shard_map``, jaxkv.parallel): ``cfg`` and the
    params are this device's share (its heads' wo rows, a block of the MLP hidden units); the
    o_proj and down_proj outputs (float32) are summed over that mesh axis before each residual.
    """
    dt = _dtype(cfg)
    B, T, _ = x.shape
    lp = layer_params
    a = attn.astype(dt).reshape(B, T, cfg.q_dim)
    x = (x.astype(jnp.float32) + _psum(_proj(a, lp["wo"]), axis_name)).astype(dt)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_eps).astype(dt)
    gu = _proj(h, lp["w_gate_up"])
    g, u = gu[..., :cfg.ffn_dim], gu[..., cfg.ffn_dim:]
    m = (jax.nn.silu(g) * u).astype(dt)
    return (x.astype(jnp.float32) + _psum(_proj(m, lp["w_down"]), axis_name)).astype(dt)


def final_logits(params: Params, cfg: ModelConfig, x) -> jax.Array:
    """Final RMSNorm and LM head: x [B, T, d] -> logits [B, T, V] float32 (tied: embed.T)."""
    h = rms_norm(x, params["final_norm"], cfg.rms_eps).astype(_dtype(cfg))
    if cfg.tie_embeddings:
        return _matmul("btd,vd->btv", h, params["embed"])
    return _matmul("btd,dv->btv", h, params["lm_head"])


def dense_attend(layer, layer_params, h, q, k, v, carry):
    """Causal full attention over the T tokens of this call (an `attend` for `forward`).

    Token index t attends to indices <= t. `carry` is passed through unchanged: None (all T
    tokens valid) or lengths [B] int32 (right padding: keys at indices >= lengths[b] are
    masked; outputs at padded queries are finite but meaningless).
    q [B, T, Hq, D], k/v [B, T, H, D] -> (attn [B, T, Hq, D] q.dtype, carry).
    """
    del layer, layer_params, h
    T = q.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)
    mask = (idx[None, :] <= idx[:, None])[None]  # [1, T, S]
    if carry is not None:
        mask = mask & (idx[None, None, :] < jnp.asarray(carry, jnp.int32)[:, None, None])
    mask = jnp.broadcast_to(mask, (q.shape[0], T, T))
    return gqa_attention(q, k, v, mask), carry


def rolled_weights(mode: str | None = None) -> str:
    """How a rolled layer loop reads a per-layer tuple of weights: ``mode``, else the backend's
    default: "stack" on the GPU (stacked [L, ...] arrays, one slice per layer; a conditional
    would cost a host round trip there), "switch" elsewhere (each matrix product a
    ``lax.switch`` over the layers' own arrays: XLA:CPU copies a dynamic slice of a stacked
    weight before a dot, which triples a decode step's weight traffic)."""
    if mode is None:
        mode = "stack" if _common.backend() == "gpu" else "switch"
    if mode not in ("stack", "switch"):
        raise ValueError(f"rolled_weights must be 'stack', 'switch' or None, got {mode!r}")
    return mode


def run_layers(params: Params, cfg: ModelConfig, x, positions, attend: AttendFn, carry, *,
               start: int = 0, stop: int | None = None, unroll: int = 1, axis_name=None,
               weights: str | None = None, rope=None):
    """Layers ``[start, stop)`` (static) of the model: x [B, T, d] -> (x, carry).

    ``params["layers"]`` is the per-layer tuple (then ``unroll >= stop - start`` runs a Python
    loop over the layers, each reading its own weight arrays, and a smaller ``unroll`` runs a
    `lax.scan` whose body reads the weights as ``rolled_weights(weights)`` says: "stack"
    stacks them (a copy, see ``stack_layer_tree``), "switch" passes each matrix as a
    :class:`LayerWeight` and stacks only the vectors (norm weights, biases)) or already
    stacked (a dict of [L, ...] arrays: always a `lax.scan`). `attend` gets the global layer
    index (int32). ``axis_name``: tensor-parallel mesh axis (see :func:`layer_output`).
    ``rope``: the RoPE tables at ``positions`` (:func:`model_rope_tables`) for every layer;
    None: each layer computes its own.
    """
    stop = cfg.num_layers if stop is None else stop
    if stop <= start:
        return x, carry

    def body(c, xs):
        x, ac = c
        layer, lp = xs
        h, q, k, v = attention_inputs(lp, cfg, x, positions, rope=rope)
        attn, ac = attend(layer, lp, h, q, k, v, ac)
        return (layer_output(lp, cfg, x, attn, axis_name=axis_name), ac), None

    lps = params["layers"]
    if not isinstance(lps, dict):
        if unroll >= stop - start:
            c = (x, carry)
            for i in range(start, stop):
                c, _ = body(c, (jnp.int32(i), lps[i]))
            return c
        if rolled_weights(weights) == "switch":
            mats = {n: tuple(lp[n] for lp in lps[start:stop]) for n, a in lps[start].items()
                    if a.ndim >= 2}
            vecs = stack_layer_tree([{n: a for n, a in lp.items() if n not in mats}
                                     for lp in lps[start:stop]])
            inner = body

            def body(c, xs):  # noqa: F811 - the matrices of layer ``layer`` by switch
                layer, lp = xs
                lp = {**lp, **{n: LayerWeight(layer - start, m) for n, m in mats.items()}}
                return inner(c, (layer, lp))

            lps = vecs
        else:
            lps = stack_layer_tree(lps[start:stop])
    elif (start, stop) != (0, cfg.num_layers):
        lps = jax.tree.map(lambda a: a[start:stop], lps)
    layers = jnp.arange(start, stop, dtype=jnp.int32)
    (x, carry), _ = jax.lax.scan(body, (x, carry), (layers, lps), unroll=min(unroll, stop - start))
    return x, carry


def forward(params: Params, cfg: ModelConfig, tokens, positions, attend: AttendFn, carry,
            *, unroll: int = 1):
    """Full model: embed, the layers (`run_layers`), final logits.

    tokens [B, T] int32, positions [B, T] int32. Per layer (index `layer`, traced i32
    scalar): `h, q, k, v = attention_inputs(...)`, then
    `attn, carry = attend(layer, layer_params, h, q, k, v, carry)` (the caller's attention,
    its cache in `carry`; carry structure must be preserved), then `layer_output`.
    Returns (logits [B, T, V] float32, carry). `forward(p, cfg, tok, pos, dense_attend, None)`
    is a plain causal model.
    """
    x = embed(params, cfg, tokens)
    x, carry = run_layers(params, cfg, x, positions, attend, carry, unroll=unroll)
    return final_logits(params, cfg, x), carry
