"""The SwiGLU MLP of a decode step in one kernel: ``down(silu(h @ W_gate) * (h @ W_up))``.

At decode batch sizes the MLP is a read of its weights (``w_gate_up [d, 2F]`` and
``w_down [F, d]``, ~88% of a Qwen-like layer's bytes). XLA runs it as four kernels: the
gate/up product, SiLU x up, the down product (split-K) and the split-K reduction. This kernel
does the first three in one launch, with no intermediate in HBM but its partial sums:

* grid ``(F / block_f,)``: program ``j`` owns hidden units ``[j * block_f, (j + 1) * block_f)``;
* it computes their gate and up values over ``d`` in ``block_k`` steps (``tl.dot`` on rows
  padded to 16, f32 accumulation), rounds them to the weights' dtype (as the XLA product does),
  forms ``m = silu(g) * u`` in f32 and rounds it to the weights' dtype;
* it multiplies ``m [rows, block_f]`` by its rows of ``w_down`` in ``block_n``-column steps and
  writes the f32 partial ``[rows, d]`` of the down product to ``partials[j]``.

The partials (``F / block_f`` of them, ``[M, d]`` f32 each: 1.4% of the weights'
bytes at Qwen-like M=8, ``block_f=64``) are summed by XLA in a fixed order, together with
whatever follows (the residual): results are deterministic, no atomics.

Semantics shared by the kernel ("pallas") and the reference ("xla"): ``h [M, d]`` and the
weights in one dtype; the result is ``[M, d]`` float32 holding the down product rounded to that
dtype (the model's ``_proj`` convention). Kernel and reference differ only by f32 summation
order (and the rounding of ``m`` that order changes). The kernel takes ``M <= 16`` rows (decode)
and ``d``, ``F`` divisible by its blocks; other shapes use the reference.

Public: :func:`swiglu_mlp` (op ``"swiglu_mlp"``).
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

OP = "swiglu_mlp"
MAX_ROWS = 16  # tl.dot's smallest M: the rows are padded to it; more rows use the reference


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tiling: hidden units per program, the ``d`` step of the gate/up products, the
    output-column step of the down product, Triton options."""
    block_f: int = 64
    block_k: int = 256
    block_n: int = 256
    num_warps: int = 4
    num_stages: int = 3
    packed: bool = False  # w_gate_up given as pack_gate_up(w, block_f): [F / block_f, d, 2 * block_f]


def pack_gate_up(w_gate_up, block_f: int):
    """``[d, 2F]`` (``[W_gate | W_up]``) -> ``[F / block_f, d, 2 * block_f]``: block ``j`` holds
    hidden units ``j * block_f ...`` of W_gate then of W_up, so one program's gate/up weights
    are one contiguous range."""
    d, f2 = w_gate_up.shape
    f = f2 // 2
    return (w_gate_up.reshape(d, 2, f // block_f, block_f).transpose(2, 0, 1, 3)
            .reshape(f // block_f, d, 2 * block_f))


def supported(m: int, d: int, f: int, tiling: Tiling = Tiling()) -> bool:
    """Shapes the kernel takes: ``M <= 16`` rows, ``d`` a multiple of ``block_k`` and
    ``block_n``, ``F`` a multiple of ``block_f``."""
    t = tiling
    return (0 < m <= MAX_ROWS and d % t.block_k == 0 and d % t.block_n == 0
            and f % t.block_f == 0)


def _check(h, w_gate_up, w_down):
    if h.ndim != 2 or w_gate_up.ndim != 2 or w_down.ndim != 2:
        raise ValueError(f"swiglu_mlp: h must be [M, d], w_gate_up [d, 2F], w_down [F, d]; got "
                         f"{h.shape}, {w_gate_up.shape}, {w_down.shape}")
    d, f2 = w_gate_up.shape
    if h.shape[1] != d or f2 % 2 or w_down.shape != (f2 // 2, d):
        raise ValueError(f"swiglu_mlp: shapes do not match: h {h.shape}, w_gate_up "
                         f"{w_gate_up.shape} (want [d, 2F]), w_down {w_down.shape} (want [F, d])")
    if not (h.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(f"swiglu_mlp: h, w_gate_up, w_down must share a dtype; got {h.dtype}, "
                         f"{w_gate_up.dtype}, {w_down.dtype}")


def _silu(g):
    return g / (1.0 + jnp.exp(-g))


@register(OP, "xla")
def swiglu_mlp_reference(h, w_gate_up, w_down, *, tiling=None):
    """The model's MLP in XLA: [M, d] -> [M, d] float32 (module docstring)."""
    del tiling
    dt = h.dtype
    f = w_down.shape[0]
    gu = jnp.dot(h, w_gate_up).astype(jnp.float32)  # product in dt (f32 accumulation), upcast
    m = (_silu(gu[:, :f]) * gu[:, f:]).astype(dt)
    return jnp.dot(m, w_down).astype(jnp.float32)


def _kernel(h_ref, wgu_ref, wd_ref, o_ref, *, f, block_f, block_k, block_n, rows, packed):
    j = pl.program_id(0)
    f0 = pl.multiple_of(j * block_f, block_f)
    d = h_ref.shape[1]
    dt = wgu_ref.dtype

    def gate_up(i, acc):
        g, u = acc
        k = pl.multiple_of(i * block_k, block_k)
        hk = h_ref[:, pl.ds(k, block_k)]
        if packed:
            wg = wgu_ref[j, pl.ds(k, block_k), pl.ds(0, block_f)]
            wu = wgu_ref[j, pl.ds(k, block_k), pl.ds(block_f, block_f)]
        else:
            wg = wgu_ref[pl.ds(k, block_k), pl.ds(f0, block_f)]
            wu = wgu_ref[pl.ds(k, block_k), pl.ds(f + f0, block_f)]
        g = g + jnp.dot(hk, wg, preferred_element_type=jnp.float32)
        u = u + jnp.dot(hk, wu, preferred_element_type=jnp.float32)
        return g, u

    zero = jnp.zeros((MAX_ROWS, block_f), jnp.float32)
    g, u = lax.fori_loop(0, d // block_k, gate_up, (zero, zero))
    g = g.astype(dt).astype(jnp.float32)
    u = u.astype(dt).astype(jnp.float32)
    m = (_silu(g) * u).astype(dt)  # [16, block_f]

    r = lax.broadcasted_iota(jnp.int32, (MAX_ROWS, block_n), 0)
    c = lax.broadcasted_iota(jnp.int32, (MAX_ROWS, block_n), 1)

    def down(i, carry):
        n = pl.multiple_of(i * block_n, block_n)
        y = jnp.dot(m, wd_ref[pl.ds(f0, block_f), pl.ds(n, block_n)],
                    preferred_element_type=jnp.float32)
        # rows >= M are masked off (no address is formed on the GPU; dropped when interpreted)
        pltriton.store(o_ref.at[j, r, n + c], y, mask=r < rows)
        return carry

    lax.fori_loop(0, d // block_n, down, 0)


def partials(h, w_gate_up, w_down, tiling: Tiling):
    """The kernel's output: ``[F / block_f, M, d]`` float32 partial down products."""
    t = tiling
    rows, d = h.shape
    f = w_down.shape[0]
    hp = jnp.pad(h, ((0, MAX_ROWS - rows), (0, 0)))
    nprog = f // t.block_f
    return pl.pallas_call(
        functools.partial(_kernel, f=f, block_f=t.block_f, block_k=t.block_k,
                          block_n=t.block_n, rows=rows, packed=t.packed),
        grid=(nprog,),
        in_specs=[pl.BlockSpec(hp.shape, lambda j: (0, 0)),
                  pl.BlockSpec(w_gate_up.shape, lambda j: (0,) * w_gate_up.ndim),
                  pl.BlockSpec(w_down.shape, lambda j: (0, 0))],
        out_specs=pl.BlockSpec((nprog, rows, d), lambda j: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nprog, rows, d), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret_mode(),
        name="swiglu_mlp",
    )(hp, w_gate_up, w_down)


@register(OP, "pallas")
def swiglu_mlp_pallas(h, w_gate_up, w_down, *, tiling=None):
    """One-launch Pallas MLP (module docstring); unsupported shapes use the reference."""
    t = tiling or Tiling()
    m, d = h.shape
    if not supported(m, d, w_down.shape[0], t):
        return swiglu_mlp_reference(h, w_gate_up, w_down)
    y = partials(h, w_gate_up, w_down, t).sum(axis=0)
    return y.astype(h.dtype).astype(jnp.float32)


def swiglu_mlp(h, w_gate_up, w_down, *, tiling: Tiling | None = None, implementation=None):
    """``silu(h @ W_gate) * (h @ W_up)`` then ``@ w_down``: [M, d] -> [M, d] float32.

    h: [M, d]; w_gate_up: [d, 2F] (``[W_gate | W_up]``); w_down: [F, d]; one dtype (bf16 or
    f32). ``tiling``: :class:`Tiling` (static). ``implementation``: "pallas" | "xla" | None
    (see :mod:`pallas_kernels._common`)."""
    _check(h, w_gate_up, w_down)
    return resolve(OP, implementation)(h, w_gate_up, w_down, tiling=tiling)
