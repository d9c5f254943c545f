"""Page selectors: which pages of its KV cache each layer reads at a decode step.

A selector is one small object (:class:`Selector`) with one module here: its page summaries
(device arrays, one entry per layer, request and page, passed whole with a traced layer
index), how a prompt fills them, how a decode token is folded in, how a continued context's
appended tokens are folded in at once, and how pages are chosen for a query. Every method
has fixed shapes; pages come back as within-sequence page indices ``[B, H, k]`` int32,
ascending, ``-1`` padded, the sink pages and the current page always included
(``jaxkv.kernels.dense_select``'s convention). Adding a selector means adding a module that
registers a :class:`Selector` subclass with :func:`register`.

Lagged selection (``CacheConfig.selection_lag=1``) is the step's business, not a selector's:
the summaries tuple then ends with one more array, ``ahead`` [L, B, H, k] int32, the pages
each layer attends to at the next step; with quantized KV the stored keys' shift comes before it
(:func:`split`, :func:`join`).
"""
from __future__ import annotations

from jaxkv.selectors.base import Selector, get, join, names, register, split
from jaxkv.selectors import dense, indexer, oracle, quest, rescore  # noqa: F401 - register

__all__ = ["Selector", "get", "join", "names", "register", "split"]
