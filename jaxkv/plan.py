"""The static plan of one generate() call: every shape and code path, the jit key.

:class:`Plan` (frozen, hashable) fixes batch, prompt bucket, context capacity, cache layout
and the cache configuration (with its :class:`jaxkv.Tuning`); it is the static argument of
the engine's prefill and decode programs, so two calls with equal plans share them (the
prompt's embedding and the first token are keyed on the plan's model and axis only).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import selectors
from jaxkv.config import CacheConfig, Tuning, dense_layer_set
from jaxkv.kernels import _common, kv_quant
from jaxkv.models.configs import ModelConfig
from jaxkv.selectors import Selector
from jaxkv.spec import CacheSpec


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static shapes of one generate() call (hashable: the jit cache key)."""

    model: ModelConfig
    cache: CacheConfig
    batch: int
    prompt_len: int      # bucketed prompt length T (multiple of page_size)
    max_context: int     # tokens per sequence (multiple of page_size)
    num_stop: int        # length of the padded stop-token array
    # Tensor parallelism (jaxkv.parallel): the mesh axis this plan's functions run over
    # inside shard_map; ``model`` is then one device's share (its KV heads, MLP block).
    axis_name: str | None = None

    @property
    def tuning(self) -> Tuning:
        """Performance settings of the compiled programs (``CacheConfig.tuning``)."""
        return self.cache.tuning

    @property
    def selector(self) -> Selector:
        """The page selector (``CacheConfig.selector``), a :class:`jaxkv.selectors.Selector`."""
        return selectors.get(self.cache.selector)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def pages_per_seq(self) -> int:
        return self.max_context // self.page_size

    @property
    def k(self) -> int:
        """Selected pages per request, layer and KV head."""
        if not self.selector.scored:  # every valid page
            return self.pages_per_seq
        return min(self.cache.selected_pages, self.pages_per_seq)

    @property
    def key_shift(self) -> bool:
        """Stored keys are shifted by their request's mean key (quantized KV with
        ``CacheConfig.kv_key_shift``; ``None``: models with a K bias):
        the summaries tuple then holds the shift [L, B, H, D] float32 after the selector's own
        arrays (``jaxkv.selectors.split``)."""
        shift = self.cache.kv_key_shift
        if shift is None:
            shift = self.model.qkv_bias
        return bool(shift) and kv_quant.is_quantized(self.kv_dtype)

    @property
    def key_rotation(self) -> bool:
        """Stored keys and decode queries are rotated by ``kv_quant.hadamard(D)`` (quantized KV
        with ``CacheConfig.kv_key_rotation``; ``None``: fp8 keys that are not shifted)."""
        rot = self.cache.kv_key_rotation
        if rot is None:
            rot = kv_quant.is_fp8(self.kv_dtype) and not self.key_shift
        return bool(rot) and kv_quant.is_quantized(self.kv_dtype)

    @property
    def lagged(self) -> bool:
        """Pages chosen one step ahead (CacheConfig.selection_lag): the summaries tuple then
        ends with ``ahead`` [L, B, H, k] (``jaxkv.selectors.split``)."""
        return self.cache.selection_lag == 1 and self.selector.scored

    @property
    def layer_unroll(self) -> int:
        unroll = self.cache.unroll_layers
        if unroll is None:
            unroll = _common.backend() == "gpu"
        return self.model.num_layers if unroll else 1

    @property
    def prefill_token_chunk(self) -> int:
        """Tokens per piece of a prefill layer's per-token work (``CacheConfig``'s, or the
        backend's default: 131072 on the GPU, 512 elsewhere, at least a page)."""
        chunk = self.cache.prefill_token_chunk
        if chunk is None:
            chunk = 131072 if _common.backend() == "gpu" else max(512, self.page_size)
        return chunk

    @property
    def num_pinned(self) -> int:
        return self.cache.sink_pages + self.cache.recent_pages

    @property
    def dense_set(self) -> tuple[int, ...]:
        """The layers that attend densely (``CacheConfig.dense_layers``), ascending."""
        return dense_layer_set(self.cache.dense_layers, self.model.num_layers)

    @property
    def num_dense(self) -> int:
        return len(self.dense_set)

    @property
    def sparse_mask(self) -> np.ndarray:
        """[L] bool: the layers that select pages (every layer not in ``dense_set``)."""
        m = np.ones(self.model.num_layers, bool)
        m[list(self.dense_set)] = False
        return m

    def dense_slot(self, layer):
        """The index of dense layer ``layer`` (int32, traced or not) among the dense layers:
        its place in the host mode's device copy (``dense_spec``)."""
        slot = np.zeros(self.model.num_layers, np.int32)
        slot[list(self.dense_set)] = np.arange(self.num_dense, dtype=np.int32)
        return jnp.asarray(slot)[layer]

    def is_dense(self, layer):
        """Whether layer ``layer`` (int32, traced or not) attends densely: a bool array."""
        return jnp.asarray(~self.sparse_mask)[layer]

    @property
    def layer_runs(self) -> tuple[tuple[int, int, bool], ...]:
        """The layers as maximal runs of dense or selecting layers: (start, stop, dense)."""
        runs, dense = [], ~self.sparse_mask
        for i, d in enumerate(dense.tolist()):
            if runs and runs[-1][2] == d:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, d])
        return tuple(tuple(r) for r in runs)

    @property
    def dense_spec(self) -> CacheSpec:
        """Host mode: the device-resident K/V of the dense layers, [num_dense * P, R]."""
        return dataclasses.replace(self.spec, num_layers=max(1, self.num_dense),
                                   num_slots=self.spec.num_logical_pages, num_scratch=0)

    @property
    def per_step(self) -> bool:
        """Host mode with per-step scheduling, "step" or "scratch" (see CacheConfig.schedule)."""
        return self.cache.mode == "host" and self.cache.schedule in ("step", "scratch")

    @property
    def in_place(self) -> bool:
        """Per-step scheduling that reads missed pages in place from the host tier."""
        return self.per_step and self.cache.schedule == "step"

    @property
    def requests_per_layer(self) -> int:
        """Selected (request, KV head, page) entries per layer and step."""
        return self.batch * self.model.num_kv_heads * self.k

    @property
    def scratch_per_request(self) -> int:
        """Scratch rows per request and layer: distinct pages one request can miss in a step."""
        return min(self.model.num_kv_heads * self.k, self.pages_per_seq)

    @property
    def scratch_per_layer(self) -> int:
        return self.batch * self.scratch_per_request

    @property
    def kv_dtype(self) -> str:
        """The dtype of the stored K/V (``CacheConfig.kv_dtype``, default the model's)."""
        return self.cache.kv_dtype or self.model.dtype

    @property
    def summary_dtype(self) -> str:
        """The dtype of K/V outside the cache: the new token's K/V before its write and the
        selector's summaries. The KV dtype, or the model's where the KV is quantized (fp8, int8)."""
        return self.model.dtype if kv_quant.is_quantized(self.kv_dtype) else self.kv_dtype

    @property
    def pool_pages(self) -> int:
        """Device slots per layer (host mode)."""
        P = self.batch * self.pages_per_seq
        if self.cache.pool_pages is not None:
            return self.cache.pool_pages
        return min(P, self.step_pages)

    @property
    def step_pages(self) -> int:
        """Most pages of one layer a decode step protects in the pool: every request's
        selected pages of every KV head and its pinned (sink + recent) pages."""
        return self.requests_per_layer + self.batch * self.num_pinned

    @property
    def spec(self) -> CacheSpec:
        m = self.model
        return CacheSpec(
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            page_size=self.page_size, dtype=self.kv_dtype,
            num_logical_pages=self.batch * self.pages_per_seq,
            num_slots=self.pool_pages if self.cache.mode == "host" else self.batch * self.pages_per_seq,
            max_requests=self.batch * m.num_kv_heads * self.k,
            num_sink_pages=self.cache.sink_pages, num_recent_pages=self.cache.recent_pages,
            max_batch=self.batch, num_scratch=self.scratch_per_layer if self.per_step and not self.in_place else 0)


@functools.lru_cache(maxsize=None)
def _accepted_options(options: tuple, backend: str) -> tuple:
    """The pairs of ``options`` that this XLA accepts, each tried once on a tiny program.
    ``backend`` (the default backend, where the program compiles) is only the cache key."""
    del backend
    ok = []
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile({name: value})
            ok.append((name, value))
        except Exception as e:  # noqa: BLE001 - any rejection: compile without the option
            warnings.warn(f"jaxkv: XLA rejects the decode round's option {name}={value!r} "
                          f"(Tuning.compiler_options); compiling without it ({str(e)[:200]})")
    return tuple(ok)


def round_compiler_options(plan: Plan) -> dict:
    """The XLA options of ``plan``'s compiled decode round: ``Tuning.compiler_options``, those
    this XLA accepts."""
    return dict(_accepted_options(plan.tuning.compiler_options, jax.default_backend()))
