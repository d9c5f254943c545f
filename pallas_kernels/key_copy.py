"""The decode step's write of one token's key into a two-stage selector's key copy, in place.

The copy is ``keys [L, B, H, Np, ps, D]`` (int8, or the KV dtype) with ``scales
[L, B, H, Np, ps]`` float32: head-major, one KV head's pages contiguous. Per request ``b`` the
new token at ``positions[b]`` goes to page ``positions[b] // ps``, slot ``positions[b] % ps``
of every KV head of layer ``layer``; a negative position, or one past the copy's pages,
writes nothing. The values come quantized (the caller's quantizer), so every implementation
stores the same bytes.

* ``store_key_copy_reference`` (``"xla"``): two XLA scatters, one per array.
* ``store_key_copy_pallas`` (``"pallas"``): one kernel for both arrays, grid ``(B, H)``, each
  program one head vector and its scale (both arrays aliased to the outputs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common

OP = "store_key_copy"


def _check(keys, scales, vals, scale, positions, page_size):
    if keys.ndim != 6 or scales.shape != keys.shape[:5]:
        raise ValueError(f"keys must be [L, B, H, Np, ps, D] and scales [L, B, H, Np, ps]; "
                         f"got {keys.shape}, {scales.shape}")
    _, B, H, _, ps, D = keys.shape
    if ps != page_size:
        raise ValueError(f"keys hold pages of {ps} tokens, page_size is {page_size}")
    if vals.shape != (B, H, D) or scale.shape != (B, H) or positions.shape != (B,):
        raise ValueError(f"vals [B, H, D] = {(B, H, D)}, scale [B, H] and positions [B] "
                         f"expected; got {vals.shape}, {scale.shape}, {positions.shape}")


@_common.register(OP, "xla")
def store_key_copy_reference(keys, scales, layer, vals, scale, positions, *, page_size,
                             **tuning):
    """Pure-jnp reference: scatters of ``vals`` [B, H, D] and ``scale`` [B, H] at each
    request's position (dropped where it is negative or past the pages); the kernel's tuning
    is ignored."""
    del tuning
    _check(keys, scales, vals, scale, positions, page_size)
    _, B, H, Np, ps, _ = keys.shape
    b = jnp.arange(B)[:, None]
    hh = jnp.arange(H)[None]
    page = jnp.where(positions >= 0, positions // ps, Np)[:, None]   # Np: dropped
    slot = (positions % ps)[:, None]
    keys = keys.at[layer, b, hh, page, slot].set(vals.astype(keys.dtype), mode="drop")
    return keys, scales.at[layer, b, hh, page, slot].set(scale.astype(scales.dtype),
                                                        mode="drop")


@_common.register(OP, "pallas")
def store_key_copy_pallas(keys, scales, layer, vals, scale, positions, *, page_size,
                          num_warps: int = 1):
    """Pallas: grid (B, H); program (b, h) stores ``vals[b, h]`` and ``scale[b, h]``."""
    _check(keys, scales, vals, scale, positions, page_size)
    _, B, H, Np, ps, D = keys.shape
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two (Triton blocks)")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)
    vals = vals.astype(keys.dtype)
    scale = scale.astype(scales.dtype)

    def kernel(layer_ref, pos_ref, vals_ref, scale_ref, keys_in, scales_in, keys_ref,
               scales_ref):
        del keys_in, scales_in  # aliased with the outputs
        b, h = pl.program_id(0), pl.program_id(1)
        pos = pos_ref[b]
        ok = (pos >= 0) & (pos // ps < Np)

        @pl.when(ok)
        def _():
            page, slot, lay = pos // ps, pos % ps, layer_ref[0]
            keys_ref[lay, b, h, page, slot, :] = vals_ref[b, h, :]
            scales_ref[lay, b, h, page, pl.ds(slot, 1)] = scale_ref[b, pl.ds(h, 1)]

    full = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                   jax.ShapeDtypeStruct(scales.shape, scales.dtype)),
        grid=(B, H),
        in_specs=[full(layer), full(positions), full(vals), full(scale), full(keys),
                  full(scales)],
        out_specs=(full(keys), full(scales)),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode(),
        name="store_key_copy",
    )(layer, positions, vals, scale, keys, scales)


def store_key_copy(keys, scales, layer, vals, scale, positions, *, page_size,
                   implementation=None, **tuning):
    """Store one token's quantized key per request into the key copy, in place.

    Args:
      keys: [L, B, H, Np, ps, D] the copy (int8 or the KV dtype); donated.
      scales: [L, B, H, Np, ps] float32, its scales; donated.
      layer: int32 scalar, the layer to write.
      vals: [B, H, D] the new token's key per request and KV head, as ``keys`` stores it.
      scale: [B, H] its scales.
      positions: [B] int32 token positions; negative (or past the pages): nothing written.
      page_size: static int, tokens per page (``ps``).
      implementation: "pallas" | "xla" | None (``_common.resolve``).
      **tuning: ``num_warps`` of the Pallas kernel.
    Returns:
      (keys, scales) with the tokens written.
    """
    fn = _common.resolve(OP, implementation)
    return fn(keys, scales, layer, vals, scale, positions, page_size=int(page_size), **tuning)
