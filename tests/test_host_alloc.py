"""The zeroed host tier is built on the host (``jaxkv.cache.host_zeros``), never in a program.

A jitted ``jnp.zeros`` with a pinned_host output is computed in device memory and copied
out, so a tier larger than the free device memory failed on the H200 (probe_host_capacity).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import CacheSpec, compile_stats
from jaxkv import cache as kvcache
from jaxkv.kernels import page_write

GiB = 1 << 30


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_host_zeros_is_zero_pinned_and_typed_host(dtype):
    x = kvcache.host_zeros((6, 40), dtype, kvcache.host_sharding())
    assert x.dtype == jnp.dtype(dtype) and x.shape == (6, 40)
    assert x.sharding.memory_kind == "pinned_host"
    assert jax.typeof(x).memory_space == jax.memory.Space.Host  # a loop carry keeps it
    np.testing.assert_array_equal(np.asarray(x, np.float32), 0)

    # written in place through a donated jit, like the decode step's write-through
    out = jax.jit(lambda h: page_write.keep_on_host(page_write.write_pages(
        h, jnp.array([2], jnp.int32), jnp.ones((1, 40), dtype))),
        donate_argnums=0, out_shardings=kvcache.host_sharding())(x)
    np.testing.assert_array_equal(np.asarray(out, np.float32).sum(axis=1), [0, 0, 40, 0, 0, 0])


def test_host_zeros_runs_no_program():
    """The guard against a return of the in-program allocator: making the tier compiles
    nothing (a jitted zeros would, and on the GPU it would stage the tier in device memory)."""
    snap = compile_stats.snapshot()
    for rows in (5, 11):  # a new shape each time: a program would compile again
        kvcache.host_zeros((rows, 24), "bfloat16", kvcache.host_sharding()).block_until_ready()
    assert compile_stats.since(snap)["count"] == 0


def test_host_zeros_over_a_mesh():
    devs = np.array(jax.devices()[:1])
    sh = NamedSharding(Mesh(devs, ("kv",)), P("kv"), memory_kind="pinned_host")
    x = kvcache.host_zeros((len(devs), 3, 8), "bfloat16", sh)
    assert x.sharding == sh and jax.typeof(x).memory_space == jax.memory.Space.Host
    assert not np.asarray(x, np.float32).any()


def test_host_zeros_refuses_device_memory():
    with pytest.raises(ValueError, match="pinned_host"):
        kvcache.host_zeros((2, 2), "float32", kvcache.device_sharding())


def test_init_cache_host_tier_from_host_zeros():
    spec = CacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16",
                     num_logical_pages=6, num_slots=3, max_requests=2)
    c = kvcache.init_cache(spec)
    assert c.host_kv.shape == spec.host_shape and c.host_kv.sharding.memory_kind == "pinned_host"
    assert jax.typeof(c.host_kv).memory_space == jax.memory.Space.Host
    assert kvcache.init_cache(spec, traced=True).host_kv is None  # the caller places it


@pytest.mark.gpu
def test_gpu_host_zeros_leaves_device_memory_alone():
    """A 2 GiB zeroed tier raises the device allocator's peak by far less than its size.
    (Read back whole: an eager strided slice of a pinned_host array fails inside XLA 0.11.2,
    "Expected instruction to have shape equal to bf16[4096,524288]".)"""
    dev = jax.devices()[0]
    before = dev.memory_stats()["peak_bytes_in_use"]
    x = kvcache.host_zeros((2 * 1024, GiB // 1024 // 2), "bfloat16", kvcache.host_sharding())
    x.block_until_ready()
    grew = dev.memory_stats()["peak_bytes_in_use"] - before
    assert grew < GiB // 4, f"device peak grew by {grew / GiB:.2f} GiB for a 2 GiB host tier"
    assert x.sharding.memory_kind == "pinned_host"
    assert not np.asarray(x).view(np.uint16).any()
