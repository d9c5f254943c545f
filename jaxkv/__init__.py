"""jaxkv: long-context sparse-attention decoding in JAX/Pallas with the KV cache in host RAM.

Main entry point: :func:`jaxkv.generate`. Configuration: :class:`CacheConfig` (static) and
:class:`Sampling` (traced). Lower level: :mod:`jaxkv.cache` (host-tier state),
:mod:`jaxkv.lru` (static-shape LRU), :mod:`jaxkv.engine` (compiled prefill/decode).
"""
from jaxkv.config import CacheConfig, Sampling, greedy
from jaxkv.spec import INVALID, CacheSpec

__all__ = ["CacheConfig", "CacheSpec", "GenerateResult", "INVALID", "Sampling", "generate", "greedy"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing jaxkv must not pull the kernels and models
    if name in ("generate", "GenerateResult", "TokenStream"):
        from jaxkv import api as _g
        return getattr(_g, name)
    raise AttributeError(name)
