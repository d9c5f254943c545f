"""The selector protocol and its registry (see the package docstring)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_REGISTRY: dict[str, "Selector"] = {}


class Selector:
    """One page selector. Stateless: every method takes the static plan
    (``jaxkv.plan.Plan``) and the arrays it works on; instances are registered by name.

    Shapes: L layers, B requests, Np pages per sequence, H KV heads, Hq query heads, D head
    dim, T prompt tokens, k = ``plan.k`` selected pages per request, layer and KV head.
    """

    name: str = ""
    #: Whether lagged selection may choose the next step's pages of every layer at once after
    #: the step's layer loop (:meth:`update_select_all_layers`, one launch of each kernel
    #: instead of one per layer); otherwise each layer selects inside the loop.
    selects_all_layers: bool = False
    #: Whether the selection reads the summaries at all (False: every valid page).
    scored: bool = True
    #: Whether it may run with the host tier (False: a measurement device that keeps a full
    #: copy of the keys on device, resident mode only).
    host_tier: bool = True
    #: Whether a first stage picks candidates that a second re-ranks
    #: (``CacheConfig.candidate_pages`` sets their number).
    two_stage: bool = False

    def check_plan(self, plan) -> None:
        """Raise ``ValueError`` naming the ``CacheConfig`` field and the fix when ``plan``'s
        settings leave this selector unable to run (checked by ``make_plan``); none here."""

    def init(self, plan) -> tuple:
        """Empty summaries of all layers (a tuple of device arrays; () for none)."""
        raise NotImplementedError

    def fill(self, plan, summaries: tuple, layer, layer_params, h, k, positions,
             lengths) -> tuple:
        """Fill layer ``layer``'s summaries from a prompt: h [B, T, d] normed hidden states,
        k [B, T, H, D] post-RoPE keys, positions [B, T], lengths [B] prompt lengths."""
        raise NotImplementedError

    def update_select(self, plan, summaries: tuple, layer, layer_params, h, q, kv_new,
                      positions, *, ahead: bool = False):
        """One decode step of one layer: fold the new token into the summaries, then select.

        h [B, 1, d] normed hidden state, q [B, Hq, D] the query, kv_new [B, 2, H, D] the new
        token's K/V, positions [B] its position (-1: inactive request). ``ahead``: select for
        the next token (position + 1) with this query (lagged selection). Returns
        (summaries, pages [B, H, k'])."""
        raise NotImplementedError

    def fold(self, plan, summaries: tuple, layer, layer_params, h, q, kv_new, positions):
        """Fold appended tokens into layer ``layer``'s summaries (a continued context's turn):
        the same summaries as :meth:`update_select` called on the tokens one by one, in order.

        h [B, T, d] normed hidden states, q [B, T, Hq, D], kv_new [B, T, 2, H, D],
        positions [B, T] int32 (-1: padding, no change). This default runs
        :meth:`update_select` per token; selectors whose fold is a scatter override it."""

        def one(i, own):
            h_i = jax.lax.dynamic_slice_in_dim(h, i, 1, axis=1)
            own, _ = self.update_select(plan, own, layer, layer_params, h_i, q[:, i],
                                        kv_new[:, i], positions[:, i])
            return tuple(own)

        return jax.lax.fori_loop(0, positions.shape[1], one, tuple(summaries))

    def first_pages(self, plan, summaries: tuple, layer, layer_params, h_last, q_last,
                    lengths):
        """Lagged selection's first pages: what the prompt's last query selects for the
        first decode token (position ``lengths``). h_last [B, 1, d], q_last [B, Hq, D].
        Returns pages [B, H, k]."""
        raise ValueError(f"lagged selection needs a scored selector, not {self.name!r}")

    def update_select_all_layers(self, plan, summaries: tuple, q, kv_new, positions):
        """Lagged selection for every layer at once (``selects_all_layers``): q [L, B, Hq,
        D], kv_new [L, B, 2, H, D], positions [L, B] (-1: no update and no selection).
        Returns (summaries, ahead [L, B, H, k]): the pages for position + 1."""
        raise NotImplementedError


def fold_pages(arr, layer, vals, positions, page_size: int, combine: str):
    """Fold per-token values into per-page summaries as decode steps do, all tokens at once.

    arr [L, B, Np, ...]; vals [B, T, ...] (arr's trailing shape); positions [B, T] int32
    (-1 or pages ``>= Np``: no change). A token at a page's offset 0 starts that page anew
    (its summary is the token's own), every other token is combined with the page's summary
    by ``combine`` ("max", "min" or "add"). Each page's result equals the tokens folded one by
    one in position order (exactly for max / min; for "add" up to the order of the sum)."""
    Np = arr.shape[2]
    B = positions.shape[0]
    page = jnp.where(positions >= 0, positions // page_size, Np)
    page = jnp.where(page < Np, page, Np)                       # Np: dropped by the scatters
    first = (positions >= 0) & (positions % page_size == 0)
    b = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], positions.shape)
    ident = {"max": -jnp.inf, "min": jnp.inf, "add": 0}[combine]
    arr = arr.at[layer, b, jnp.where(first, page, Np)].set(
        jnp.asarray(ident, arr.dtype), mode="drop")
    upd = arr.at[layer, b, page]
    vals = vals.astype(arr.dtype)
    return {"max": upd.max, "min": upd.min, "add": upd.add}[combine](vals, mode="drop")


def key_mean(k, lengths):
    """The mean key of each request and KV head over its prompt, k [B, T, H, D] (tokens at
    or past ``lengths`` [B] ignored) -> [B, H, D] float32; zeros for an empty prompt."""
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]                  # [B, T]
    total = jnp.sum(jnp.where(valid[..., None, None], k.astype(jnp.float32), 0.0), axis=1)
    return total / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None, None]


def register(cls):
    """Class decorator: register one instance of a :class:`Selector` subclass by its name."""
    _REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> Selector:
    """The selector registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of {names()}") from None


def names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def split(summaries: tuple, plan):
    """(the selector's own arrays, ``shift`` or None, ``ahead`` or None) of a summaries tuple.

    The engine appends its own arrays after the selector's: the stored keys' shift
    [L, B, H, D] float32 when ``plan.key_shift`` (quantized KV), then, with lagged selection,
    ``ahead`` [L, B, H, k] int32, the pages of the next step (always the last array)."""
    summaries = tuple(summaries)
    ahead = summaries[-1] if plan.lagged else None
    if plan.lagged:
        summaries = summaries[:-1]
    shift = summaries[-1] if plan.key_shift else None
    if plan.key_shift:
        summaries = summaries[:-1]
    return summaries, shift, ahead


def join(own: tuple, shift=None, ahead=None) -> tuple:
    """The inverse of :func:`split`."""
    return tuple(own) + tuple(a for a in (shift, ahead) if a is not None)
