"""Shared plumbing for jaxkv kernels: backend detection and per-op implementation registry.

Every op in this package is one public function with two registered implementations:

* ``"pallas"``: the Pallas kernel (Triton backend on GPU; ``interpret=True`` elsewhere),
* ``"xla"``:    the pure-jnp reference in the same module (also the fallback).

``resolve(op, implementation)`` picks one: an explicit argument wins, then the
``JAXKV_IMPL_<OP>`` environment variable (one op, e.g. ``JAXKV_IMPL_QUEST_SCORES=xla``), then
``JAXKV_IMPL`` (``pallas`` / ``xla``), then the default: Pallas on GPU
(unless the op's module measured another implementation faster there and said so with
``prefer_on_gpu``), the XLA reference on other backends (interpret mode is for tests, not for
speed) unless the op's module registered a faster formulation for the CPU and said so with
``prefer_on_cpu``. An explicit ``"xla"`` (argument or environment) always gives the reference.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["pallas", "xla"]
INVALID = -1  # "no page" / "not resident" / "empty slot" in every index array
_REGISTRY: dict[str, dict[str, Callable]] = {}
_GPU_DEFAULT: dict[str, str] = {}
_CPU_DEFAULT: dict[str, str] = {}


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxkv_target", default=None)


def backend() -> str:
    """The platform programs are built for: 'gpu', 'cpu' or 'tpu'. JAX's default backend,
    or the platform :func:`target_platform` names while it is active."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target_platform(platform: str):
    """Build programs for ``platform`` (e.g. "gpu") on a machine without it, to lower them
    with ``lowering_platforms``: inside, every backend rule (an op's default implementation,
    Triton instead of interpret mode, a plan's per-backend defaults) answers for
    ``platform``. JAX's caches are cleared on entry (a function traced before would keep its
    trace for this machine) and on exit (nothing traced inside can run here)."""
    jax.clear_caches()
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
        jax.clear_caches()


def on_gpu() -> bool:
    return backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode off the GPU (the Triton lowering needs CUDA)."""
    return not on_gpu()


def register(op: str, implementation: str):
    """Decorator: register ``fn`` as implementation ``implementation`` of ``op``."""

    def deco(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[implementation] = fn
        return fn

    return deco


def implementations(op: str) -> tuple[str, ...]:
    return tuple(_REGISTRY.get(op, {}))


def implementation_name(implementation: str | None = None) -> str:
    """The implementation asked for: the argument, else ``JAXKV_IMPL``, else the backend's
    default ("pallas" on the GPU, "xla" elsewhere)."""
    return implementation or os.environ.get("JAXKV_IMPL") or ("pallas" if on_gpu() else "xla")


def prefer_on_gpu(op: str, implementation: str) -> None:
    """Make ``implementation`` the GPU default of ``op`` (for an op whose Pallas kernel is not
    the fastest implementation there); an explicit argument or ``JAXKV_IMPL`` still wins."""
    _GPU_DEFAULT[op] = implementation


def prefer_on_cpu(op: str, implementation: str) -> None:
    """Make ``implementation`` the default of ``op`` off the GPU (a pure-jnp formulation that
    measured faster on XLA:CPU than the reference); an explicit argument or ``JAXKV_IMPL``
    still wins, so ``"xla"`` keeps naming the reference."""
    _CPU_DEFAULT[op] = implementation


def resolve(op: str, implementation: str | None = None) -> Callable:
    """Return the registered implementation of ``op`` (see module docstring for the rule)."""
    impls = _REGISTRY.get(op)
    if not impls:
        raise KeyError(f"no implementations registered for op {op!r}")
    per_op = os.environ.get(f"JAXKV_IMPL_{op.upper()}")  # e.g. JAXKV_IMPL_QUEST_SCORES=xla
    name = implementation_name(implementation or per_op)
    if implementation is None and not per_op and not os.environ.get("JAXKV_IMPL"):
        name = (_GPU_DEFAULT if on_gpu() else _CPU_DEFAULT).get(op, name)
    if name not in impls:
        raise ValueError(f"op {op!r} has no implementation {name!r}; choose one of {sorted(impls)}")
    return impls[name]


def num_valid_pages(seq_lens, page_size: int, num_pages: int):
    """Pages holding at least one token: ``min(ceil(max(seq_lens, 0) / page_size), num_pages)``
    (int32 in, same shape out; also inside kernels, on a scalar loaded from a ref)."""
    seq_lens = jnp.maximum(seq_lens, 0)
    return jnp.minimum((seq_lens + page_size - 1) // page_size, num_pages)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def largest_pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides ``n`` and is <= ``cap`` (Triton blocks need powers of 2)."""
    p = 1
    while n % (p * 2) == 0 and p * 2 <= cap:
        p *= 2
    return p


def online_softmax_step(m, l, acc, s, v, precision=None, v_scale=None):
    """One key block of a flash-attention online softmax inside a Triton kernel.

    m, l [Q] float32 (running max in log2 units, running denominator), acc [Q, D] float32;
    s [Q, K] float32 scores in log2 units (``-inf`` where masked); v [K, D]. Rows with no
    allowed key so far keep ``m = -inf``, ``l = 0``, ``acc = 0``. ``p`` is cast to v's dtype
    for ``p @ v`` (float32 accumulation). ``v_scale`` [K] float32: per-key factors of v (the
    scales of a quantized cache), folded into ``p`` for the product only. Returns the updated
    (m, l, acc).
    """
    from jax.experimental.pallas import triton as pltriton

    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing allowed yet
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    pv = p if v_scale is None else p * v_scale[None, :]
    acc = acc * alpha[:, None] + pltriton.dot(pv.astype(v.dtype), v, precision=precision)
    return m_new, l, acc
