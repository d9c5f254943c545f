"""Quantized page rows (fp8 or int8): K/V per token and head, with power-of-two scales in
the row.

A page array (the host tier or the device pool) of a quantized dtype (``QUANT_DTYPES``: the
two fp8 formats and int8) keeps each (layer, page) row contiguous, payload first, scales after
it::

    columns [0, 2*H*ps*D)                 payload [2 (K, V), H, ps, D], fp8 or int8 values
    columns [2*H*ps*D, 2*H*ps*(D + 1))    scales  [2 (K, V), H, ps], one byte each

A token's K (or V) vector of one head is ``payload * scale(e)``, where ``e`` is the scale byte
(the bit pattern stored in the array, read as uint8) and the scale depends on the payload:

- fp8: ``2**(e - 127)``, an E8M0 exponent as in the OCP microscaling formats; the payload is
  the format's rounding of ``x / scale``. Power-of-two scales keep fp8's relative precision
  (only the range moves) and make ``x / scale`` exact.
- int8: ``2**(e / 4 - 48)``, quarter powers of two from ``2**-48`` to ``2**15.5`` (``e`` in
  [0, 254]); the payload rounds ``x / scale`` to the nearest integer (half to even) in
  [-127, 127]. The vector's largest element lands in (106.8, 127], against (63.5, 127] with
  power-of-two scales: on real keys and values the attention error falls 21-29% for the
  same byte (``benchmarks/probes/fp8_rotation.py``; docs/decisions.md). int8 keeps about 7
  bits relative to the vector's largest element, against fp8 e4m3's 3 mantissa bits
  relative to each element: its keys err 2.3-4.2x less than fp8's. Vectors beyond
  ``127 * 2**15.5`` (about 5.9e6) saturate; real K and V stay four orders of magnitude below
  (on 2k tokens of text the largest element is 216 in Qwen2.5-Coder-0.5B's keys, 23 in
  SmolLM2-135M's; the smallest vector's largest element is 0.03).

Code 255 is never a finite vector's. For int8 it reads as NaN: a vector holding an inf or NaN
gets it (its payload is 0), so the failure propagates as it would in a float cache, and rows
of all-ones bytes (payload -1, scale NaN) poison a test. For fp8 it reads as ``2**128`` (inf);
fp8 payloads carry NaN themselves.

Granularity: one scale per (token, KV head, K or V), so a decode step's write-through
quantizes the new token on its own and never rewrites the rest of its page (a scale per page
would need the page's maximum before its tokens exist). Cost: one byte per
``D`` payload bytes (0.8% at D = 128). Dequantization is ``payload * scale`` in float32, in
the kernels and in the numpy reference alike, bit for bit.

``e`` is the smallest code with ``amax <= fmax * scale(e)`` (``amax`` the vector's largest
magnitude, ``fmax`` = :func:`format_max`: fp8's largest finite value, 127 for int8), clipped
to fp8's [1, 254] or int8's [0, 254]; an all-zero vector gets the smallest code. Other dtypes
have no scales: their rows are the payload only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import _common

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
QUANT_DTYPES = FP8_DTYPES + ("int8",)
EXP_BIAS = 127
_E_MIN, _E_MAX = 1, 254            # fp8's scale codes
I8_STEPS, I8_OFFSET = 4, 192        # int8: scale(e) = 2**((e - I8_OFFSET) / I8_STEPS)
_I8_MIN, _I8_MAX = 0, 254
_I8_FRAC = np.float32(2.0) ** (np.arange(I8_STEPS, dtype=np.float32) / I8_STEPS)
NAN_CODE = 255


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).name in FP8_DTYPES


def bits(a):
    """An fp8 array as uint8 (the same bytes), any other array as it is. XLA's own paths move
    fp8 data through it: XLA:CPU widens an fp8 array around a gather, scatter or dynamic
    update of it (a dynamic update of one row of a 25 MB fp8 array: 83 ms, of its uint8 view
    0.6 ms; :func:`from_bits` turns the bytes back)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint8) if is_fp8(a.dtype) else a


def bytes_movable(a) -> bool:
    """Whether XLA's paths may move ``a``'s rows through :func:`bits`: device arrays, and
    host arrays on the CPU, where host and device memory are the same RAM (on a GPU an op on
    a pinned_host array's bits could copy the whole array; those paths keep the dtype)."""
    return (jax.typeof(a).memory_space != jax.memory.Space.Host
            or _common.backend() == "cpu")


def from_bits(a, dtype):
    """:func:`bits`' inverse: ``a`` (uint8 when ``dtype`` is fp8) as ``dtype``."""
    return jax.lax.bitcast_convert_type(a, jnp.dtype(dtype)) if a.dtype != jnp.dtype(dtype) else a


def is_quantized(dtype) -> bool:
    """Rows of payload + per-token scale bytes (fp8 or int8)."""
    return jnp.dtype(dtype).name in QUANT_DTYPES


def format_max(dtype) -> float:
    """The payload's largest magnitude: the fp8 format's largest finite value, 127 for int8."""
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(ml_dtypes.finfo(dtype).max)


def tail_elems(dtype, num_kv_heads: int, page_size: int) -> int:
    """Scale bytes after the payload of one row: ``2 * H * ps`` when quantized, else 0."""
    return 2 * num_kv_heads * page_size if is_quantized(dtype) else 0


def row_elems(dtype, num_kv_heads: int, page_size: int, head_dim: int) -> int:
    """Elements of one page row of a ``dtype`` page array."""
    return 2 * num_kv_heads * page_size * head_dim + tail_elems(dtype, num_kv_heads, page_size)


def token_elems(dtype, num_kv_heads: int, head_dim: int) -> int:
    """Elements of one encoded token (:func:`encode_tokens`): ``2 * H * D`` (+ ``2 * H``)."""
    return 2 * num_kv_heads * (head_dim + (1 if is_quantized(dtype) else 0))


def compute_dtype(q_dtype, kv_dtype):
    """The dtype the attention kernels multiply in: q's for a quantized cache, else the wider
    of the two (an f32 cache under a bf16 model keeps its precision). int8 payloads convert
    to bf16 exactly (|v| <= 127)."""
    if is_quantized(kv_dtype):
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, kv_dtype)


# --------------------------------------------------------------------------------------------
# jnp
# --------------------------------------------------------------------------------------------
def _exponent(amax, fmax: float):
    """Biased exponent (int32) of the smallest power of two s with amax <= fmax * s."""
    m_a, e_a = jnp.frexp(amax)
    _, e_f = np.frexp(np.float32(fmax))
    e = e_a - int(e_f)
    e = e + (amax > jnp.ldexp(jnp.float32(fmax), e)).astype(jnp.int32)
    e = jnp.where(amax > 0, e + EXP_BIAS, _E_MIN)
    return jnp.clip(e, _E_MIN, _E_MAX).astype(jnp.int32)


def hadamard(dim: int):
    """The normalized Hadamard matrix [dim, dim] float32 (Sylvester's construction; symmetric
    and orthogonal: ``R @ R = I``), for a power-of-two ``dim``."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"hadamard needs a power-of-two dimension, got {dim}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return jnp.asarray(h / np.sqrt(np.float32(dim)))


def _is_int8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.int8


def scale_of(e, dtype):
    """The float32 scale of scale codes ``e`` (any int dtype) for a ``dtype`` payload, built
    from the exponent bits of an f32 (no exp2): ``2**(e - 127)`` for fp8; for int8
    ``2**((e >> 2) - 48)`` times one of the four constants ``2**(j / 4)``, ``j = e & 3``.
    int8's code 255 is NaN. Pallas kernels call this too (Triton and interpret mode)."""
    e = e.astype(jnp.int32)
    if not _is_int8(dtype):
        return jax.lax.bitcast_convert_type(e << 23, jnp.float32)
    base = jax.lax.bitcast_convert_type(((e >> 2) + (EXP_BIAS - I8_OFFSET // I8_STEPS)) << 23,
                                        jnp.float32)
    j = e & (I8_STEPS - 1)
    frac = jnp.where(j == 0, _I8_FRAC[0], jnp.where(j == 1, _I8_FRAC[1],
                     jnp.where(j == 2, _I8_FRAC[2], _I8_FRAC[3])))
    return jnp.where(e == NAN_CODE, jnp.float32(jnp.nan), base * frac)


def _int8_code(amax):
    """int8's scale code (int32): the smallest e in [0, 254] with amax <= 127 * scale(e);
    ``NAN_CODE`` for a vector with an inf or NaN, so it dequantizes to NaN and the failure
    shows downstream as it would in a float cache (an int8 payload cannot hold it)."""
    est = jnp.ceil(I8_STEPS * jnp.log2(jnp.maximum(amax, 1e-38) / 127.0)).astype(jnp.int32)
    e = jnp.clip(est + I8_OFFSET, _I8_MIN + 1, _I8_MAX - 1)
    fits = lambda c: amax <= jnp.float32(127.0) * scale_of(c, jnp.int8)  # noqa: E731
    e = jnp.where(fits(e - 1), e - 1, e)           # log2's estimate may be one code high
    e = jnp.where(fits(e), e, e + 1)               # ... or one low
    e = jnp.clip(jnp.where(amax > 0, e, _I8_MIN), _I8_MIN, _I8_MAX)
    return jnp.where(jnp.isfinite(amax), e, NAN_CODE)


def quantize(x, dtype):
    """x [..., D] float -> (payload [..., D] ``dtype``, e [...] uint8 biased exponents)."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    if dtype == jnp.int8:
        e = _int8_code(amax)
        y = jnp.clip(jnp.round(x / scale_of(e, dtype)[..., None]), -127, 127)
        y = jnp.where(jnp.isnan(y), 0.0, y)                    # NaN vectors: the scale says so
    else:
        e = _exponent(amax, format_max(dtype))
        y = x / scale_of(e, dtype)[..., None]                  # exact: 2**k
    return y.astype(dtype), e.astype(jnp.uint8)


def dequantize(payload, e):
    """payload [..., D] fp8 or int8, e [...] uint8 -> float32 [..., D]. fp8 goes through
    bfloat16, which holds every e4m3 and e5m2 value exactly: XLA:CPU converts fp8 -> bf16 ->
    f32 3x faster than fp8 -> f32."""
    p = payload.astype(jnp.bfloat16) if is_fp8(payload.dtype) else payload
    return p.astype(jnp.float32) * scale_of(e, payload.dtype)[..., None]


def exps_as(e, dtype):
    """uint8 exponents as the bit patterns of a quantized array's elements (and back with
    ``exps_of``)."""
    return jax.lax.bitcast_convert_type(e.astype(jnp.uint8), jnp.dtype(dtype))


def exps_of(stored):
    return jax.lax.bitcast_convert_type(stored, jnp.uint8)


def encode_tokens(kv, dtype):
    """One token's K/V per entry, ``kv`` [M, 2, H, D] (any float dtype), as ``dtype``
    elements [M, token_elems]: the ``2 * H`` head vectors (K heads then V heads), then, when
    quantized, their ``2 * H`` scale bytes in the same order."""
    M, _, H, D = kv.shape   # explicit widths: a reshape to -1 fails with no entries
    if not is_quantized(dtype):
        return kv.astype(dtype).reshape(M, 2 * H * D)
    payload, e = quantize(kv, dtype)
    return jnp.concatenate([payload.reshape(M, 2 * H * D),
                            exps_as(e, dtype).reshape(M, 2 * H)], axis=1)


def token_columns(num_kv_heads: int, page_size: int, head_dim: int, offset, dtype):
    """Columns of a row that an encoded token at ``offset`` (int or int32 scalar) occupies,
    in :func:`encode_tokens`' order ([token_elems] int32)."""
    H, ps, D = num_kv_heads, page_size, head_dim
    seg = jnp.arange(2 * H, dtype=jnp.int32)
    cols = ((seg[:, None] * ps + offset) * D + jnp.arange(D, dtype=jnp.int32)).reshape(-1)
    if is_quantized(dtype):
        cols = jnp.concatenate([cols, 2 * H * ps * D + seg * ps + offset])
    return cols


def encode_rows(kv, dtype):
    """Pages ``kv`` [..., 2, H, ps, D] (any float dtype) -> rows [..., row_elems] of a
    ``dtype`` page array (layout in the module docstring)."""
    lead = kv.shape[:-4]
    if not is_quantized(dtype):
        return kv.astype(dtype).reshape(lead + (-1,))
    payload, e = quantize(kv, dtype)                           # e [..., 2, H, ps]
    return jnp.concatenate([payload.reshape(lead + (-1,)), exps_as(e, dtype).reshape(lead + (-1,))],
                           axis=-1)


def pack_pages(k, v, page_size: int, dtype):
    """k, v [B, T, H, D] (T a multiple of page_size) -> rows [B, T / ps, row_elems] of a
    ``dtype`` page array (layout in the module docstring)."""
    B, T, H, D = k.shape
    kv = jnp.stack([k, v], axis=2)                             # [B, T, 2, H, D]
    kv = kv.reshape(B, T // page_size, page_size, 2, H, D)
    return encode_rows(kv.transpose(0, 1, 3, 4, 2, 5), dtype)  # [B, n, 2, H, ps, D] -> rows


def unpack_rows(rows, num_kv_heads: int, page_size: int, head_dim: int):
    """rows [..., row_elems] of a page array -> float32 [..., 2, H, ps, D] (dequantized)."""
    H, ps, D = num_kv_heads, page_size, head_dim
    lead = rows.shape[:-1]
    payload = rows[..., :2 * H * ps * D].reshape(lead + (2, H, ps, D))
    if not is_quantized(rows.dtype):
        return payload.astype(jnp.float32)
    e = exps_of(rows[..., 2 * H * ps * D:]).reshape(lead + (2, H, ps))
    return dequantize(payload, e)


# --------------------------------------------------------------------------------------------
# numpy reference (ml_dtypes for the fp8 types)
# --------------------------------------------------------------------------------------------
def scale_of_np(e, dtype):
    """numpy reference of :func:`scale_of`."""
    e = np.asarray(e, np.int64)
    if np.dtype(jnp.dtype(dtype)) != np.int8:
        return np.ldexp(np.float32(1), e - EXP_BIAS).astype(np.float32)
    base = np.ldexp(np.float32(1), (e >> 2) - I8_OFFSET // I8_STEPS).astype(np.float32)
    s = (base * _I8_FRAC[e & (I8_STEPS - 1)]).astype(np.float32)
    return np.where(e == NAN_CODE, np.float32(np.nan), s).astype(np.float32)


def quantize_np(x, dtype):
    """numpy reference of :func:`quantize`: x [..., D] -> (payload ``dtype``, e uint8)."""
    dtype = np.dtype(jnp.dtype(dtype))
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=-1)
    int8 = dtype == np.int8
    fmax = 127.0 if int8 else float(ml_dtypes.finfo(dtype).max)
    lo, hi = (_I8_MIN, _I8_MAX) if int8 else (_E_MIN, _E_MAX)
    codes = np.arange(lo, hi + 1)
    with np.errstate(over="ignore"):                     # fp8's top codes: inf, never chosen
        fits = (np.float32(fmax) * scale_of_np(codes, dtype)).astype(np.float32)  # increasing
    e = lo + np.minimum(np.searchsorted(fits, amax, side="left"), hi - lo)    # smallest that fits
    e = np.where(amax > 0, e, lo)
    if int8:  # a vector with an inf or NaN: code 255, NaN
        e = np.where(np.isfinite(amax), e, NAN_CODE)
    with np.errstate(invalid="ignore"):
        y = x / scale_of_np(e, dtype)[..., None]
    if int8:  # np.round: half to even, as jnp.round; a NaN vector's payload is 0
        y = np.nan_to_num(np.clip(np.round(y), -127, 127), nan=0.0)
    return y.astype(dtype), e.astype(np.uint8)


def dequantize_np(payload, e):
    """numpy reference of :func:`dequantize`."""
    payload = np.asarray(payload)
    return payload.astype(np.float32) * scale_of_np(e, payload.dtype)[..., None]
