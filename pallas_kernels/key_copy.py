"""The two-stage selectors' device key copy (``jaxkv.selectors.rescore``): one decode token's
keys quantized and written into the copy, in place.

Operands: ``keys`` [L, B, H, Np, ps, D] (int8, or the KV dtype for an exact copy) with
``scales`` [L, B, H, Np, ps] float32 (a token's key is ``keys * scale``); ``layer`` int32
scalar; ``k_new`` [B, H, D], or the token's stacked K/V row [B, 2, H, D] (K taken);
``positions`` [B] int32 (the token's position; ``< 0``, an inactive request, or a page
``>= Np`` writes nothing). Result ``(keys, scales)``, in place when donated.

Quantization (``quantize``): int8 with one symmetric scale per vector, ``scale = max|k| *
float32(1 / 127)``, values ``round(k / scale)`` (a correctly rounded division, then half to
even) clipped to [-127, 127]; a copy in another dtype stores ``k`` itself with scale 1.

Two implementations of op ``write_key_copy``:

* ``"xla"``: the reference: ``quantize`` and two scatters;
* ``"pallas"``: one program per request quantizes its H key vectors and stores them and
  their scales (one launch; ``keys`` and ``scales`` are input/output aliases).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common
from ._common import register

OP = "write_key_copy"
_INV127 = float(np.float32(1.0) / np.float32(127.0))  # the scale is max|k| times this float32


def _round_half_even(x):
    """``jnp.round`` of float32 ``x`` (ties to even) from ``floor`` (Triton has no round):
    exact for |x| < 2**23."""
    f = jnp.floor(x)
    frac = x - f
    odd = f - 2.0 * jnp.floor(f * 0.5) != 0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return jnp.where(up, f + 1.0, f)


def quantize(k, bits: int):
    """k [..., D] -> (values, scale [...]): int8 with a symmetric scale per vector when
    ``bits == 8``, else k itself and ones."""
    if bits != 8:
        return k, jnp.ones(k.shape[:-1], jnp.float32)
    kf = k.astype(jnp.float32)
    scale = jnp.max(jnp.abs(kf), axis=-1) * _INV127
    q = jnp.round(kf / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def _check(keys, scales, k_new, positions):
    if keys.ndim != 6 or scales.shape != keys.shape[:5]:
        raise ValueError(f"keys must be [L, B, H, Np, ps, D] and scales [L, B, H, Np, ps], got "
                         f"{keys.shape} and {scales.shape}")
    _, B, H, _, _, D = keys.shape
    if k_new.shape not in ((B, H, D), (B, 2, H, D)):
        raise ValueError(f"k_new must be [B, H, D] = [{B}, {H}, {D}] or the stacked K/V row "
                         f"[{B}, 2, {H}, {D}], got {k_new.shape}")
    if positions.shape != (B,):
        raise ValueError(f"positions must be [B] = [{B}], got {positions.shape}")


@register(OP, "xla")
def write_key_copy_reference(keys, scales, layer, k_new, positions):
    """The reference: ``quantize`` and two scatters (``mode="drop"``)."""
    _check(keys, scales, k_new, positions)
    _, B, H, Np, ps, _ = keys.shape
    k = k_new if k_new.ndim == 3 else k_new[:, 0]
    vals, scale = quantize(k, 8 if keys.dtype == jnp.int8 else 16)
    b = jnp.arange(B)[:, None]
    hh = jnp.arange(H)[None, :]
    positions = jnp.asarray(positions, jnp.int32)
    page = jnp.where(positions >= 0, positions // ps, Np)[:, None]  # Np: dropped
    slot = (jnp.maximum(positions, 0) % ps)[:, None]
    keys = keys.at[layer, b, hh, page, slot].set(vals.astype(keys.dtype), mode="drop")
    scales = scales.at[layer, b, hh, page, slot].set(scale, mode="drop")
    return keys, scales


def _div_rn(a, b, interpret: bool):
    """``a / b`` (float32) rounded to nearest, as XLA divides: Triton's ``/`` is the
    approximate ``div.full.f32`` (off by an ulp, which moves values at a rounding tie)."""
    if interpret:
        return a / b
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _kernel(layer_ref, pos_ref, k_ref, keys_in, scales_in, keys_ref, scales_ref, *, ps, Np,
            int8, interpret):
    del keys_in, scales_in  # aliased with keys_ref, scales_ref
    b = pl.program_id(0)
    pos = pos_ref[b]
    ok = (pos >= 0) & (pos < Np * ps)
    page = jnp.where(ok, pos // ps, 0)
    slot = jnp.where(ok, pos % ps, 0)
    layer = layer_ref[0]
    k = k_ref[...].astype(jnp.float32)                                  # [H, D]
    H, D = k.shape
    if int8:
        scale = jnp.max(jnp.abs(k), axis=1) * _INV127                   # [H]
        x = _div_rn(k, jnp.broadcast_to(jnp.where(scale > 0, scale, 1.0)[:, None], k.shape),
                    interpret)
        vals = jnp.clip(_round_half_even(x), -127.0, 127.0)
    else:
        scale = jnp.ones((H,), jnp.float32)
        vals = k
    h = lax.broadcasted_iota(jnp.int32, (H, D), 0)
    d = lax.broadcasted_iota(jnp.int32, (H, D), 1)
    plgpu.store(keys_ref.at[layer, b, h, page, slot, d], vals.astype(keys_ref.dtype),
                mask=jnp.full((H, D), ok))
    hs = lax.broadcasted_iota(jnp.int32, (H,), 0)
    plgpu.store(scales_ref.at[layer, b, hs, page, slot], scale, mask=jnp.full((H,), ok))


@register(OP, "pallas")
def write_key_copy_pallas(keys, scales, layer, k_new, positions, *, num_warps: int = 1,
                          interpret: bool | None = None):
    """The Pallas kernel (module docstring): grid (B,). H and D must be powers of two (Triton
    blocks); other shapes take the reference."""
    _check(keys, scales, k_new, positions)
    _, B, H, Np, ps, D = keys.shape
    if H & (H - 1) or D & (D - 1):
        return write_key_copy_reference(keys, scales, layer, k_new, positions)
    interpret = _common.interpret_mode() if interpret is None else interpret
    kernel = functools.partial(_kernel, ps=ps, Np=Np, int8=keys.dtype == jnp.int8,
                               interpret=interpret)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    if k_new.ndim == 3:
        k_spec = pl.BlockSpec((None, H, D), lambda b: (b, 0, 0))
    else:  # the stacked K/V row: K read in place
        k_spec = pl.BlockSpec((None, None, H, D), lambda b: (b, 0, 0, 0))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                   jax.ShapeDtypeStruct(scales.shape, scales.dtype)),
        grid=(B,),
        in_specs=[pl.BlockSpec((1,), lambda b: (0,)), full(positions), k_spec, full(keys),
                  full(scales)],
        out_specs=(full(keys), full(scales)),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret,
        name="write_key_copy",
    )(layer_arr, positions, k_new, keys, scales)


def write_key_copy(keys, scales, layer, k_new, positions, *, implementation=None):
    """One token's keys into the copy (module docstring); ``implementation`` picks the kernel
    or the reference (``_common.resolve``)."""
    return _common.resolve(OP, implementation)(keys, scales, layer, k_new, positions)
