"""Matrix products with few rows (decode: one row per request), ``x [M, K] @ w [K, N]``.

At decode batch sizes the product is a weight read: each element of ``w`` is used ``M <= 16``
times. The kernel splits the ``N`` columns into blocks of ``block_n`` and the ``K`` rows into
``splits`` ranges, one program per (column block, range), so a small matrix still gives every SM
several programs; each program accumulates ``x[:, range] @ w[range, block]`` in float32 over
``block_k``-row steps (``tl.dot`` on rows padded to 16) and writes a partial result; the
partials are summed outside the kernel (``[splits, M, N]`` float32, small next to ``w``).

Public: :func:`skinny_matmul` (registered ``"pallas"`` kernel and ``"xla"`` reference).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import interpret_mode, register, resolve

OP = "skinny_matmul"
MAX_ROWS = 16  # tl.dot's smallest M; more rows are not "skinny" (use the XLA product)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tiling: column block, row step, number of K ranges, Triton options."""
    block_n: int = 128
    block_k: int = 128
    splits: int | None = None  # None: the largest divisor of K / block_k near target_programs / (N / block_n)
    target_programs: int = 528  # ~4 programs per H200 SM (132 SMs)
    num_warps: int = 4
    num_stages: int = 3


def supported(m: int, k: int, n: int, tiling: Tiling = Tiling()) -> bool:
    """Shapes the kernel takes: ``M <= 16`` rows and ``K``, ``N`` multiples of the blocks."""
    return 0 < m <= MAX_ROWS and k % tiling.block_k == 0 and n % tiling.block_n == 0


def default_splits(k: int, n: int, tiling: Tiling) -> int:
    """K ranges per column block: the largest divisor of ``K / block_k`` not above
    ``target_programs / (N / block_n)`` (at least 1)."""
    steps, cols = k // tiling.block_k, n // tiling.block_n
    want = max(1, tiling.target_programs // cols)
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)


@register(OP, "xla")
def skinny_matmul_reference(x, w, *, tiling=None):
    """x [M, K] @ w [K, N] in XLA: operands' dtype, float32 accumulation, float32 result."""
    del tiling
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _kernel(x_ref, w_ref, o_ref, *, block_n, block_k, steps):
    j, s = pl.program_id(0), pl.program_id(1)
    k0 = s * (steps * block_k)
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

    def body(i, acc):
        k = pl.multiple_of(k0 + i * block_k, block_k)
        xk = x_ref[:, pl.ds(k, block_k)]
        wk = w_ref[pl.ds(k, block_k), cols]
        return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[s, :, cols] = acc


@register(OP, "pallas")
def skinny_matmul_pallas(x, w, *, tiling=None):
    """Split-K Pallas kernel (module docstring). Shapes as :func:`skinny_matmul_reference`."""
    t = tiling or Tiling()
    m, k = x.shape
    n = w.shape[1]
    if not supported(m, k, n, t):
        return skinny_matmul_reference(x, w)
    splits = t.splits or default_splits(k, n, t)
    if (k // t.block_k) % splits:
        raise ValueError(f"splits={splits} must divide K / block_k = {k // t.block_k}")
    steps = k // t.block_k // splits
    xp = jnp.pad(x, ((0, MAX_ROWS - m), (0, 0))).astype(w.dtype)
    part = pl.pallas_call(
        functools.partial(_kernel, block_n=t.block_n, block_k=t.block_k, steps=steps),
        grid=(n // t.block_n, splits),
        in_specs=[pl.BlockSpec(xp.shape, lambda j, s: (0, 0)),
                  pl.BlockSpec(w.shape, lambda j, s: (0, 0))],
        out_specs=pl.BlockSpec((splits, MAX_ROWS, n), lambda j, s: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, MAX_ROWS, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret_mode(),
        name="skinny_matmul",
    )(xp, w)
    return part[:, :m].sum(axis=0)


def skinny_matmul(x, w, *, tiling: Tiling | None = None, implementation=None):
    """``x [M, K] @ w [K, N] -> [M, N]`` float32 (float32 accumulation), for few rows.

    x: bf16/f32, M <= 16 rows for the kernel (other shapes fall back to the XLA product);
    w: [K, N], same dtype as x. ``tiling``: :class:`Tiling` (static)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"skinny_matmul: x must be [M, K] and w [K, N], got {x.shape}, {w.shape}")
    return resolve(OP, implementation)(x, w, tiling=tiling)
