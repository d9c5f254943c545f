"""rope_qkv (the decode step's RoPE / K/V row / Quest query-group op): kernel vs reference,
reference vs the model's own path, and the engine's decode with and without it."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import configs, llama
from pallas_kernels import quest, rope_qkv


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _close(got, want, msg):
    """Equal up to one rounding step of the dtype, relative to the operands' scale: the
    rotation's multiply-adds may be contracted (FMA) differently by the kernel and by XLA,
    and ``x1 cos - x2 sin`` can cancel."""
    ulp = {jnp.dtype(jnp.float32): 2.4e-7, jnp.dtype(jnp.bfloat16): 8e-3}[jnp.dtype(want.dtype)]
    w = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), w, rtol=ulp,
                               atol=2 * ulp * float(np.abs(w).max()), err_msg=msg)


def _case(seed, B, Hq, H, D, bias, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    W = (Hq + 2 * H) * D
    qkv = jnp.asarray(rng.normal(size=(B, W)) * 2, dtype)
    b = jnp.asarray(rng.normal(size=(W,)), jnp.float32) if bias else None
    pos = jnp.asarray(rng.integers(0, 10**6, B), jnp.int32)
    ang = llama.rope_angles(pos[:, None], D, 1e6)[:, 0]
    return qkv, b, jnp.cos(ang), jnp.sin(ang)


@pytest.mark.parametrize("B,Hq,H,D,bias,q_dtype,kv_dtype", [
    (8, 12, 2, 32, True, jnp.bfloat16, jnp.bfloat16),    # Qwen-like: groups of 6, qkv bias
    (2, 9, 3, 64, False, jnp.bfloat16, jnp.bfloat16),    # SmolLM2-like: groups of 3
    (3, 4, 4, 16, False, jnp.float32, jnp.bfloat16),     # G = 1, f32 model, bf16 cache
    (1, 8, 1, 128, True, jnp.bfloat16, jnp.float32),     # one KV head, f32 cache
])
def test_kernel_matches_reference(B, Hq, H, D, bias, q_dtype, kv_dtype):
    seed = _seed()
    qkv, b, cos, sin = _case(seed, B, Hq, H, D, bias, q_dtype)
    kw = dict(num_heads=Hq, num_kv_heads=H, head_dim=D, q_dtype=q_dtype, kv_dtype=kv_dtype)
    ref = rope_qkv.rope_qkv_reference(qkv, b, cos, sin, **kw)
    got = rope_qkv.rope_qkv_pallas(qkv, b, cos, sin, **kw)
    for name, r, g in zip(("q", "kv"), ref[:2], got[:2]):
        assert g.shape == r.shape and g.dtype == r.dtype
        _close(g, r, f"{name} (seed {seed})")
    # group sums: the same terms in maybe another order, and a q element may differ by one
    # rounding step of q's dtype
    step = {jnp.dtype(jnp.float32): 2.4e-7, jnp.dtype(jnp.bfloat16): 8e-3}[jnp.dtype(q_dtype)]
    tol = 2 * step * float(np.abs(np.asarray(ref[0], np.float32)).max()) + 1e-5
    for r, g in zip(ref[2:], got[2:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=tol)
    qp, qn = quest._group_q(ref[0], H)
    np.testing.assert_allclose(np.asarray(ref[2]), np.asarray(qp), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ref[3]), np.asarray(qn), rtol=1e-6, atol=1e-5)


def test_rejects_bad_shapes():
    qkv, b, cos, sin = _case(0, 2, 4, 2, 16, True)
    kw = dict(num_kv_heads=2, head_dim=16, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="qkv width"):
        rope_qkv.rope_qkv(qkv, b, cos, sin, num_heads=6, **kw)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_qkv.rope_qkv(qkv, b, cos[:, :4], sin[:, :4], num_heads=4, **kw)
    with pytest.raises(ValueError, match="power of two"):
        q2, b2, c2, s2 = _case(0, 2, 4, 2, 24, False)
        rope_qkv.rope_qkv_pallas(q2, b2, c2, s2, num_heads=4, num_kv_heads=2, head_dim=24,
                                 q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("cfg", [configs.tiny(), configs.tiny(qkv_bias=True, dtype="bfloat16",
                                                                num_heads=6)])
def test_decode_inputs_equal_attention_inputs(impl, cfg):
    """decode_inputs' q, K and V are attention_inputs' (bit for bit with the XLA reference, to
    one rounding step with the kernel)."""
    params = llama.init_params(cfg, 0)
    lp = params["layers"][0]
    B = 3
    x = jax.random.normal(jax.random.key(_seed() % 2**31), (B, 1, cfg.d_model)).astype(cfg.dtype)
    pos = jnp.asarray([[0], [77], [5000]], jnp.int32)
    h, q, k, v = llama.attention_inputs(lp, cfg, x, pos)
    h2, q2, kv, (qp, qn) = llama.decode_inputs(lp, cfg, x, pos, implementation=impl)
    for a, b in ((h, h2), (q[:, 0], q2), (k[:, 0], kv[:, 0]), (v[:, 0], kv[:, 1])):
        if impl == "xla":
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:
            _close(b, a, f"{impl} {cfg.dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hq,H,D,bias", [(8, 12, 2, 128, True), (1, 32, 8, 128, False)])
def test_gpu_kernel_matches_reference(B, Hq, H, D, bias):
    """On the H200 (Triton): the Qwen-like and the 8B-like decode shapes."""
    seed = _seed()
    qkv, b, cos, sin = _case(seed, B, Hq, H, D, bias)
    kw = dict(num_heads=Hq, num_kv_heads=H, head_dim=D, q_dtype=jnp.bfloat16,
              kv_dtype=jnp.bfloat16)
    ref = jax.jit(lambda *a: rope_qkv.rope_qkv_reference(*a, **kw))(qkv, b, cos, sin)
    got = jax.jit(lambda *a: rope_qkv.rope_qkv_pallas(*a, **kw))(qkv, b, cos, sin)
    for name, r, g in zip(("q", "kv"), ref[:2], got[:2]):
        _close(g, r, f"{name} (seed {seed})")
    tol = 2 * 8e-3 * float(np.abs(np.asarray(ref[0], np.float32)).max()) + 1e-5
    for r, g in zip(ref[2:], got[2:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=tol)
