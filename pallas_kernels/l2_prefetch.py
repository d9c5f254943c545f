"""Read weights into the GPU's L2 cache ahead of the matmul that needs them (``l2_prefetch``).

A decode step at batch <= 8 alternates between weight matmuls, which stream their weights from
HBM, and the attention path (scores, top-k, lookup, attention), a chain of short kernels that
leaves most of HBM's bandwidth idle. ``l2_prefetch`` is a kernel with no data dependency on
that chain: launched beside it (the round's CUDA graph runs independent kernels concurrently,
``engine.ROUND_COMPILER_OPTIONS``), it reads the first ``nbytes`` of each weight array with the
``evict_last`` L2 policy, so that the output projection and the MLP's first matmul then find
part of their weights in L2 instead of HBM.

Semantics (kernel and reference): returns ``passthrough`` unchanged. ``after`` is any array the
prefetch must wait for (a data dependency only, never read); the weights are never written.
The kernel's reads have no effect on any result, so the op is exact by construction; what it
changes is only when weight bytes move. The Pallas kernel aliases ``passthrough`` to its output
(no copy); the values it reads are summed into a scratch output that nobody uses (so the
compiler keeps the loads).

Kernel (Triton backend): each weight array is viewed flat as blocks of at most ``block``
elements (the largest power of two dividing its size up to ``block``); ``programs`` programs share the blocks to prefetch, each
loading ``unroll`` blocks at a time to keep several loads in flight.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common

OP = "l2_prefetch"


def _prefix_blocks(w, nbytes: int, block: int) -> int:
    """Blocks of ``block`` elements covering the first ``min(nbytes, w.nbytes)`` bytes of w."""
    n = min(int(nbytes), w.size * w.dtype.itemsize) // w.dtype.itemsize
    return -(-n // block)


def _check(passthrough, weights, nbytes):
    if not isinstance(weights, (tuple, list)) or not weights:
        raise ValueError("l2_prefetch: weights must be a non-empty tuple of arrays")
    if isinstance(nbytes, int):
        nbytes = (nbytes,) * len(weights)
    if len(nbytes) != len(weights) or any(int(n) < 0 for n in nbytes):
        raise ValueError(f"l2_prefetch: nbytes must be one int >= 0 or one per weight; got {nbytes}")
    return tuple(int(n) for n in nbytes)


@_common.register(OP, "xla")
def l2_prefetch_reference(passthrough, after, weights, *, nbytes, block=8192, programs=132,
                          unroll=4, num_warps=8):
    """Pure-jnp reference of :func:`l2_prefetch`: ``passthrough`` (XLA has no L2 prefetch)."""
    del after, block, programs, unroll, num_warps
    _check(passthrough, weights, nbytes)
    return passthrough


def _kernel(*refs, spans, unroll, n_w):
    """Program p: for each weight i (``spans[i] = (block, nblk, per)``), blocks
    ``[p * per, (p + 1) * per)`` of its ``nblk`` prefix blocks, ``unroll`` loads in flight;
    the sum of everything it read goes to sink[p]."""
    w_refs = refs[2:2 + n_w]
    sink_ref = refs[-1]
    p = pl.program_id(0)
    total = jnp.float32(0)
    for w_ref, (block, nblk, per) in zip(w_refs, spans):
        if nblk == 0:
            continue

        def body(s, acc, w_ref=w_ref, block=block, nblk=nblk, per=per):
            xs = []
            for u in range(unroll):
                # Past this program's share (or the prefix) re-read its last block: a cache hit.
                j = jnp.minimum(p * per + jnp.minimum(s * unroll + u, per - 1), nblk - 1)
                xs.append(pltriton.load(w_ref.at[pl.ds(j * block, block)],
                                        eviction_policy="evict_last"))
            for x in xs:
                acc = acc + x.astype(jnp.float32)
            return acc

        acc = jax.lax.fori_loop(0, -(-per // unroll), body, jnp.zeros((block,), jnp.float32))
        total = total + jnp.sum(acc)
    sink_ref[p] = total


@_common.register(OP, "pallas")
@functools.partial(jax.jit, static_argnames=("nbytes", "block", "programs", "unroll", "num_warps"))
def l2_prefetch_pallas(passthrough, after, weights, *, nbytes, block=8192, programs=132,
                       unroll=4, num_warps=8):
    """Pallas (Triton) kernel of :func:`l2_prefetch` (module docstring)."""
    nbytes = _check(passthrough, weights, nbytes)
    flat = []
    spans = []
    for w, n in zip(weights, nbytes):
        b = _common.largest_pow2_divisor(w.size, block)
        nblk = _prefix_blocks(w, n, b)
        spans.append((b, nblk, max(1, -(-nblk // programs))))
        flat.append(w.reshape(-1))
    if all(s[1] == 0 for s in spans):
        return passthrough
    after = jnp.asarray(after)
    kernel = functools.partial(_kernel, spans=tuple(spans), unroll=unroll, n_w=len(flat))
    operands = [passthrough, after, *flat]
    out, _ = pl.pallas_call(
        kernel,
        grid=(programs,),
        out_shape=[jax.ShapeDtypeStruct(passthrough.shape, passthrough.dtype),
                   jax.ShapeDtypeStruct((programs,), jnp.float32)],
        input_output_aliases={0: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode(),
        name="l2_prefetch",
    )(*operands)
    return out


def l2_prefetch(passthrough, after, weights, *, nbytes, block=8192, programs=132, unroll=4,
                num_warps=8, implementation=None):
    """Pull the first ``nbytes`` of each weight array into L2 once ``after`` exists.

    Args:
      passthrough: any array (e.g. the residual stream ``x`` [B, T, d]); returned unchanged.
        Consume the result where the prefetched weights are used, so the prefetch runs before.
      after: any array the prefetch waits for (e.g. the layer's keys), never read.
      weights: tuple of arrays (any shape and dtype).
      nbytes: static int, or one per weight: bytes to prefetch from the start of each.
      block, programs, unroll, num_warps: static kernel tuning (elements per load, grid,
        loads in flight per program, warps per program).
      implementation: "pallas" | "xla" | None.
    Returns:
      ``passthrough`` (same values, shape and dtype).
    """
    fn = _common.resolve(OP, implementation)
    nbytes = nbytes if isinstance(nbytes, int) else tuple(int(n) for n in nbytes)
    return fn(passthrough, after, tuple(weights), nbytes=nbytes, block=int(block),
              programs=int(programs), unroll=int(unroll), num_warps=int(num_warps))


def prefetch_bytes(weights, nbytes) -> int:
    """Bytes the kernel reads for these weights and ``nbytes`` (whole blocks; a report helper)."""
    nbytes = _check(None, tuple(weights), nbytes)
    return sum(min(n, math.prod(w.shape) * jnp.dtype(w.dtype).itemsize)
               for w, n in zip(weights, nbytes))
