"""Shared set-up of the page-transfer kernel tests (test_page_fetch.py, test_page_write.py)
and fresh, printed seeds for any kernel test (``fresh_rng``, the ``rng`` fixture)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

DEV0 = jax.devices()[0]
HOST = SingleDeviceSharding(DEV0, memory_kind="pinned_host")
DEVICE = SingleDeviceSharding(DEV0, memory_kind="device")
HEADS = {"8x128": (8, 128), "3x64": (3, 64)}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# Head shape x page size, each with one dtype, so that every head shape and every page size
# is tested in both dtypes (a covering design: half the interpret-mode compiles).
SHAPES = [(h, ps, "bf16" if (ps in (1, 16)) != (h == "3x64") else "f32")
          for h in HEADS for ps in (1, 2, 16, 64)]


def fresh_rng():
    """A generator on a fresh seed, printed (pytest shows it when the test fails)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def rng():
    return fresh_rng()


def host_zeros(shape, dtype=jnp.bfloat16):
    """Zeros in pinned_host memory, typed as host memory (usable as a loop carry)."""
    return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Host),
                   out_shardings=HOST)()


def as_f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))
