"""Lowering for an (abstract) H200 without a GPU: runs the Pallas -> Triton lowering, which
enforces the Triton constraints (power-of-two blocks, supported primitives)."""
import jax


def lower_for_h200(fn, *avals) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA on an abstract H200 (``avals``:
    ``jax.ShapeDtypeStruct`` arguments, shardings with memory kinds allowed)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
