"""A two-stage selector's key copy: its quantizer, and the decode step's write of one token's
key into it, in place.

The copy is ``keys [L, B, H, Np, ps, D]`` (int8, or the KV dtype) with ``scales
[L, B, H, Np, ps]`` float32: head-major, one KV head's pages contiguous. An int8 copy holds
each key vector as ``round(k / s)`` with ``s = max|k| / 127`` (:func:`quantize`); a copy in the
KV dtype holds the key itself with scale 1.

``store_key_copy(keys, scales, layer, k_new, positions)``: per request ``b`` the new token's
key ``k_new[b]`` [H, D], quantized, goes to page ``positions[b] // ps``, slot
``positions[b] % ps`` of every KV head of layer ``layer``; a negative position, or one past
the copy's pages, writes nothing.

* ``store_key_copy_reference`` (``"xla"``): :func:`quantize`, then two XLA scatters.
* ``store_key_copy_pallas`` (``"pallas"``): one kernel, grid ``(B, H)``; each program
  quantizes one head vector and stores it and its scale (both arrays aliased to the outputs).
  Its division is Triton's, which may differ from XLA's in the last bit, so a value may land
  one step away where ``k / s`` lies within a few ulp of a rounding midpoint: the same copy to
  rounding (equal bit for bit in interpret mode).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common

OP = "store_key_copy"

# 1.5 * 2**23: for |x| < 2**22, (x + M) - M in float32 is x rounded to the nearest integer,
# ties to even (the sum's ulp is 1). Pallas' Triton lowering has no round primitive.
_RNE_MAGIC = 12582912.0


def quantize(k, bits: int):
    """k [..., D] -> (values, scale [...]): int8 with a symmetric scale per vector when
    ``bits == 8``, else k itself and ones."""
    if bits != 8:
        return k, jnp.ones(k.shape[:-1], jnp.float32)
    kf = k.astype(jnp.float32)
    scale = jnp.max(jnp.abs(kf), axis=-1) / 127.0
    q = jnp.round(kf / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def key_bits(keys) -> int:
    """8 for an int8 copy, else 16 (the KV dtype, stored as it is)."""
    return 8 if keys.dtype == jnp.int8 else 16


def _check(keys, scales, k_new, positions, page_size):
    if keys.ndim != 6 or scales.shape != keys.shape[:5]:
        raise ValueError(f"keys must be [L, B, H, Np, ps, D] and scales [L, B, H, Np, ps]; "
                         f"got {keys.shape}, {scales.shape}")
    _, B, H, _, ps, D = keys.shape
    if ps != page_size:
        raise ValueError(f"keys hold pages of {ps} tokens, page_size is {page_size}")
    if k_new.shape != (B, H, D) or positions.shape != (B,):
        raise ValueError(f"k_new [B, H, D] = {(B, H, D)} and positions [B] = {(B,)} expected; "
                         f"got {k_new.shape}, {positions.shape}")


def scatter_keys(keys, scales, layer, k, positions):
    """:func:`quantize` ``k`` [B, ..., H, D] and scatter it with its scales at ``positions``
    [B, ...] (a decode step's [B], a continued turn's [B, T]); a negative position, or one
    past the pages, writes nothing."""
    Np, ps = keys.shape[3:5]
    vals, scale = quantize(k, key_bits(keys))
    lead, H = positions.ndim, k.shape[-2]
    b = jnp.arange(positions.shape[0])[(slice(None),) + (None,) * lead]
    hh = jnp.arange(H)[(None,) * lead]
    page = jnp.where(positions >= 0, positions // ps, Np)[..., None]  # Np: dropped
    slot = (positions % ps)[..., None]
    keys = keys.at[layer, b, hh, page, slot].set(vals.astype(keys.dtype), mode="drop")
    return keys, scales.at[layer, b, hh, page, slot].set(scale.astype(scales.dtype),
                                                        mode="drop")


@_common.register(OP, "xla")
def store_key_copy_reference(keys, scales, layer, k_new, positions, *, page_size, **tuning):
    """Pure-jnp reference: :func:`scatter_keys` of the decode step's [B, H, D] keys; the
    kernel's tuning is ignored."""
    del tuning
    _check(keys, scales, k_new, positions, page_size)
    return scatter_keys(keys, scales, layer, k_new, positions)


@_common.register(OP, "pallas")
def store_key_copy_pallas(keys, scales, layer, k_new, positions, *, page_size,
                          num_warps: int = 1):
    """Pallas: grid (B, H); program (b, h) quantizes ``k_new[b, h]`` and stores it and its
    scale."""
    _check(keys, scales, k_new, positions, page_size)
    _, B, H, Np, ps, D = keys.shape
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two (Triton blocks)")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)
    int8 = key_bits(keys) == 8

    def kernel(layer_ref, pos_ref, k_ref, keys_in, scales_in, keys_ref, scales_ref):
        del keys_in, scales_in  # aliased with the outputs
        b, h = pl.program_id(0), pl.program_id(1)
        pos = pos_ref[b]
        ok = (pos >= 0) & (pos // ps < Np)

        @pl.when(ok)
        def _():
            k = k_ref[pl.ds(b, 1), h, :].astype(jnp.float32)           # [1, D]
            if int8:
                s = jnp.max(jnp.abs(k), axis=-1) / 127.0                 # [1]
                x = k / jnp.where(s > 0, s, 1.0)[:, None]
                x = (x + _RNE_MAGIC) - _RNE_MAGIC
                v = jnp.clip(x, -127.0, 127.0).astype(jnp.int8)
            else:
                s, v = jnp.ones((1,), jnp.float32), k.astype(keys_ref.dtype)
            page, slot, lay = pos // ps, pos % ps, layer_ref[0]
            keys_ref[lay, b, h, page, pl.ds(slot, 1), :] = v
            scales_ref[lay, b, h, page, pl.ds(slot, 1)] = s

    full = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                   jax.ShapeDtypeStruct(scales.shape, scales.dtype)),
        grid=(B, H),
        in_specs=[full(layer), full(positions), full(k_new), full(keys), full(scales)],
        out_specs=(full(keys), full(scales)),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode(),
        name="store_key_copy",
    )(layer, positions, k_new, keys, scales)


def store_key_copy(keys, scales, layer, k_new, positions, *, page_size, implementation=None,
                   **tuning):
    """Quantize one token's key per request and store it into the key copy, in place.

    Args:
      keys: [L, B, H, Np, ps, D] the copy (int8, or the KV dtype); donated.
      scales: [L, B, H, Np, ps] float32, its scales; donated.
      layer: int32 scalar, the layer to write.
      k_new: [B, H, D] the new token's key per request and KV head (any float dtype).
      positions: [B] int32 token positions; negative (or past the pages): nothing written.
      page_size: static int, tokens per page (``ps``).
      implementation: "pallas" | "xla" | None (``_common.resolve``).
      **tuning: ``num_warps`` of the Pallas kernel.
    Returns:
      (keys, scales) with the tokens written.
    """
    fn = _common.resolve(OP, implementation)
    return fn(keys, scales, layer, k_new, positions, page_size=int(page_size), **tuning)
