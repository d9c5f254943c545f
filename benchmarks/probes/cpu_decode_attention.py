"""Decode attention on XLA:CPU, by part (issue 34): where SmolLM2's dense decode at 2k loses
time against transformers. One layer's shapes (1 request, 9 query / 3 KV heads, head dim 64,
16-token pages, 2048 tokens of context = 128 pages of a 30-layer pool):

* the gather of the selected pages' K/V ([B, H, C, 2, ps, D]) against a contiguous
  dynamic slice of the same bytes;
* the two products of the online softmax in the blocked formulation's layout (K and V
  sliced out of the gathered [.., 2, ps, D] block) and in other layouts: contiguous K
  ([B, H, T, D]), the scores computed T-major (``bhtd,bhgd->bhtg``, a tall-skinny product),
  elementwise multiply + sum.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/cpu_decode_attention.py
"""
import argparse

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options: --help
import time, numpy as np, jax, jax.numpy as jnp  # noqa: E401, E402
from pallas_kernels.sparse_attention import _heads, _as_f32
B, Hq, H, D, ps = 1, 9, 3, 64, 16
Np = 512; L = 30; N = L * Np; R = 2 * H * ps * D; C = 128
rng = np.random.default_rng(0)
pool = jnp.asarray(rng.standard_normal((N, R), dtype=np.float32))
rows = jnp.asarray((7 * Np + np.arange(C))[None, None, :].repeat(H, 1).astype(np.int32))
heads = jnp.arange(H, dtype=jnp.int32)[None, :, None]
def tm(name, fn, *a):
    j = jax.jit(fn); j(*a).block_until_ready(); ts = []
    for _ in range(30):
        t = time.perf_counter(); j(*a).block_until_ready(); ts.append(time.perf_counter() - t)
    print(f"{name:28s} {min(ts)*1e3:.3f} ms")
tm("gather _heads", lambda p, r: _as_f32(*_heads(p, r, heads, H, ps, D)), pool, rows)
tm("gather take rows then heads", lambda p, r: jnp.take(p, r[0, 0], axis=0).reshape(C, 2, H, ps, D).transpose(2, 0, 1, 3, 4), pool, rows)
tm("dynamic_slice contiguous", lambda p, r: jax.lax.dynamic_slice_in_dim(p, r[0, 0, 0], C, 0).reshape(C, 2, H, ps, D), pool, rows)
kv = jnp.asarray(rng.standard_normal((B, H, C, 2, ps, D), dtype=np.float32))
q = jnp.asarray(rng.standard_normal((B, H, 3, D), dtype=np.float32))
def ein(q, kv):
    k = kv[:, :, :, 0].reshape(B, H, C * ps, D); v = kv[:, :, :, 1].reshape(B, H, C * ps, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", q, k, precision=jax.lax.Precision.HIGHEST)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
tm("einsums on gathered", ein, q, kv)
def mulsum(q, kv):
    k = kv[:, :, :, 0].reshape(B, H, C * ps, D); v = kv[:, :, :, 1].reshape(B, H, C * ps, D)
    s = jnp.sum(q[:, :, :, None, :] * k[:, :, None], axis=-1)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.sum(p[..., None] * v[:, :, None], axis=-2)
tm("mul+sum", mulsum, q, kv)
def ein_default(q, kv):
    k = kv[:, :, :, 0].reshape(B, H, C * ps, D); v = kv[:, :, :, 1].reshape(B, H, C * ps, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", q, k)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhgt,bhtd->bhgd", p, v)
tm("einsum default precision", ein_default, q, kv)
def ein_only_s(q, kv):
    k = kv[:, :, :, 0].reshape(B, H, C * ps, D)
    return jnp.einsum("bhgd,bhtd->bhgt", q, k)
tm("scores einsum only", ein_only_s, q, kv)
def ein_only_pv(q, kv):
    v = kv[:, :, :, 1].reshape(B, H, C * ps, D)
    p = jnp.ones((B, H, 3, C * ps))
    return jnp.einsum("bhgt,bhtd->bhgd", p, v)
tm("pv einsum only", ein_only_pv, q, kv)
def ein_pages(q, kv):  # keep pages as a batch dim: [b,h,c,ps,d]
    k = kv[:, :, :, 0]; v = kv[:, :, :, 1]
    s = jnp.einsum("bhgd,bhcpd->bhgcp", q, k)
    p = jnp.exp(s - s.max((-1, -2), keepdims=True))
    return jnp.einsum("bhgcp,bhcpd->bhgd", p, v)
tm("einsum pages kept", ein_pages, q, kv)
print("--- layouts")
kk = jnp.asarray(rng.standard_normal((B, H, C * ps, D), dtype=np.float32))
tm("s: bhgd,bhtd->bhgt contiguous k", lambda q, k: jnp.einsum("bhgd,bhtd->bhgt", q, k), q, kk)
tm("s: bhtd,bhgd->bhtg", lambda q, k: jnp.einsum("bhtd,bhgd->bhtg", k, q), q, kk)
tm("s: dot_general k @ q^T via matmul", lambda q, k: jnp.matmul(k, jnp.swapaxes(q, -1, -2)), q, kk)
tm("s: mul+sum contiguous", lambda q, k: jnp.sum(q[:, :, :, None, :] * k[:, :, None], -1), q, kk)
tm("s: per g loop mul+sum", lambda q, k: jnp.stack([jnp.sum(q[:, :, g, None, :] * k, -1) for g in range(3)], 2), q, kk)
print("--- pv")
vv = jnp.asarray(rng.standard_normal((B, H, C * ps, D), dtype=np.float32))
pt = jnp.asarray(rng.standard_normal((B, H, C * ps, 3), dtype=np.float32))
pg = jnp.swapaxes(pt, -1, -2)
tm("pv: bhgt,bhtd->bhgd", lambda p, v: jnp.einsum("bhgt,bhtd->bhgd", p, v), pg, vv)
tm("pv: bhtg,bhtd->bhgd", lambda p, v: jnp.einsum("bhtg,bhtd->bhgd", p, v), pt, vv)
tm("pv: bhtd,bhtg->bhdg", lambda p, v: jnp.einsum("bhtd,bhtg->bhdg", v, p), pt, vv)
tm("pv: mul+sum", lambda p, v: jnp.sum(p[..., None] * v[:, :, :, None, :], 2), pt, vv)
