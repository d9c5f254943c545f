"""User-facing configuration: how to cache (static) and how to sample (traced).

:class:`CacheConfig` is frozen and hashable: it fixes shapes and code paths, so changing
it recompiles. :class:`Sampling` is a pytree of arrays: changing its values never does.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Mode = Literal["host", "resident"]
Selector = Literal["quest", "indexer", "dense"]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """How generate() keeps and reads the KV cache.

    Attributes:
      mode: "host" (full KV in pinned host memory, device pool as LRU cache) or
        "resident" (every page on device; the baseline). One switch, same math.
      selector: "quest", "indexer" or "dense" (every valid page).
      page_size: tokens per page (power of two).
      selected_pages: k, pages selected per request, layer and KV head per step
        (ignored by "dense").
      pool_pages: device slots per layer in "host" mode. ``None``: enough for the
        worst-case working set of a step (no drops).
      sink_pages / recent_pages: pages pinned in the pool (never evicted); the selectors
        always include the sink pages and the current page.
      max_context: tokens per sequence the cache holds (prompt + generated). ``None``: the
        next power of two >= longest prompt + max_new_tokens (at least 256), so calls in
        the same bucket share one compilation.
      strict: raise after a call if any selection was dropped (pool too small).
      dtype: KV dtype (None = the model's dtype).
      prefill_chunk: tokens per prefill chunk (bounds prefill memory).
      round_steps: decode steps per compiled round (stream granularity).
      implementation: kernel implementation ("pallas", "xla" or None = per backend).
      unroll_layers: unroll the per-token layer loop (None: on GPU, where a loop iteration
        costs a host round trip of ~10 us; off elsewhere, for compile time).
    """

    mode: Mode = "host"
    selector: Selector = "quest"
    page_size: int = 16
    selected_pages: int = 16
    pool_pages: int | None = None
    sink_pages: int = 1
    recent_pages: int = 1
    max_context: int | None = None
    strict: bool = False
    dtype: str | None = None
    prefill_chunk: int = 2048
    round_steps: int = 64
    implementation: str | None = None
    unroll_layers: bool | None = None

    def __post_init__(self):
        if self.mode not in ("host", "resident"):
            raise ValueError(f"CacheConfig.mode must be 'host' or 'resident', got {self.mode!r}")
        if self.selector not in ("quest", "indexer", "dense"):
            raise ValueError(
                f"CacheConfig.selector must be 'quest', 'indexer' or 'dense', got {self.selector!r}")
        ps = self.page_size
        if not isinstance(ps, int) or ps <= 0 or ps & (ps - 1):
            raise ValueError(f"CacheConfig.page_size must be a power of two, got {ps!r}")
        for name in ("selected_pages", "prefill_chunk", "round_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {v!r}")
        for name in ("sink_pages", "recent_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"CacheConfig.{name} must be an int >= 0, got {v!r}")
        if self.selected_pages < self.sink_pages + 1:
            raise ValueError(
                f"selected_pages ({self.selected_pages}) must cover the sink pages "
                f"({self.sink_pages}) and the current page: raise selected_pages")
        if self.pool_pages is not None and (not isinstance(self.pool_pages, int) or self.pool_pages <= 0):
            raise ValueError(f"CacheConfig.pool_pages must be a positive int or None, got {self.pool_pages!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context <= 0):
            raise ValueError(f"CacheConfig.max_context must be a positive int or None, got {self.max_context!r}")
        pc = self.prefill_chunk
        if pc & (pc - 1) or pc < ps:
            raise ValueError(f"prefill_chunk must be a power of two >= page_size ({ps}), got {pc}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters, traced (new values never recompile).

    temperature: 0 = greedy. top_k: 0 = off. top_p: 1 = off.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "Sampling":
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def greedy() -> Sampling:
    return Sampling.make()
