"""Lowering for an (abstract) H200 without a GPU: runs the Pallas -> Triton lowering, which
enforces the Triton constraints (power-of-two blocks, supported primitives). Whole programs:
:mod:`jaxkv.lowering`."""
from jaxkv import lowering


def lower_for_h200(fn, *avals) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA on an abstract H200 (``avals``:
    ``jax.ShapeDtypeStruct`` arguments, shardings with memory kinds allowed)."""
    return lowering.lower(fn, *avals)
