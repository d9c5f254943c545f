"""The two-stage selectors' final choice: from the second stage's per-page statistics to the
``k`` pages a KV head attends to (``jaxkv.selectors.rescore``).

Operands: ``m``, ``l`` [B, H, Cs, Gs] float32, ``candidate_mass``'s page statistics (for
candidate ``c`` and query head ``g`` of the KV head's group: the largest logit ``m`` on the
page's valid tokens and ``l = sum_t exp(s_t - m)``; rows ``c >= C`` and columns ``g >= G``
are padding and never read as data); ``cand`` [B, H, C] int32, the candidate pages (valid
ones distinct, in any order, ``-1``: none, its statistics never read); ``seq_lens`` [B] int32.

Result [B, H, k] int32. **Selection rule**: a candidate's mass is the softmax mass the G query
heads put on its tokens (softmax over the candidates' valid tokens, one per query head, the
masses summed over the heads; ``mass_from_page_stats``). Candidates at or past
``ceil(seq_len / page_size)`` (or ``num_pages``) are never chosen; the sink pages and the
current page among them are forced (value ``+inf``); the ``k`` largest values are kept, ties
to the earlier candidate (``lax.top_k``'s order); the row is ascending, ``-1`` last.

Two implementations of op ``candidate_select``:

* ``"xla"``: the reference: the masses in XLA, ``lax.top_k``, a sort (``top_candidates``);
* ``"pallas"``: one program per (request, KV head) holds the row's statistics, computes the
  masses, finds the k-th largest value by a radix search on order-preserving int32 keys
  (``topk._kth_largest``), takes the values above it and the earliest ties (one prefix sum,
  ``topk._take_first``), compacts the chosen pages and orders them by an all-pairs rank of
  ``next_pow2(k)`` entries: no sort and no XLA kernel between the second stage and attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common, dense_select
from ._common import INVALID, register
from .candidate_mass import mass_from_page_stats
from .topk import _INT_MIN, _float_key, _kth_largest, _take_first, _total

OP = "candidate_select"
_BIG = 2**31 - 1


def _check(m, l, cand, seq_lens, G, k):
    if m.ndim != 4 or l.shape != m.shape:
        raise ValueError(f"m and l must both be [B, H, Cs, Gs], got {m.shape} and {l.shape}")
    B, H, Cs, Gs = m.shape
    if cand.ndim != 3 or cand.shape[:2] != (B, H) or cand.shape[2] > Cs:
        raise ValueError(f"cand must be [B, H, C] = [{B}, {H}, C <= {Cs}], got {cand.shape}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B] = [{B}], got {seq_lens.shape}")
    if not 1 <= G <= Gs:
        raise ValueError(f"G={G} must be in [1, {Gs}] (the statistics' query-head columns)")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")


def top_candidates(mass, cand, seq_lens, *, k: int, page_size: int, num_pages: int,
                   num_sink_pages: int):
    """The ``k`` candidates of most ``mass`` under the selection rule (module docstring).
    mass, cand [B, H, C] (``mass`` ``-inf`` where ``cand`` is -1); seq_lens [B]."""
    C = cand.shape[-1]
    n_valid = dense_select.num_valid_pages(seq_lens, page_size, num_pages)[:, None, None]
    ok = (cand >= 0) & (cand < n_valid)
    forced = ok & ((cand < num_sink_pages) | (cand == n_valid - 1))
    x = jnp.where(forced, jnp.inf, jnp.where(ok, mass, -jnp.inf))
    if C < k:  # top_k needs k <= C: pad with never-selected columns
        pad = [(0, 0), (0, 0), (0, k - C)]
        x = jnp.pad(x, pad, constant_values=-jnp.inf)
        cand = jnp.pad(cand, pad, constant_values=INVALID)
    vals, j = lax.top_k(x, k)
    pages = jnp.take_along_axis(cand, j, axis=-1)
    pages = jnp.sort(jnp.where(vals == -jnp.inf, _BIG, pages), axis=-1)
    return jnp.where(pages == _BIG, INVALID, pages)


@register(OP, "xla")
def candidate_select_reference(m, l, cand, seq_lens, *, G: int, k: int, page_size: int,
                               num_pages: int, num_sink_pages: int):
    """The reference: the masses in XLA, then ``top_candidates``."""
    _check(m, l, cand, seq_lens, G, k)
    C = cand.shape[2]
    some = (cand >= 0)[..., None]
    mass = mass_from_page_stats(jnp.where(some, m[:, :, :C], -jnp.inf),
                                jnp.where(some, l[:, :, :C], 0.0), cand, G)
    return top_candidates(mass, cand, seq_lens, k=k, page_size=page_size, num_pages=num_pages,
                          num_sink_pages=num_sink_pages)


def _kernel(lens_ref, cand_ref, m_ref, l_ref, out_ref, *, G, C, k, page_size, num_pages,
            num_sink_pages, radix_bits):
    b = pl.program_id(0)
    Cp, Gp = m_ref.shape
    kp = out_ref.shape[0]
    c = lax.broadcasted_iota(jnp.int32, (Cp,), 0)
    cand = cand_ref[...]
    some = (c < C) & (cand >= 0)
    use = some[:, None] & (lax.broadcasted_iota(jnp.int32, (Cp, Gp), 1) < G)
    m = jnp.where(use, m_ref[...], -jnp.inf)
    l = jnp.where(use, l_ref[...], 0.0)
    # Masses, as mass_from_page_stats: per query head a softmax over the candidates' tokens.
    top = jnp.max(m, axis=0)                                             # [Gp]
    w = l * jnp.exp(m - jnp.where(top > -jnp.inf, top, 0.0)[None, :])
    den = -(-jnp.sum(w, axis=0))  # a layout conversion between reduces (topk._total)
    mass = jnp.sum(w / jnp.where(den > 0, den, 1.0)[None, :], axis=1)    # [Cp]
    n_valid = _common.num_valid_pages(lens_ref[b], page_size, num_pages)
    ok = some & (cand < n_valid)
    forced = ok & ((cand < num_sink_pages) | (cand == n_valid - 1))
    x = jnp.where(forced, jnp.inf, mass)
    keys = jnp.where(ok & (x > -jnp.inf), _float_key(x), jnp.int32(_INT_MIN))
    t = _kth_largest(keys, k, radix_bits)
    sel, crank = _take_first(keys, t, k)  # crank: inclusive count of chosen up to each entry
    n_sel = _total(sel.astype(jnp.int32))
    # Compact the chosen pages in candidate order: slot s holds the entry with crank s + 1.
    slot = lax.broadcasted_iota(jnp.int32, (kp, Cp), 0)
    hit = sel[None, :] & (crank[None, :] - 1 == slot)
    picked = jnp.sum(jnp.where(hit, cand[None, :], 0), axis=1)          # [kp]
    s = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    v = jnp.where(s < n_sel, picked, _BIG)
    # Ascending: each entry's rank among the kp (ties only among the _BIG padding: by slot).
    i = lax.broadcasted_iota(jnp.int32, (kp, kp), 0)
    j = lax.broadcasted_iota(jnp.int32, (kp, kp), 1)
    vi, vj = v[:, None], v[None, :]
    before = (vj < vi) | ((vj == vi) & (j < i))
    rank = jnp.sum(before.astype(jnp.int32), axis=1)                     # [kp]
    out = jnp.sum(jnp.where(rank[None, :] == i, vj, 0), axis=1)          # out[r] = v with rank r
    out_ref[...] = jnp.where(out == _BIG, INVALID, out)


def default_warps(candidates: int) -> int:
    """The kernel's warps per program for a row of ``candidates`` (padded to a power of two):
    4 below 512, 8 from 512. At 512 candidates (Qwen-like B=8 / 8B-like B=1 at 128k, one
    H100) the decode step with 8 warps is 9% / 4% shorter than with XLA's form of the final
    choice, which is shorter than with 4 warps (docs/decisions.md)."""
    return 4 if candidates < 512 else 8


@register(OP, "pallas")
def candidate_select_pallas(m, l, cand, seq_lens, *, G: int, k: int, page_size: int,
                            num_pages: int, num_sink_pages: int, radix_bits: int = 4,
                            num_warps: int | None = None, interpret: bool | None = None):
    """The Pallas kernel (module docstring). Grid (B, H); ``radix_bits`` (1, 2 or 4) per pass
    of the radix search; ``num_warps`` default 4, 8 from 512 candidates (``default_warps``)."""
    _check(m, l, cand, seq_lens, G, k)
    B, H, Cs, Gs = m.shape
    C = cand.shape[2]
    Cp = _common.next_pow2(max(Cs, k))
    Gp = _common.next_pow2(Gs)
    kp = _common.next_pow2(k)
    m = jnp.asarray(m, jnp.float32)
    l = jnp.asarray(l, jnp.float32)
    if (Cp, Gp) != (Cs, Gs):  # Triton blocks are powers of two; the padding is never data
        pad = ((0, 0), (0, 0), (0, Cp - Cs), (0, Gp - Gs))
        m = jnp.pad(m, pad, constant_values=-jnp.inf)
        l = jnp.pad(l, pad)
    cand = jnp.asarray(cand, jnp.int32)
    if Cp != C:
        cand = jnp.pad(cand, ((0, 0), (0, 0), (0, Cp - C)), constant_values=INVALID)
    lens = jnp.asarray(seq_lens, jnp.int32)
    kernel = functools.partial(_kernel, G=G, C=C, k=k, page_size=page_size, num_pages=num_pages,
                               num_sink_pages=num_sink_pages, radix_bits=radix_bits)
    stat_spec = pl.BlockSpec((None, None, Cp, Gp), lambda b, h: (b, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, H, kp), jnp.int32),
        grid=(B, H),
        in_specs=[pl.BlockSpec(lens.shape, lambda b, h: (0,)),
                  pl.BlockSpec((None, None, Cp), lambda b, h: (b, h, 0)), stat_spec, stat_spec],
        out_specs=pl.BlockSpec((None, None, kp), lambda b, h: (b, h, 0)),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or default_warps(Cp), num_stages=1),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name="candidate_select",
    )(lens, cand, m, l)
    return out if kp == k else out[..., :k]


def candidate_select(m, l, cand, seq_lens, *, G: int, k: int, page_size: int, num_pages: int,
                     num_sink_pages: int, implementation=None, num_warps: int | None = None):
    """The final choice (module docstring); ``implementation`` picks the kernel or the
    reference (``_common.resolve``); ``num_warps`` tunes the kernel (the reference ignores
    it)."""
    fn = _common.resolve(OP, implementation)
    kw = dict(num_warps=num_warps) if fn is candidate_select_pallas else {}
    return fn(m, l, cand, seq_lens, G=G, k=k, page_size=page_size, num_pages=num_pages,
              num_sink_pages=num_sink_pages, **kw)
