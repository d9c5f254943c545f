"""A deliberately plain dense Llama forward in numpy float64, written from the math.

Independent of models/llama.py (shares only the params pytree layout and ModelConfig field
names), used by tests to check jaxkv end to end. RMSNorm, half-split (NeoX) RoPE, causal
GQA softmax attention, SwiGLU MLP, tied or separate LM head. Params are converted to float64
on each call; pass float64 numpy params (``jax.tree.map(lambda a: np.asarray(a, np.float64),
params)``) to convert once. A 135M model takes about a second per short prompt on 2 cores.
"""
from __future__ import annotations

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _weights64(params, cfg) -> dict:
    """params pytree (jax or numpy arrays, any float dtype) -> dict of float64 numpy arrays,
    layers stacked [L, ...] under their textbook names (the fused wqkv / w_gate_up split)."""
    qd, kvd, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.ffn_dim
    split = {"wqkv": (("wq", 0, qd), ("wk", qd, qd + kvd), ("wv", qd + kvd, qd + 2 * kvd)),
             "bqkv": (("bq", 0, qd), ("bk", qd, qd + kvd), ("bv", qd + kvd, qd + 2 * kvd)),
             "w_gate_up": (("w_gate", 0, F), ("w_up", F, 2 * F))}
    per_layer = []
    for lp in params["layers"]:
        d = {}
        for k, v in lp.items():
            v = _f64(v)
            for name, a, b in split.get(k, ((k, None, None),)):
                d[name] = v if a is None else v[..., a:b]
        per_layer.append(d)
    layers = {k: np.stack([d[k] for d in per_layer]) for k in per_layer[0]}
    out = {"embed": _f64(params["embed"]), "layers": layers, "final_norm": _f64(params["final_norm"])}
    if "lm_head" in params:
        out["lm_head"] = _f64(params["lm_head"])
    return out


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    """x [T, heads, D], positions [T] -> x rotated; pairs are (i, i + D/2)."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]          # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _forward(w, cfg, tokens, start, cache):
    """Runs tokens [T] at positions start..start+T-1, appending to cache (list of (K, V) per
    layer, K/V [t, H, D]); returns logits [T, V] float64."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    t = tokens.shape[0]
    pos = np.arange(start, start + t)
    hq, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = hq // h
    x = w["embed"][tokens]                                                     # [T, d_model]
    lw = w["layers"]
    for l in range(cfg.num_layers):
        a = _rms_norm(x, lw["attn_norm"][l], cfg.rms_eps)
        q, k, v = a @ lw["wq"][l], a @ lw["wk"][l], a @ lw["wv"][l]
        if "bq" in lw:
            q, k, v = q + lw["bq"][l], k + lw["bk"][l], v + lw["bv"][l]
        q = _rope(q.reshape(t, hq, d), pos, cfg.rope_theta)
        k = _rope(k.reshape(t, h, d), pos, cfg.rope_theta)
        v = v.reshape(t, h, d)
        if len(cache) <= l:
            cache.append((k, v))
        else:
            cache[l] = (np.concatenate([cache[l][0], k]), np.concatenate([cache[l][1], v]))
        keys, vals = cache[l]                                                  # [S, H, D]
        s = keys.shape[0]
        kpos = np.arange(s)
        out = np.zeros((t, hq, d))
        for j in range(hq):                      # plain loops: clarity over speed
            kh = j // group
            scores = q[:, j, :] @ keys[:, kh, :].T / np.sqrt(d)                 # [T, S]
            scores = np.where(kpos[None, :] <= pos[:, None], scores, -np.inf)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[:, j, :] = p @ vals[:, kh, :]
        x = x + out.reshape(t, hq * d) @ lw["wo"][l]
        m = _rms_norm(x, lw["mlp_norm"][l], cfg.rms_eps)
        g = m @ lw["w_gate"][l]
        x = x + ((g / (1.0 + np.exp(-g))) * (m @ lw["w_up"][l])) @ lw["w_down"][l]
    x = _rms_norm(x, w["final_norm"], cfg.rms_eps)
    head = w["embed"].T if "lm_head" not in w else w["lm_head"]
    return x @ head


def reference_logits(params, cfg, tokens) -> np.ndarray:
    """tokens [T] int -> logits [T, V] float64 (positions 0..T-1, causal)."""
    return _forward(_weights64(params, cfg), cfg, tokens, 0, [])


def reference_greedy(params, cfg, prompt, n: int) -> list[int]:
    """Greedy continuation: the n tokens (list of int) that argmax decoding appends to
    ``prompt`` [T] (no stop tokens; ties go to the lowest id)."""
    w = _weights64(params, cfg)
    cache: list = []
    logits = _forward(w, cfg, prompt, 0, cache)
    pos = len(np.asarray(prompt).reshape(-1))
    out = []
    for _ in range(n):
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        logits = _forward(w, cfg, [nxt], pos, cache)
        pos += 1
    return out
