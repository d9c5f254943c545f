"""fp8 and int8 keys and values against float32, and two exact transforms of the stored keys
that could make them more accurate (issue 31): the error of one layer's attention output, on a real
model and real text, CPU.

Per layer: the model's own q / k / v (float32 prefill of ``--tokens`` tokens of Paul Graham's
essays), attention of the last ``--queries`` positions over every earlier key, with K and / or
V quantized as ``kv_quant`` stores them (``--dtype``, a power-of-two scale per token and head):

- ``out_rel``: K and V in fp8; ``out_rel_bf16``: both rounded to bf16 (for scale);
  ``k_only`` / ``v_only``: one of them in fp8;
- ``*_rot``: the stored vectors rotated by the normalized Hadamard matrix R (q R . k R = q . k;
  V's output rotated back); ``k_only_rot_signs``: R after random signs;
- ``k_only_smooth``: K minus its mean over the tokens (per head) before quantizing, exact
  under softmax (q . mu is the same for every key of a query); ``k_only_smooth_rot``: both.
- ``k_only_page_shift``: K minus its page's mean (``--page-size`` tokens, per head) before
  quantizing, the mean kept in bf16 and added back (attention would add q . mean per page);
  ``k_only_page_shift_rot``: then rotated; ``k_only_first_shift``: the page's first key (bf16)
  as the offset instead, which a decode step knows when it writes a page's later tokens;
  ``k_only_outliers{4,8}``: the 4 / 8 channels of largest mean |k| over the prompt (per head)
  kept in bf16, the rest fp8.
- ``int8_*``: the same with int8 payloads (``kv_quant``'s int8 scale per token and
  head): ``int8_kv`` (K and V), ``int8_kv_smooth`` (K shifted, as ``kv_key_shift`` stores it),
  ``int8_k_only``, ``int8_k_only_smooth``, ``int8_k_only_rot``, ``int8_k_only_smooth_rot``,
  ``int8_v_only``.

Each is the relative L2 error of the attention output; ``logit_max*``: the largest score
error. Prints per layer, then the means (``--out``: JSON).

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/fp8_rotation.py [--gguf FILE]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from _probe import layer_qkv, print_row, report
from jaxkv.kernels import kv_quant
from jaxkv.models import gguf_loader


def fp8(x, dtype="float8_e4m3fn"):
    return kv_quant.dequantize(*kv_quant.quantize(x, dtype))


def attend(q, k, v, t0):
    """q [Q, Hq, D] (positions t0..), k/v [T, H, D] -> out [Q, Hq, D], scores [Hq, Q, T]."""
    Hq, H = q.shape[1], k.shape[1]
    kk = jnp.repeat(k, Hq // H, axis=1)
    vv = jnp.repeat(v, Hq // H, axis=1)
    s = jnp.einsum("qhd,thd->hqt", q, kk) / np.sqrt(q.shape[-1])
    t = jnp.arange(k.shape[0])
    s = jnp.where(t[None, None, :] <= (t0 + jnp.arange(q.shape[0]))[None, :, None], s, -jnp.inf)
    return jnp.einsum("hqt,thd->qhd", jax.nn.softmax(s, axis=-1), vv), s


def _page_variants(q, k, v, t0, R, ps, dtype, rel) -> dict:
    """K-only errors with a per-page offset (the page's mean or first key, kept in bf16) taken
    out before quantizing, and with outlier channels kept in bf16 (module docstring)."""
    bf = lambda t: t.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    T = k.shape[0]
    if T % ps:
        raise SystemExit(f"--tokens ({T}) must be a multiple of --page-size ({ps})")
    kp = k.reshape(T // ps, ps, *k.shape[1:])
    out = {}
    for name, off in (("page_shift", kp.mean(1, keepdims=True)), ("first_shift", kp[:, :1])):
        res = (kp - bf(off)).reshape(k.shape)
        offs = jnp.broadcast_to(bf(off), kp.shape).reshape(k.shape)
        out[f"k_only_{name}"] = rel(attend(q, offs + fp8(res, dtype), v, t0)[0])
        if name == "page_shift":
            out["k_only_page_shift_rot"] = rel(attend(q, offs + fp8(res @ R, dtype) @ R.T,
                                                      v, t0)[0])
    mag = jnp.mean(jnp.abs(k[:t0]), axis=0)                              # [H, D]
    for c in (4, 8):
        top = jnp.argsort(-mag, axis=-1)[:, :c]
        keep = jnp.zeros(mag.shape, bool).at[jnp.arange(mag.shape[0])[:, None], top].set(True)
        kq = jnp.where(keep[None], bf(k), fp8(jnp.where(keep[None], 0.0, k), dtype))
        out[f"k_only_outliers{c}"] = rel(attend(q, kq, v, t0)[0])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--dtype", default="float8_e4m3fn")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only")
    ap.add_argument("--page-size", type=int, default=16, help="pages of the page shifts")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    path = a.gguf or str(gguf_loader.default_model_path())
    rows = []
    for i, q, k, v in layer_qkv(path, a.tokens, a.layers):
        T, D = k.shape[0], k.shape[-1]
        t0 = T - a.queries
        R = kv_quant.hadamard(D)
        signs = np.random.default_rng(0).choice([-1.0, 1.0], D).astype(np.float32)
        RS = jnp.asarray(signs)[:, None] * R
        q1, k1, v1 = q[t0:], k, v
        ref, s_ref = attend(q1, k1, v1, t0)
        out, s = attend(q1, fp8(k1, a.dtype), fp8(v1, a.dtype), t0)
        out_r, s_r = attend(q1 @ R, fp8(k1 @ R, a.dtype), fp8(v1 @ R, a.dtype), t0)
        out_r = out_r @ R.T
        bf = lambda t: t.astype(jnp.bfloat16).astype(jnp.float32)
        out_bf, _ = attend(q1, bf(k1), bf(v1), t0)
        out_k, _ = attend(q1, fp8(k1, a.dtype), v1, t0)                  # K alone in fp8
        out_v, _ = attend(q1, k1, fp8(v1, a.dtype), t0)                  # V alone
        out_kr, _ = attend(q1 @ R, fp8(k1 @ R, a.dtype), v1 @ R, t0)
        out_krs, _ = attend(q1 @ RS, fp8(k1 @ RS, a.dtype), v1, t0)      # random signs, then H
        mu = jnp.mean(k1, axis=0)                                       # [H, D] over the prompt
        out_ks, _ = attend(q1, fp8(k1 - mu, a.dtype), v1, t0)            # smoothed: softmax-exact
        out_ksr, _ = attend(q1 @ R, fp8((k1 - mu) @ R, a.dtype), v1, t0)  # smoothed, then rotated
        out_vr, _ = attend(q1, k1, fp8(v1 @ R, a.dtype) @ R.T, t0)
        i8 = lambda t: fp8(t, "int8")  # noqa: E731
        ok = jnp.isfinite(s_ref)
        rel = lambda o: float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
        int8 = dict(
            int8_kv=rel(attend(q1, i8(k1), i8(v1), t0)[0]),
            int8_kv_smooth=rel(attend(q1, i8(k1 - mu), i8(v1), t0)[0]),
            int8_k_only=rel(attend(q1, i8(k1), v1, t0)[0]),
            int8_k_only_smooth=rel(attend(q1, i8(k1 - mu), v1, t0)[0]),
            int8_k_only_rot=rel(attend(q1 @ R, i8(k1 @ R), v1, t0)[0]),
            int8_k_only_smooth_rot=rel(attend(q1 @ R, i8((k1 - mu) @ R), v1, t0)[0]),
            int8_v_only=rel(attend(q1, k1, i8(v1), t0)[0]))
        page = _page_variants(q1, k1, v1, t0, R, a.page_size, a.dtype, rel)
        mx = lambda s_: float(jnp.max(jnp.where(ok, jnp.abs(s_ - s_ref), 0)))
        row = dict(layer=i, out_rel=rel(out), out_rel_rot=rel(out_r), out_rel_bf16=rel(out_bf),
                   k_only=rel(out_k), k_only_rot=rel(out_kr @ R.T), k_only_rot_signs=rel(out_krs), k_only_smooth=rel(out_ks), k_only_smooth_rot=rel(out_ksr), v_only=rel(out_v),
                   v_only_rot=rel(out_vr), logit_max=mx(s),
                   logit_max_rot=mx(s_r),
                   k_kurtosis=float(jnp.mean(jnp.max(jnp.abs(k1), -1) / jnp.sqrt(jnp.mean(k1 ** 2, -1)))),
                   **int8, **page)
        rows.append(row)
        print_row(row)
    report(rows, a.out, model=path, tokens=T, queries=a.queries, dtype=a.dtype)


if __name__ == "__main__":
    main()
