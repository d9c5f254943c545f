"""Causal prefill attention over right-padded prompts: a flash-attention (FA2) Pallas kernel and
its chunked pure-jnp reference.

Shapes and dtypes (shared by both implementations):

* q ``[B, T, Hq, D]``; k, v ``[B, T, H, D]``, the same dtype as q (bfloat16 or float32);
  lengths ``[B]`` integer (prompt lengths, ``0 <= lengths[b] <= T``; values outside are clipped
  to ``[0, T]``). Query head ``i`` uses KV head ``i // (Hq // H)`` (GQA, any integer ratio).
* Masking rule: query ``t`` of request ``b`` attends key ``s`` iff ``s <= t`` and
  ``s < lengths[b]``. Scores are scaled by ``sm_scale`` (default ``D ** -0.5``); the softmax is
  in float32. Keys and values at positions ``>= lengths[b]`` are never read into a result (NaN
  or garbage there is harmless: the kernel does not load them, the reference masks both the
  scores and the V rows). A query with no allowed key (``lengths[b] == 0``) gets zeros. Rows at
  padded positions ``t >= lengths[b]`` are finite and otherwise unspecified (the xla and pallas
  implementations let them attend all ``lengths[b]`` keys; callers drop them).
* Returns o ``[B, T, Hq, D]`` in q's dtype.

"xla" (the reference, the default off the GPU): :func:`gqa_attention` over query chunks
of ``chunk`` tokens (default ``DEFAULT_CHUNK``), each attending all T keys under the mask above,
so memory is ``O(B * Hq * chunk * T)``; T not a multiple of the chunk is padded with zero queries
whose rows are dropped. The same math as the engine's prefill attention before this op.

"pallas" (Triton backend; ``interpret=True`` off the GPU): grid ``(cdiv(T, block_q), B * Hq)``;
program ``(i, b * Hq + j)`` takes query block ``nQ - 1 - i`` (heaviest blocks launch first) of
query head ``j`` of request ``b``, loads its ``[block_q, D]`` queries once and runs an online
softmax (running max / denominator / ``[block_q, D]`` accumulator in float32, base-2 exponent)
over key blocks of ``block_k`` keys. Only key blocks below ``min(q0 + block_q, lengths[b])``
(``q0``: the block's first query) are visited, so blocks past the causal diagonal and past the
prompt are skipped (causal prefill does about half the work of full attention, a short prompt
in a long bucket less). The visited blocks come in two loops: blocks entirely below the
diagonal and inside the prompt (every key allowed for every query of the block) are loaded and
used without any mask, and the at most ``ceil(block_q / block_k) + 1`` blocks that straddle the
diagonal or the prompt end are loaded with ``mask=key < lengths[b]`` (``other=0``: padding K/V
is never fetched) and their scores masked to ``-inf`` where ``key > query``. Rows past T are
masked on the q load and on the store. ``lengths[b]`` is read inside the kernel.

Dots: ``q @ k^T`` takes the inputs in their dtype with float32 accumulation; for ``p @ v`` the
probabilities ``p`` (float32, in ``[0, 1]``) are cast to v's dtype, as flash attention does. In
float32 both dots run at ``Precision.HIGHEST`` (IEEE, no TF32) and the kernel matches the
reference to about 1e-5; in bfloat16 the cast of ``p`` adds a relative error of up to 2**-9 per
weight on top of the output's own bf16 rounding, so kernel and reference agree to about 1e-2
(relative to the magnitude of v).

"cudnn" (GPU, bfloat16): cuDNN's flash attention through ``jax.nn.dot_product_attention``, with
K/V past the length zeroed first. "auto" (the GPU default, ``prefer_on_gpu``): "cudnn" where the
installed cuDNN accepts the call at trace time, else "pallas" (float32, no cuDNN).

Tunables (keywords of :func:`prefill_attention`; each implementation ignores the other's):
``block_q`` (default ``BLOCK_Q``), ``block_k`` (default ``BLOCK_K``): powers of two >= 16, lowered
to ``max(16, next_pow2(T))`` for short T; ``num_warps`` (default 8 when
``block_q * D >= 128 * 128``, else 4), ``num_stages`` (default ``NUM_STAGES``); ``chunk`` (xla).
D must be a power of two in [16, 256] for the kernel (64 or 128 in practice).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ._common import (implementations, interpret_mode, next_pow2, online_softmax_step,
                      prefer_on_cpu, prefer_on_gpu, register, resolve)

OP = "prefill_attention"
_LOG2E = math.log2(math.e)
DEFAULT_CHUNK = 2048  # query tokens per chunk of the reference (as the engine's prefill_chunk)
# defaults measured on the H200 (bench_prefill_attention_4224a6c.json, 8B-like 128k: 327 ms
# per layer against 483 ms with 2 stages, 388 ms with 64 x 64 blocks, 429 ms with 128 x 128)
BLOCK_Q = 128         # queries per program
BLOCK_K = 64          # keys per inner-loop step
NUM_STAGES = 3        # Triton software-pipelining stages of the key loop
def blocked_tile(T: int) -> int:
    """Query and key tokens per tile of the "blocked" formulation (CPU) for prompts of ``T``
    tokens: next_pow2(T) / 16 within [128, 512]. Measured per layer on 2 cores (SmolLM2's 9 / 3
    heads of 64, f32), tiles 128 / 256 / 512: T = 512: 5.8 / 7.2 / 12.0 ms; 2k: 63.7 / 61.2 /
    75.8 ms; 8k: - / 834 / 739 ms."""
    return min(512, max(128, next_pow2(T) // 16))
_TUNING = ("chunk", "block_q", "block_k", "num_warps", "num_stages")


def _check(q, k, v, lengths):
    """Raise ValueError unless q [B, T, Hq, D], k/v [B, T, H, D] (q's dtype), lengths [B] int."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be rank 4 [B, T, heads, D], got shape {x.shape}")
    B, T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {k.shape} != v shape {v.shape}")
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k/v shape {k.shape} must be [B={B}, T={T}, H, D={D}] to match q {q.shape}")
    H = k.shape[2]
    if H == 0 or Hq % H:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {H}")
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q dtype {q.dtype} must be bfloat16 or float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} and v dtype {v.dtype} must equal q dtype {q.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths shape {lengths.shape} != ({B},)")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths dtype {lengths.dtype} must be an integer type (int32)")


def _pow2_block(name, value, default, T):
    """A block size: ``value`` (or ``default``) checked to be a power of two >= 16, then lowered
    to ``max(16, next_pow2(T))`` when T is shorter."""
    b = default if value is None else int(value)
    if b < 16 or b & (b - 1):
        raise ValueError(f"{name}={b} must be a power of two >= 16 (tl.dot minimum)")
    return min(b, max(16, next_pow2(T)))


# --------------------------------------------------------------------------------------------
# References (pure jnp): masked GQA softmax attention, and the op over query chunks.
def gqa_attention(q, k, v, mask, sm_scale: float | None = None) -> jax.Array:
    """Masked softmax attention with grouped KV heads (pure jnp reference).

    q [B, T, Hq, D], k [B, S, H, D], v [B, S, H, D], mask [B, T, S] bool (True = attend).
    Query head i uses KV head i // (Hq // H). Returns [B, T, Hq, D] in q.dtype; a query with
    no allowed key gets zeros. Keys masked for every query may hold NaN/garbage.
    """
    B, T, Hq, D = q.shape
    H = k.shape[2]
    G = Hq // H
    scale = D ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(B, T, H, G, D)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    m5 = mask[:, None, None, :, :]
    s = jnp.where(m5, s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(m5, jnp.exp(s - mx), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    used = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]: key used by some query
    v = jnp.where(used, v, jnp.zeros((), v.dtype))
    o = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, Hq, D).astype(q.dtype)


@register(OP, "xla")
@functools.partial(jax.jit, static_argnames=_TUNING + ("sm_scale",))
def prefill_attention_xla(q, k, v, lengths, *, sm_scale=None, chunk=None, block_q=None,
                          block_k=None, num_warps=None, num_stages=None):
    """Reference: ``gqa_attention`` per chunk of ``chunk`` queries (default ``DEFAULT_CHUNK``)
    against all T keys; the kernel's tunables are ignored."""
    del block_q, block_k, num_warps, num_stages
    _check(q, k, v, lengths)
    B, T, Hq, D = q.shape
    if q.size == 0:
        return jnp.zeros_like(q)
    C = DEFAULT_CHUNK if chunk is None else int(chunk)
    if C < 1:
        raise ValueError(f"chunk={C} must be >= 1")
    C = min(C, T)
    n = -(-T // C)
    lengths = lengths.astype(jnp.int32)
    kidx = jnp.arange(T, dtype=jnp.int32)

    def one(qc, c0):
        qidx = c0 + jnp.arange(qc.shape[1], dtype=jnp.int32)
        mask = (kidx[None, None, :] <= qidx[None, :, None]) & (kidx[None, None, :] < lengths[:, None, None])
        return gqa_attention(qc, k, v, mask, sm_scale)

    if n == 1:
        return one(q, 0)
    qp = jnp.pad(q, ((0, 0), (0, n * C - T), (0, 0), (0, 0)))  # zero queries, rows dropped below
    out = lax.map(lambda c: one(lax.dynamic_slice_in_dim(qp, c * C, C, axis=1), c * C),
                  jnp.arange(n, dtype=jnp.int32))  # [n, B, C, Hq, D]
    return out.transpose(1, 0, 2, 3, 4).reshape(B, n * C, Hq, D)[:, :T]


# --------------------------------------------------------------------------------------------
# Blocked causal formulation in pure jnp (the default off the GPU): skips the tiles above the
# diagonal and past the longest prompt.
# --------------------------------------------------------------------------------------------
@register(OP, "blocked")
@functools.partial(jax.jit, static_argnames=_TUNING + ("sm_scale",))
def prefill_attention_blocked(q, k, v, lengths, *, sm_scale=None, chunk=None, block_q=None,
                              block_k=None, num_warps=None, num_stages=None):
    """Flash-attention tiling in jnp: ``block_q`` x ``block_q`` tiles (default
    :func:`blocked_tile`, at most ``next_pow2(T)``; ``block_k`` must be None or equal), a
    ``fori_loop`` over query blocks and, inside, over the key blocks up to the diagonal with an
    online softmax (base-2 exponent, float32; the denominator is a row sum of ``p``: a
    ``p @ [v, 1]`` product of width D + 1 ran 1.6x slower than ``p @ v`` on XLA:CPU).
    Tiles above the diagonal and past the longest prompt are not computed (about half the
    reference's work at full length); query blocks past the longest prompt get zeros. Only the
    tiles that straddle the diagonal or a prompt's end are masked (their V rows past the length
    zeroed). The other tunables are ignored."""
    del chunk, num_warps, num_stages
    _check(q, k, v, lengths)
    B, T, Hq, D = q.shape
    H = k.shape[2]
    G = Hq // H
    if q.size == 0:
        return jnp.zeros_like(q)
    C = blocked_tile(T) if block_q is None else int(block_q)
    if C < 1:
        raise ValueError(f"block_q={C} must be >= 1")
    if block_k is not None and int(block_k) != C:
        raise ValueError(f"the blocked implementation takes square tiles: block_k={block_k} "
                         f"must be None or block_q ({C})")
    C = min(C, next_pow2(T))
    n = -(-T // C)
    scale = (D ** -0.5 if sm_scale is None else float(sm_scale)) * _LOG2E
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, T)
    pad = ((0, 0), (0, n * C - T), (0, 0), (0, 0))
    # qb [B, H, n, C * G, D]: query rows (t, g) of a block in one matrix per KV head.
    # float32: the scale (with log2 e) folds into q, so the max reads the product directly;
    # bfloat16 q is scaled after the product, in float32, as the reference does
    q_scale, s_scale = (scale, None) if q.dtype == jnp.float32 else (None, scale)
    qb = q if q_scale is None else q * jnp.float32(q_scale)
    qb = jnp.pad(qb, pad).reshape(B, n, C, H, G, D).transpose(0, 3, 1, 2, 4, 5)
    qb = qb.reshape(B, H, n, C * G, D)
    kb = jnp.pad(k, pad).reshape(B, n, C, H, D).transpose(0, 3, 1, 2, 4)   # [B, H, n, C, D]
    vb = jnp.pad(v, pad).reshape(B, n, C, H, D).transpose(0, 3, 1, 2, 4)   # [B, H, n, C, D]
    n_full = jnp.min(lengths) // C              # key blocks inside every prompt: no mask
    n_used = (jnp.max(lengths) + C - 1) // C    # blocks holding some prompt's token
    row = lax.broadcasted_iota(jnp.int32, (C * G, C), 0) // G   # query offset of a score row
    col = lax.broadcasted_iota(jnp.int32, (C * G, C), 1)        # key offset of a score column

    def tile(i, j, carry, masked):
        m, l, acc, qi = carry   # l [B, H, C * G]: sum of p; acc [B, H, C * G, D]: of p * v
        kj = lax.dynamic_index_in_dim(kb, j, axis=2, keepdims=False)     # [B, H, C, D]
        vj = lax.dynamic_index_in_dim(vb, j, axis=2, keepdims=False)
        s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, preferred_element_type=jnp.float32)
        if s_scale is not None:
            s = s * s_scale
        if masked:
            key = j * C + col
            ok = (key <= i * C + row)[None] & (key[None] < lengths[:, None, None])   # [B, CG, C]
            s = jnp.where(ok[:, None], s, -jnp.inf)
            kv_ok = (j * C + col[0])[None, :] < lengths[:, None]                     # [B, C]
            vj = jnp.where(kv_ok[:, None, :, None], vj, jnp.zeros((), vj.dtype))
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # rows with no allowed key so far
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[..., None])
        pv = jnp.einsum("bhqk,bhkd->bhqd", p, vj.astype(jnp.float32))
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv, qi

    def query_block(i, out):
        qi = lax.dynamic_index_in_dim(qb, i, axis=2, keepdims=False)     # [B, H, C * G, D]
        carry = (jnp.full((B, H, C * G), -jnp.inf, jnp.float32),
                 jnp.zeros((B, H, C * G), jnp.float32),
                 jnp.zeros((B, H, C * G, D), jnp.float32), qi)
        lo = jnp.minimum(i, n_full)
        carry = lax.fori_loop(0, lo, lambda j, c: tile(i, j, c, False), carry)
        carry = lax.fori_loop(lo, jnp.minimum(i + 1, n_used), lambda j, c: tile(i, j, c, True),
                              carry)
        _, l, acc, _ = carry
        o = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)
        return lax.dynamic_update_index_in_dim(out, o, i, axis=2)

    out = lax.fori_loop(0, n_used, query_block, jnp.zeros((B, H, n, C * G, D), q.dtype))
    out = out.reshape(B, H, n, C, G, D).transpose(0, 2, 3, 1, 4, 5).reshape(B, n * C, Hq, D)
    return out[:, :T]


# --------------------------------------------------------------------------------------------
# Triton kernel: one program per (query block, request * query head), online softmax over keys.
# --------------------------------------------------------------------------------------------
def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, *, BQ, BK, G, scale2, precision):
    _, T, Hq, D = q_ref.shape
    i = pl.cdiv(T, BQ) - 1 - pl.program_id(0)  # the heaviest (last) query blocks first
    bh = pl.program_id(1)
    b, hq = bh // Hq, bh % Hq
    h = hq // G
    length = jnp.clip(len_ref[b], 0, T)
    q0 = i * BQ
    qpos = q0 + lax.broadcasted_iota(jnp.int32, (BQ, BK), 0)  # [BQ, BK] query position
    kofs = lax.broadcasted_iota(jnp.int32, (BQ, BK), 1)       # [BQ, BK] key offset in the block
    row_ok = jnp.broadcast_to((q0 + lax.broadcasted_iota(jnp.int32, (BQ, 1), 0)) < T, (BQ, D))
    q = pltriton.load(q_ref.at[b, pl.ds(q0, BQ), hq, :], mask=row_ok, other=0)  # [BQ, D]
    kv_ofs = lax.broadcasted_iota(jnp.int32, (BK, D), 0)

    # Keys needed by this block: s < kv_hi. Blocks j < n_full lie below the diagonal
    # ((j+1)*BK - 1 <= q0, the block's first query) and inside the prompt: no mask there.
    kv_hi = jnp.minimum(q0 + BQ, length)
    n_blocks = (kv_hi + BK - 1) // BK
    n_full = jnp.minimum(jnp.minimum(q0 + 1, length) // BK, n_blocks)

    def step(j, carry, masked):
        m, l, acc = carry
        k0 = j * BK
        if masked:  # keys past the prompt are not fetched (NaN there stays out)
            kv_ok = (k0 + kv_ofs) < length
            k = pltriton.load(k_ref.at[b, pl.ds(k0, BK), h, :], mask=kv_ok, other=0)
            v = pltriton.load(v_ref.at[b, pl.ds(k0, BK), h, :], mask=kv_ok, other=0)
        else:
            k = pltriton.load(k_ref.at[b, pl.ds(k0, BK), h, :])
            v = pltriton.load(v_ref.at[b, pl.ds(k0, BK), h, :])
        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale2  # [BQ, BK] f32, log2
        if masked:
            key = k0 + kofs
            s = jnp.where((key <= qpos) & (key < length), s, -jnp.inf)
        return online_softmax_step(m, l, acc, s, v, precision)

    carry = (jnp.full((BQ,), -jnp.inf, jnp.float32), jnp.zeros((BQ,), jnp.float32),
             jnp.zeros((BQ, D), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    _, l, acc = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # l == 0 (no key): acc == 0, zeros out
    pltriton.store(o_ref.at[b, pl.ds(q0, BQ), hq, :], out.astype(o_ref.dtype), mask=row_ok)


@register(OP, "pallas")
@functools.partial(jax.jit, static_argnames=_TUNING + ("sm_scale",))
def prefill_attention_pallas(q, k, v, lengths, *, sm_scale=None, chunk=None, block_q=None,
                             block_k=None, num_warps=None, num_stages=None):
    """Pallas (Triton) flash-attention kernel; ``chunk`` is ignored."""
    del chunk
    return _pallas_impl(q, k, v, lengths, sm_scale=sm_scale, block_q=block_q, block_k=block_k,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret_mode())


def _pallas_impl(q, k, v, lengths, *, sm_scale=None, block_q=None, block_k=None, num_warps=None,
                 num_stages=None, interpret=False):
    _check(q, k, v, lengths)
    B, T, Hq, D = q.shape
    H = k.shape[2]
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head_dim={D} must be a power of two in [16, 256] for the Pallas kernel")
    BQ = _pow2_block("block_q", block_q, BLOCK_Q, T)
    BK = _pow2_block("block_k", block_k, BLOCK_K, T)
    if q.size == 0:
        return jnp.zeros_like(q)
    if num_warps is None:
        num_warps = 8 if BQ * D >= 128 * 128 else 4
    num_stages = NUM_STAGES if num_stages is None else num_stages
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, BQ=BQ, BK=BK, G=Hq // H, scale2=scale * _LOG2E,
                               precision=precision)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))  # noqa: E731
    lengths = lengths.astype(jnp.int32)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, BQ), B * Hq),
        in_specs=[full(lengths), full(q), full(k), full(v)],
        out_specs=full(q),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_attention",
    )(lengths, q, k, v)


# --------------------------------------------------------------------------------------------
# cuDNN's fused flash attention (GPU only), for comparison and as the GPU default where faster.
# --------------------------------------------------------------------------------------------
@register(OP, "cudnn")
@functools.partial(jax.jit, static_argnames=_TUNING + ("sm_scale",))
def prefill_attention_cudnn(q, k, v, lengths, *, sm_scale=None, chunk=None, block_q=None,
                            block_k=None, num_warps=None, num_stages=None):
    """cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``
    (causal, ``key_value_seq_lengths``); GPU only, bfloat16 only. Rows of a length-0 prompt
    are set to zeros (cuDNN leaves them unspecified). The tunables are ignored."""
    del chunk, block_q, block_k, num_warps, num_stages
    _check(q, k, v, lengths)
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"the cudnn implementation takes bfloat16, got {q.dtype}: use 'pallas'")
    T, D = q.shape[1], q.shape[3]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, T)
    # cuDNN masks the scores of keys past the length but still multiplies their V rows by 0:
    # zero K/V there so garbage (NaN) in the padding stays out (one cheap pass over K/V)
    keep = (jnp.arange(T, dtype=jnp.int32)[None, :] < lengths[:, None])[:, :, None, None]
    k = jnp.where(keep, k, jnp.zeros((), k.dtype))
    v = jnp.where(keep, v, jnp.zeros((), v.dtype))
    o = jax.nn.dot_product_attention(q, k, v, scale=D ** -0.5 if sm_scale is None else sm_scale,
                                     is_causal=True, key_value_seq_lengths=lengths,
                                     implementation="cudnn")
    return jnp.where((lengths > 0)[:, None, None, None], o, jnp.zeros((), o.dtype))


@register(OP, "auto")
def prefill_attention_auto(q, k, v, lengths, *, sm_scale=None, **tuning):
    """The GPU default: cuDNN's flash attention for bfloat16 where the installed cuDNN accepts
    the call at trace time, else the Pallas kernel (float32, no or too old cuDNN). Measured on
    the H200 (``bench_prefill_attention``): cuDNN 1.2-1.7x faster than the kernel."""
    if q.dtype == jnp.bfloat16:
        try:
            return prefill_attention_cudnn(q, k, v, lengths, sm_scale=sm_scale, **tuning)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            _warn_no_cudnn(e)
    return prefill_attention_pallas(q, k, v, lengths, sm_scale=sm_scale, **tuning)


def _warn_no_cudnn(e):
    import warnings
    warnings.warn(f"prefill_attention: cuDNN flash attention unavailable ({type(e).__name__}: "
                  f"{str(e)[:200]}); using the Pallas kernel", RuntimeWarning, stacklevel=3)


prefer_on_gpu(OP, "auto")
prefer_on_cpu(OP, "blocked")


def prefill_attention(q, k, v, lengths, *, sm_scale=None, implementation=None, **tuning):
    """Causal GQA attention of a right-padded prompt batch (see the module docstring).

    q ``[B, T, Hq, D]``, k/v ``[B, T, H, D]`` (q's dtype, bf16 or f32), lengths ``[B]`` int32.
    ``sm_scale`` defaults to ``D ** -0.5``; ``implementation``: "pallas" / "xla" / "cudnn"
    (GPU, bf16) / "auto" (cuDNN where it applies, else Pallas; the GPU default) / None
    (:func:`jaxkv.kernels._common.resolve`). ``tuning``: ``chunk`` (xla), ``block_q``,
    ``block_k``, ``num_warps``, ``num_stages`` (pallas); the other implementation ignores them.
    Returns o ``[B, T, Hq, D]`` in q's dtype.
    """
    unknown = sorted(set(tuning) - set(_TUNING))
    if unknown:
        raise TypeError(f"prefill_attention: unknown tuning keywords {unknown}; known: {list(_TUNING)}")
    fn = resolve(OP, implementation)
    return fn(q, k, v, lengths, sm_scale=sm_scale, **tuning)


# --------------------------------------------------------------------------------------------
# Extend attention: tokens appended to a cached sequence (a continued context) attend to it.
# --------------------------------------------------------------------------------------------
OP_EXTEND = "extend_attention"
EXTEND_MAX_SCORES = 1 << 26    # the reference's scores per query chunk (elements)
EXTEND_BLOCK = 256             # keys per block of the blocked formulation


def _check_extend(q, k, v, positions, valid):
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {k.shape} / v {v.shape} must be [B={B}, S, H, D={D}]")
    if Hq % k.shape[2]:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {k.shape[2]}")
    if positions.shape != (B, T) or valid.shape != (B, T):
        raise ValueError(f"positions {positions.shape} and valid {valid.shape} must be [{B}, {T}]")


@register(OP_EXTEND, "xla")
@functools.partial(jax.jit, static_argnames=("sm_scale", "max_scores"))
def extend_attention_xla(q, k, v, positions, valid, *, sm_scale=None, max_scores=None):
    """Reference: :func:`gqa_attention` over chunks of queries (at most ``max_scores``, default
    ``EXTEND_MAX_SCORES``, scores per chunk), each against all S keys under the rule of
    :func:`extend_attention`."""
    _check_extend(q, k, v, positions, valid)
    B, T, Hq, D = q.shape
    S = k.shape[1]
    s_idx = jnp.arange(S, dtype=jnp.int32)
    cap = EXTEND_MAX_SCORES if max_scores is None else int(max_scores)
    C = max(1, min(T, cap // max(1, B * Hq * S)))
    n = -(-T // C)

    def one(qc, pc, vc):
        mask = vc[:, :, None] & (s_idx[None, None, :] <= pc[:, :, None])        # [B, C, S]
        return gqa_attention(qc, k, v, mask, sm_scale).astype(jnp.float32)

    if n == 1:
        return one(q, positions, valid)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, n * C - T)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    pieces = [jnp.moveaxis(pad(a).reshape((B, n, C) + a.shape[2:]), 1, 0)
              for a in (q, positions, valid)]
    out = lax.map(lambda c: one(*c), tuple(pieces))                             # [n, B, C, Hq, D]
    return jnp.moveaxis(out, 0, 1).reshape(B, n * C, Hq, D)[:, :T]


@register(OP_EXTEND, "blocked")
@functools.partial(jax.jit, static_argnames=("sm_scale", "block"))
def extend_attention_blocked(q, k, v, positions, valid, *, sm_scale=None, block=None):
    """The appended queries of each KV head as one ``[T * G, D]`` matrix, a ``fori_loop`` over
    key blocks of ``block`` keys (default ``EXTEND_BLOCK``) up to the last appended position,
    with an online softmax in float32 (base-2 exponent). Blocks below every request's first
    appended position are used without a mask; the rest are masked per row (the V rows past a
    request's last position zeroed). Padding rows get zeros."""
    _check_extend(q, k, v, positions, valid)
    B, T, Hq, D = q.shape
    S, H = k.shape[1], k.shape[2]
    G = Hq // H
    C = min(EXTEND_BLOCK if block is None else int(block), S)
    n = -(-S // C)
    scale = (D ** -0.5 if sm_scale is None else float(sm_scale)) * _LOG2E
    pad = ((0, 0), (0, n * C - S), (0, 0), (0, 0))
    kb = jnp.pad(k, pad).reshape(B, n, C, H, D).transpose(0, 3, 1, 2, 4)        # [B, H, n, C, D]
    vb = jnp.pad(v, pad).reshape(B, n, C, H, D).transpose(0, 3, 1, 2, 4)
    qb = (q.astype(jnp.float32) * jnp.float32(scale)).reshape(B, T, H, G, D)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(B, H, T * G, D)                   # rows (t, g)
    pos = jnp.where(valid, positions, -1).astype(jnp.int32)
    row_pos = jnp.repeat(pos, G, axis=1)                                        # [B, T * G]
    last = jnp.max(pos, axis=1)                                                 # [B]
    first = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
    n_full = jnp.clip(jnp.min(first) // C, 0, n)      # blocks every valid row reads whole
    n_used = jnp.clip((jnp.max(last) + C) // C, 0, n)
    col = jnp.arange(C, dtype=jnp.int32)

    def block_step(j, carry, masked):
        m, l, acc = carry
        kj = lax.dynamic_index_in_dim(kb, j, axis=2, keepdims=False)            # [B, H, C, D]
        vj = lax.dynamic_index_in_dim(vb, j, axis=2, keepdims=False).astype(jnp.float32)
        s = jnp.einsum("bhqd,bhkd->bhqk", qb, kj.astype(jnp.float32),
                       preferred_element_type=jnp.float32)
        if masked:
            key = j * C + col
            ok = key[None, None, :] <= row_pos[:, :, None]                      # [B, TG, C]
            s = jnp.where(ok[:, None], s, -jnp.inf)
            vj = jnp.where((key[None, :] <= last[:, None])[:, None, :, None], vj, 0.0)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[..., None])
        pv = jnp.einsum("bhqk,bhkd->bhqd", p, vj)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    carry = (jnp.full((B, H, T * G), -jnp.inf, jnp.float32), jnp.zeros((B, H, T * G), jnp.float32),
             jnp.zeros((B, H, T * G, D), jnp.float32))
    carry = lax.fori_loop(0, n_full, lambda j, c: block_step(j, c, False), carry)
    carry = lax.fori_loop(n_full, n_used, lambda j, c: block_step(j, c, True), carry)
    _, l, acc = carry
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o = o.reshape(B, H, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    return jnp.where(valid[:, :, None, None], o, 0.0)


prefer_on_cpu(OP_EXTEND, "blocked")
prefer_on_gpu(OP_EXTEND, "xla")


def extend_attention(q, k, v, positions, valid, *, sm_scale=None, implementation=None):
    """Attention of tokens appended to cached sequences (a continued context).

    q ``[B, T, Hq, D]`` the appended tokens' queries at ``positions`` ``[B, T]`` int32;
    ``valid`` ``[B, T]`` bool (False: padding, whose output is zeros); k, v ``[B, S, H, D]``
    each request's whole sequence by position, the appended tokens' K/V included. Query ``t``
    of request ``b`` attends key ``s`` iff ``s <= positions[b, t]``; keys past a request's last
    valid position are never read into a result (they may hold NaN). Any float dtypes; the
    softmax and the result are float32 ``[B, T, Hq, D]``. ``implementation``: "xla" (the
    reference, the GPU default) | "blocked" (the CPU default) | None; other names (the
    engine's "pallas") take the backend's default."""
    if implementation not in implementations(OP_EXTEND):
        implementation = None
    return resolve(OP_EXTEND, implementation)(q, k, v, positions, valid, sm_scale=sm_scale)
