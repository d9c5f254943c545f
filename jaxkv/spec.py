"""Static shape specification of a host-tier paged KV cache (frozen, hashable).

A :class:`CacheSpec` is everything about the cache that fixes array shapes, so it is a
static argument of jitted functions: changing it recompiles, nothing else does.
See docs/DESIGN.md for the row layout it describes.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxkv.kernels import kv_quant
from jaxkv.kernels._common import INVALID  # noqa: F401 - "no page" in every index array

_DTYPES = ("float32", "bfloat16", "float16") + kv_quant.QUANT_DTYPES


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def alloc_rows(rows: int, row_bytes: int, itemsize: int) -> int:
    """Rows to allocate for a page array whose kernels address ``rows`` rows of ``row_bytes``.

    Pallas' Triton lowering (jax 0.11.2) picks 32-bit element offsets for any array of at most
    2**32 bytes and 64-bit ones above. Offsets are signed, so a 1-byte dtype (fp8, int8) array of more
    than 2**31 bytes is addressed past 2**31 elements with wrapped offsets: an illegal memory
    access on the GPU. Such an array gets unused rows at its end up to just over 2**32 bytes
    (at most 2 GiB more, only for 1-byte arrays of 2-4 GiB); other arrays are left as they are.
    """
    nbytes = rows * row_bytes
    if itemsize == 1 and 2**31 < nbytes <= 2**32:
        return 2**32 // row_bytes + 1
    return rows


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Shapes of the host tier and the device pool.

    Attributes:
      num_layers: L, transformer layers that own a KV cache.
      num_kv_heads: H, KV heads per layer.
      head_dim: D, a power of two.
      page_size: tokens per page, a power of two.
      dtype: KV dtype name ("bfloat16", "float32", "float16", "float8_e4m3fn",
        "float8_e5m2", "int8"; quantized rows end with their scales,
        ``jaxkv.kernels.kv_quant``).
      num_logical_pages: P, logical pages per layer in the host tier (all requests together).
      num_slots: S, device pool slots per layer.
      max_requests: R, page requests per layer per step that ``ensure`` accepts
        (batch x selected pages x heads, padded with -1).
      num_sink_pages: first pages of each sequence that are never evicted.
      num_recent_pages: most recent pages of each sequence that are never evicted.
      max_batch: requests the pinned pages are reserved for (pinned pages use
        ``max_batch * (num_sink_pages + num_recent_pages)`` slots per layer).
      num_scratch: extra pool rows per layer after the ``L * S`` slots, where pages missed
        during a step are fetched for that step (per-step scheduling); row of entry ``e`` of
        layer ``l``: ``L * S + l * num_scratch + e``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    num_logical_pages: int
    num_slots: int
    max_requests: int
    num_sink_pages: int = 0
    num_recent_pages: int = 0
    max_batch: int = 1
    num_scratch: int = 0

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size",
                     "num_logical_pages", "num_slots", "max_requests", "max_batch"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CacheSpec.{name} must be a positive int, got {v!r}")
        for name in ("num_sink_pages", "num_recent_pages", "num_scratch"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CacheSpec.{name} must be an int >= 0, got {v!r}")
        if not _is_pow2(self.page_size):
            raise ValueError(f"page_size must be a power of two (Triton blocks), got {self.page_size}")
        if not _is_pow2(self.head_dim):
            raise ValueError(f"head_dim must be a power of two (Triton blocks), got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.pinned_slots > self.num_slots:
            raise ValueError(
                f"pinned pages need {self.pinned_slots} slots per layer "
                f"(max_batch {self.max_batch} x (sink {self.num_sink_pages} + recent "
                f"{self.num_recent_pages})) but the pool has {self.num_slots}: "
                "raise the pool size or pin fewer pages")
        if self.num_slots > self.num_logical_pages:
            raise ValueError(
                f"num_slots ({self.num_slots}) exceeds num_logical_pages "
                f"({self.num_logical_pages}): the pool would be larger than the host tier")

    # -- derived sizes -------------------------------------------------------------------
    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def pinned_slots(self) -> int:
        return self.max_batch * (self.num_sink_pages + self.num_recent_pages)

    @property
    def quantized(self) -> bool:
        """Quantized rows, fp8 or int8 (payload + per-token scales)."""
        return kv_quant.is_quantized(self.dtype)

    @property
    def row_elems(self) -> int:
        """R: elements of one (layer, page) row, [2, H, page_size, D] flattened (quantized: then
        the scale bytes [2, H, page_size])."""
        return kv_quant.row_elems(self.dtype, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one (layer, page) row: K and V of all heads."""
        return self.row_elems * self.jnp_dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return kv_quant.token_elems(self.dtype, self.num_kv_heads, self.head_dim) * self.jnp_dtype.itemsize

    @property
    def host_shape(self) -> tuple[int, int]:
        """[L * P (+ unused rows, :func:`alloc_rows`), R]."""
        return (alloc_rows(self.num_layers * self.num_logical_pages, self.page_bytes,
                           self.jnp_dtype.itemsize), self.row_elems)

    @property
    def pool_shape(self) -> tuple[int, int]:
        """[L * (S + scratch) (+ unused rows, :func:`alloc_rows`), R]."""
        return (alloc_rows(self.num_layers * (self.num_slots + self.num_scratch), self.page_bytes,
                           self.jnp_dtype.itemsize), self.row_elems)

    @property
    def host_bytes(self) -> int:
        return math.prod(self.host_shape) * self.jnp_dtype.itemsize

    @property
    def pool_bytes(self) -> int:
        return math.prod(self.pool_shape) * self.jnp_dtype.itemsize
