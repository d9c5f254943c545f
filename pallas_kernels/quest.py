"""Quest page selection: per-page elementwise key max/min summaries and an upper-bound score.

Summaries ``kmax, kmin: [L, B, Np, H, D]`` (KV dtype) hold the elementwise max / min of the
post-RoPE keys of each page, per layer, request and KV head. For the query heads ``g`` of group
``h`` (query head ``i`` belongs to KV head ``i // G``, ``G = Hq // H``)

    U[b, h, p] = sum_g sum_d max(q[b, g, d] * kmax[p, h, d], q[b, g, d] * kmin[p, h, d])

an upper bound of ``sum_g q_g . k_t`` over the tokens ``t`` of page ``p``. Because
``kmax >= kmin``, ``max(q * M, q * m) = relu(q) * M + min(q, 0) * m``, so the group sum is
linear: ``U = Qp . M + Qn . m`` with ``Qp = sum_g relu(q_g)``, ``Qn = sum_g min(q_g, 0)``.
The Pallas kernel uses that form (one pass over the summaries, fp32 accumulation); the
reference computes the literal formula.

Quantized bounds: ``kmax, kmin`` int8 with ``scale`` [L, B, Np, H] float32, one per page and KV
head shared by both (a power of two: the smallest with the page's largest |bound| within 127
of them), stand for ``kmax * scale`` and
``kmin * scale``, rounded outward (``kmax`` up, ``kmin`` down) so the score stays an upper
bound: half the bytes the scores read. Every public function takes ``scale=`` (None: bounds in
a float dtype) and, where it returns the bounds, returns the updated scale after ``kmin``. The
updating ones also take ``shift`` [L, B, H, D] float32: the bounds are then those of the keys
less it (a token's key is shifted before it is folded in). Every page's score of a row moves by
the same ``sum_g q_g . shift``, so no selection changes, but a common component of the keys (a
K bias) no longer sets the scale of every page's small channels.
``quantize_bounds`` / ``requantize_row`` are the rules (the kernel runs the latter as it is).

Public: ``quest_select`` (scores + top-k), ``quest_update`` (decode write),
``quest_update_select`` (both, one kernel for update + scores with the "pallas_cmax" top-k),
``quest_summarize`` (prefill). Selection order and padding: see ``dense_select`` module docstring.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common, topk
from . import dense_select as ds
from .dense_select import num_valid_pages, select_top_pages

OP = "quest_scores"
OP_CMAX = "quest_scores_cmax"  # scores + chunk maxima (top-k method "pallas_cmax")
OP_UPDATE_CMAX = "quest_update_scores_cmax"  # decode-step summary update + OP_CMAX, one launch
# No per-op default: the backend's (Pallas on the GPU). XLA's scores are faster than the
# kernel alone but make the decode step slower (docs/decisions.md).
# Elements of each summary array one program reads (block_pages * block_heads * D).
_BLOCK_ELEMS = 8192
# Each program of the scores kernel forms its heads' query-group sums (Qp, Qn of ``_group_q``)
# from the query itself: one XLA reduction less per layer, and a faster step than with the sums
# formed outside (docs/decisions.md).


def _check(q, kmax, kmin, scale=None):
    if kmax.shape != kmin.shape or kmax.ndim != 5:
        raise ValueError(f"kmax/kmin must both be [L, B, Np, H, D], got {kmax.shape}, {kmin.shape}")
    if scale is not None and (scale.shape != kmax.shape[:4] or kmax.dtype != jnp.int8
                              or kmin.dtype != jnp.int8):
        raise ValueError(f"quantized bounds: kmax / kmin int8 [L, B, Np, H, D] and scale "
                         f"[L, B, Np, H], got {kmax.dtype}{kmax.shape}, {kmin.dtype}, scale "
                         f"{scale.shape}")
    _, b, _, h, d = kmax.shape
    if q.ndim != 3 or q.shape[0] != b or q.shape[2] != d or q.shape[1] % h:
        raise ValueError(f"q must be [B, G*H, D] for kmax {kmax.shape}, got {q.shape}")


def _group_q(q: jax.Array, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """q [B, Hq, D] -> (Qp, Qn) [B, H, D] f32: group sums of relu(q) and min(q, 0)."""
    b, hq, d = q.shape
    qg = q.astype(jnp.float32).reshape(b, num_kv_heads, hq // num_kv_heads, d)
    return jnp.maximum(qg, 0.0).sum(axis=2), jnp.minimum(qg, 0.0).sum(axis=2)


BOUND_Q = 127.0  # the largest |quantized bound|
_SCALE_EXP_MIN = 27  # biased float32 exponent of the smallest scale, 2**-100 (all-zero pages)


def _f32_pow2(biased_exp):
    """2 ** (biased_exp - 127) as float32, built from its bits (exact on every backend)."""
    return lax.bitcast_convert_type(biased_exp.astype(jnp.int32) << 23, jnp.float32)


def bound_scale(amax):
    """The scale of quantized bounds whose largest |value| is ``amax`` (>= 0): the smallest
    power of two ``p`` with ``BOUND_Q * p >= amax`` (at least 2**-100). Returns (p, 1 / p),
    both exact: quantizing is then a multiplication by a power of two, and so is
    dequantizing, bit for bit the same in numpy, XLA and the Triton kernel (whose float
    division is not IEEE's)."""
    amax = amax.astype(jnp.float32)
    e = (lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF  # amax in [2^(e-127), 2^(e-126))
    pe = jnp.maximum(e - 6, _SCALE_EXP_MIN)  # BOUND_Q * 2^(e-133) = 1.98 * 2^(e-127)
    p = _f32_pow2(jnp.where(amax > BOUND_Q * _f32_pow2(pe), pe + 1, pe))
    return p, _scale_inverse(p)


def _scale_inverse(scale):
    """1 / scale for a power-of-two scale, exact."""
    e = (lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32) >> 23) & 0xFF
    return _f32_pow2(254 - e)


def quantize_bounds(mx, mn):
    """Float bounds [..., D] -> (kmax, kmin) int8 [..., D] and scale [...] f32: the scale
    :func:`bound_scale` of the largest |bound|, ``kmax = ceil(mx / scale)``, ``kmin =
    floor(mn / scale)``: outward, ``kmax * scale >= mx`` and ``kmin * scale <= mn`` exactly.
    A page with no token (``quest_summarize``'s -inf / +inf row) becomes 0 / 0."""
    mx, mn = mx.astype(jnp.float32), mn.astype(jnp.float32)
    empty = ~jnp.isfinite(mx[..., :1])
    mx, mn = jnp.where(empty, 0.0, mx), jnp.where(empty, 0.0, mn)
    scale, inv = bound_scale(jnp.max(jnp.maximum(jnp.abs(mx), jnp.abs(mn)), axis=-1))
    lim = lambda x: jnp.clip(x, -BOUND_Q, BOUND_Q).astype(jnp.int8)  # noqa: E731
    return lim(jnp.ceil(mx * inv[..., None])), lim(jnp.floor(mn * inv[..., None])), scale


def requantize_row(mq, nq, scale, kn, first):
    """Fold one token's key into a page's quantized bounds: mq, nq [..., D] (the stored int8
    values, any dtype), scale [...] f32 (a power of two), kn [..., D] f32, first (bool,
    broadcast to [...]): the page's first token (the bounds become the token's). Returns (mq,
    nq) float32 of integer values and the scale.

    The scale grows (to :func:`bound_scale` of the key) only when the key leaves the page's
    range, ``|kn| > BOUND_Q * scale`` somewhere, or on a page's first token. The arithmetic
    is exact, so an element the key does not move keeps its value, folding the same key twice
    changes nothing, and only a grown scale rounds the row outward again (by less than one
    quantum of the new scale)."""
    mq, nq = mq.astype(jnp.float32), nq.astype(jnp.float32)
    first = jnp.broadcast_to(first, scale.shape)
    kabs = jnp.max(jnp.abs(kn), axis=-1)
    grow = first | (kabs > BOUND_Q * scale)
    new, new_inv = bound_scale(kabs)
    s2 = jnp.where(grow, new, scale)
    inv2 = jnp.where(grow, new_inv, _scale_inverse(scale))[..., None]
    mx = jnp.where(first[..., None], kn, jnp.maximum(mq * scale[..., None], kn))
    mn = jnp.where(first[..., None], kn, jnp.minimum(nq * scale[..., None], kn))
    lim = lambda x: jnp.clip(x, -BOUND_Q, BOUND_Q)  # noqa: E731
    return lim(jnp.ceil(mx * inv2)), lim(jnp.floor(mn * inv2)), s2


def dequantize_bounds(kmax, kmin, scale):
    """The float32 bounds quantized ones stand for (float bounds as they are when ``scale`` is
    None)."""
    if scale is None:
        return kmax.astype(jnp.float32), kmin.astype(jnp.float32)
    return (kmax.astype(jnp.float32) * scale[..., None],
            kmin.astype(jnp.float32) * scale[..., None])


def quest_scores_reference(q, kmax, kmin, layer, seq_lens, *, page_size, scale=None):
    """Literal Quest scores (the tests' oracle; the registered "xla" implementation is the
    linear form, :func:`quest_scores_xla`). q [B, Hq, D]; kmax/kmin [L, B, Np, H, D]; layer int32 scalar;
    seq_lens [B]; scale: quantized bounds' [L, B, Np, H] (module docstring). Returns [B, H, Np]
    f32, -inf on pages ``>= ceil(seq_lens / page_size)``."""
    _check(q, kmax, kmin, scale)
    _, b, np_, h, d = kmax.shape
    qg = q.astype(jnp.float32).reshape(b, h, -1, d)  # [B, H, G, D]
    at = lambda a: None if a is None else lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)  # noqa: E731
    mx, mn = dequantize_bounds(at(kmax), at(kmin), at(scale))
    prod = jnp.maximum(qg[:, None] * mx[:, :, :, None], qg[:, None] * mn[:, :, :, None])
    s = prod.sum(axis=(3, 4)).transpose(0, 2, 1)  # [B, H, Np]
    n_valid = num_valid_pages(seq_lens, page_size, np_)
    pages = lax.broadcasted_iota(jnp.int32, s.shape, 2)
    return jnp.where(pages < n_valid[:, None, None], s, -jnp.inf)


@_common.register(OP, "xla")
def quest_scores_xla(q, kmax, kmin, layer, seq_lens, *, page_size, scale=None, **tuning):
    """Quest scores in XLA, linear form ``U = Qp . M + Qn . m`` (module docstring): one
    multiply-reduce over D per summary array, which XLA fuses into one pass over the
    summaries whatever the group size. Shapes and result as :func:`quest_scores_reference`
    (the kernel's tuning arguments are ignored)."""
    del tuning
    _check(q, kmax, kmin, scale)
    _, b, np_, h, d = kmax.shape
    qp, qn = _group_q(q, h)  # [B, H, D] f32
    mx = lax.dynamic_index_in_dim(kmax, layer, 0, keepdims=False).astype(jnp.float32)
    mn = lax.dynamic_index_in_dim(kmin, layer, 0, keepdims=False).astype(jnp.float32)
    s = (mx * qp[:, None] + mn * qn[:, None]).sum(axis=-1)  # [B, Np, H]
    if scale is not None:  # one multiply per page and head: the scale is the row's
        s = s * lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)
    s = s.transpose(0, 2, 1)  # [B, H, Np]
    n_valid = num_valid_pages(seq_lens, page_size, np_)
    pages = lax.broadcasted_iota(jnp.int32, s.shape, 2)
    return jnp.where(pages < n_valid[:, None, None], s, -jnp.inf)


def _group_q_in_kernel(q_ref, b, h0, *, block_heads, group, head_dim):
    """``_group_q`` inside a program: the group sums of relu(q) and min(q, 0) for KV heads
    ``h0 .. h0 + block_heads - 1``, from the query [B, G * H, D] as it is (the G rows of a
    head added in order)."""
    shape = (block_heads, head_dim)
    heads = h0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    d = lax.broadcasted_iota(jnp.int32, shape, 1)
    bb = jnp.broadcast_to(b, shape)
    qp = qn = jnp.zeros(shape, jnp.float32)
    for g in range(group):
        x = plgpu.load(q_ref.at[bb, heads * group + g, d]).astype(jnp.float32)
        qp, qn = qp + jnp.maximum(x, 0.0), qn + jnp.minimum(x, 0.0)
    return qp, qn


def _quest_kernel(*refs, page_size, num_pages, block_pages, n_sub, block_heads, head_dim, chunk,
                  unmasked, eviction_policy, update, group, quant=False, shifted=False):
    """One program: ``n_sub`` blocks of ``block_pages`` pages x ``block_heads`` heads; writes
    their scores and, when ``chunk`` is given, the chunk maxima of those scores.

    refs: layer, lens, the query [B, group * H, D] (the program forms its heads' group sums
    itself, ``_group_q_in_kernel``), kmax, kmin, [k_new, positions when ``update``], then the
    outputs scores, [cmax], [kmax, kmin aliased to the inputs when ``update``]. With
    ``update`` the new token's key is folded into its page's summary first (as
    :func:`quest_update`): every program computes that page's updated row and its score (one
    [Hb, D] row), uses that score for the page, and the program whose pages hold it writes
    the row back (a per-element select over whole blocks instead costs registers and time:
    docs/decisions.md). With ``quant`` the bounds are int8 and their scale [L, B, Np, H] follows
    kmin (and the updated scale the updated kmin): a page's score is the int8 dot products times
    its scale, and the token's page is folded by :func:`requantize_row`; with ``shifted`` too
    the keys' shift [L, B, H, D] follows the scale and the token's key is shifted first."""
    layer_ref, lens_ref, q_ref, kmax_ref, kmin_ref = refs[:5]
    refs = refs[5:]
    scale_ref = shift_ref = None
    if quant:
        scale_ref, refs = refs[0], refs[1:]
    if shifted:
        shift_ref, refs = refs[0], refs[1:]
    if update:
        kn_ref, pos_ref, refs = refs[0], refs[1], refs[2:]
    out_ref, refs = refs[0], refs[1:]
    cmax_ref = refs[:1] if chunk is not None else ()
    refs = refs[len(cmax_ref):]
    if update:
        kmax_out, kmin_out = refs[:2]
        refs = refs[2:]
        if quant:
            scale_out = refs[0]
    b = pl.program_id(0)
    h0 = pl.program_id(1) * block_heads
    base = pl.program_id(2) * (block_pages * n_sub)
    layer = layer_ref[0]
    n_valid = _common.num_valid_pages(lens_ref[b], page_size, num_pages)
    qp, qn = _group_q_in_kernel(q_ref, b, h0, block_heads=block_heads, group=group,
                                head_dim=head_dim)
    qp, qn = qp[None], qn[None]
    shape = (block_pages, block_heads, head_dim)
    if update:  # the new token's page: its updated summary row and score, [Hb, D] / [Hb]
        pos = pos_ref[b]
        cur = jnp.where((pos >= 0) & (pos // page_size < num_pages), pos // page_size, -1)
        first = pos % page_size == 0
        row = (layer, b, jnp.maximum(cur, 0), pl.ds(h0, block_heads), slice(None))
        if quant:
            kn = kn_ref[...].astype(jnp.float32)
            if shifted:
                kn = kn - shift_ref[layer, b, pl.ds(h0, block_heads), :]
            srow = row[:-1]
            mx_cur, mn_cur, sc_cur = requantize_row(kmax_ref[row], kmin_ref[row],
                                                    scale_ref[srow], kn, first)
            s_cur = jnp.sum(mx_cur * qp[0] + mn_cur * qn[0], axis=-1) * sc_cur
        else:
            kn = kn_ref[...].astype(kmax_ref.dtype).astype(jnp.float32)
            mx_cur = jnp.where(first, kn, jnp.maximum(kmax_ref[row].astype(jnp.float32), kn))
            mn_cur = jnp.where(first, kn, jnp.minimum(kmin_ref[row].astype(jnp.float32), kn))
            s_cur = jnp.sum(mx_cur * qp[0] + mn_cur * qn[0], axis=-1)

        # kmax_out aliases kmax_ref: another program may read this row before or after the
        # write (or torn between); only the program whose pages hold it writes the row and
        # uses its score, and it reads the row before its own write.
        mine = (cur >= base) & (cur < base + block_pages * n_sub)

        @pl.when(mine)
        def _():
            kmax_out[row] = mx_cur.astype(kmax_out.dtype)
            kmin_out[row] = mn_cur.astype(kmin_out.dtype)
            if quant:
                scale_out[srow] = sc_cur
    run_max = None
    for i in range(n_sub):
        p0 = base + i * block_pages
        valid = p0 + lax.broadcasted_iota(jnp.int32, (block_pages,), 0) < n_valid
        idx = (layer, b, pl.ds(p0, block_pages), pl.ds(h0, block_heads), slice(None))

        def block_scores(masked, idx=idx, valid=valid, p0=p0):
            kw = dict(eviction_policy=eviction_policy)
            if masked:  # pages past the sequence (or past Np) are never read
                kw.update(mask=jnp.broadcast_to(valid[:, None, None], shape), other=0.0)
            mx = plgpu.load(kmax_ref.at[idx], **kw).astype(jnp.float32)
            mn = plgpu.load(kmin_ref.at[idx], **kw).astype(jnp.float32)
            s = jnp.sum(mx * qp + mn * qn, axis=-1)  # [BP, Hb]
            if quant:  # the page's scale, once per page and head
                skw = dict(kw)
                if masked:
                    skw.update(mask=jnp.broadcast_to(valid[:, None], s.shape), other=0.0)
                s = s * plgpu.load(scale_ref.at[idx[:-1]], **skw)
            if update:  # the new token's page scores its updated row
                page = p0 + lax.broadcasted_iota(jnp.int32, s.shape, 0)
                s = jnp.where(page == cur, s_cur[None, :], s)
            return s

        if unmasked:  # plain loads for blocks inside the sequence, masked ones at its end
            s = lax.cond(p0 + block_pages <= n_valid, functools.partial(block_scores, False),
                         functools.partial(block_scores, True))
        else:
            s = block_scores(True)
        s = jnp.where(valid[:, None], s, -jnp.inf)
        if n_sub == 1:
            out_ref[...] = s.T
        else:
            out_ref[:, pl.ds(i * block_pages, block_pages)] = s.T
        if not cmax_ref:
            continue
        sc = jnp.where(s == s, s, -jnp.inf)  # NaN -> -inf (the top-k's order)
        if chunk <= block_pages:  # n_sub == 1
            cm = jnp.max(sc.reshape(block_pages // chunk, chunk, block_heads), axis=1)
            cmax_ref[0][...] = cm.T
        else:
            m = jnp.max(sc, axis=0)  # [Hb]
            run_max = m if run_max is None else jnp.maximum(run_max, m)
    if cmax_ref and chunk > block_pages:
        cmax_ref[0][...] = run_max[:, None]


def _scores_call(q, kmax, kmin, layer, seq_lens, *, page_size, chunk, block_pages, num_warps,
                 unmasked, eviction_policy, interpret, update=None, scale=None, shift=None):
    """The Pallas scores kernel; returns (scores,) or (scores, cmax) when ``chunk``, followed
    by the updated (kmax, kmin) when ``update = (k_new, positions [B])``, k_new [B, H, D] or
    the token's stacked K/V [B, 2, H, D] (its K read in place). Each program forms its heads'
    group sums of the query itself (``_group_q_in_kernel``; the sums of ``_group_q`` to
    rounding: the order of the G terms may differ). ``scale``: quantized bounds (module
    docstring); with ``update`` the updated scale follows kmin, and ``shift`` (with both) is
    the keys' shift."""
    _check(q, kmax, kmin, scale)
    if shift is not None and (update is None or scale is None):
        raise ValueError("shift goes with quantized bounds (scale) and an update")
    _, b, np_, h, d = kmax.shape
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two")
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError(f"chunk {chunk} must be a power of two")
    bh = _common.largest_pow2_divisor(h, h)
    if block_pages is None:
        block_pages = max(1, _BLOCK_ELEMS // (bh * d))
    block_pages = min(block_pages, _common.next_pow2(np_))
    if block_pages & (block_pages - 1):
        raise ValueError(f"block_pages {block_pages} must be a power of two")
    pp = block_pages if chunk is None else max(block_pages, chunk)  # pages per program
    n_prog = pl.cdiv(np_, pp)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_quest_kernel, page_size=page_size, num_pages=np_,
                               block_pages=block_pages, n_sub=pp // block_pages,
                               block_heads=bh, head_dim=d, chunk=chunk, unmasked=unmasked,
                               eviction_policy=eviction_policy, update=update is not None,
                               group=q.shape[1] // h, quant=scale is not None,
                               shifted=shift is not None)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    head_block = pl.BlockSpec((None, bh, d), lambda i, j, k: (i, j, 0))
    out_shape = [jax.ShapeDtypeStruct((b, h, n_prog * pp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, bh, pp), lambda i, j, k: (i, j, k))]
    if chunk is not None:
        out_shape.append(jax.ShapeDtypeStruct((b, h, n_prog * pp // chunk), jnp.float32))
        out_specs.append(pl.BlockSpec((None, bh, pp // chunk), lambda i, j, k: (i, j, k)))
    in_specs = [pl.BlockSpec((1,), lambda *_: (0,)), pl.BlockSpec((b,), lambda *_: (0,)),
                full(q), full(kmax), full(kmin)]
    operands = [layer_arr, jnp.asarray(seq_lens, jnp.int32), q, kmax, kmin]
    if scale is not None:
        in_specs.append(full(scale))
        operands.append(scale)
    if shift is not None:
        in_specs.append(full(shift))
        operands.append(shift)
    aliases = {}
    if update is not None:
        k_new, positions = update
        kn_block = head_block if k_new.ndim == 3 else pl.BlockSpec(
            (None, None, bh, d), lambda i, j, k: (i, 0, j, 0))  # [B, 2, H, D]: K at index 0
        in_specs += [kn_block, pl.BlockSpec((b,), lambda *_: (0,))]
        operands += [k_new, jnp.asarray(positions, jnp.int32)]
        aliases = {3: len(out_shape), 4: len(out_shape) + 1}  # kmax, kmin (after layer, lens, q)
        out_shape += [jax.ShapeDtypeStruct(kmax.shape, kmax.dtype),
                      jax.ShapeDtypeStruct(kmin.shape, kmin.dtype)]
        out_specs += [full(kmax), full(kmin)]
        if scale is not None:
            aliases[5] = len(out_shape)
            out_shape.append(jax.ShapeDtypeStruct(scale.shape, scale.dtype))
            out_specs.append(full(scale))
    name = "quest_scores" if chunk is None else "quest_scores_cmax"
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(b, h // bh, n_prog),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=_common.interpret_mode() if interpret is None else interpret,
        name=name if update is None else "quest_update_" + name,
    )(*operands)


def quest_scores_pallas(q, kmax, kmin, layer, seq_lens, *, page_size, block_pages=None,
                        num_warps=4, unmasked=False, eviction_policy=None, interpret=None,
                        scale=None):
    """Quest scores with the Pallas kernel. Shapes as ``quest_scores_reference`` except the
    result is [B, H, Np_pad] f32 (Np rounded up to a multiple of ``block_pages``; padding
    columns are -inf). D must be a power of two. Tuning (static): ``block_pages`` (power of
    two), ``num_warps``, ``unmasked`` (plain loads for blocks that lie inside the sequence,
    masked loads only for the block holding its end),
    ``eviction_policy`` (Triton load hint, e.g. "evict_first")."""
    return _scores_call(q, kmax, kmin, layer, seq_lens, page_size=page_size, chunk=None,
                        block_pages=block_pages, num_warps=num_warps,
                        unmasked=unmasked, eviction_policy=eviction_policy,
                        interpret=interpret, scale=scale)[0]


_common.register(OP, "pallas")(quest_scores_pallas)


def quest_scores_cmax_reference(q, kmax, kmin, layer, seq_lens, *, page_size, chunk, scale=None):
    """``quest_scores_reference`` plus chunk maxima (the tests' oracle). Returns (scores
    [B, H, Np_pad] f32, cmax [B, H, Np_pad // chunk] f32), ``Np_pad = ceil(Np / chunk) * chunk``
    (padding -inf); ``cmax[..., c]`` = max of ``scores[..., c*chunk:(c+1)*chunk]`` with NaN
    taken as -inf."""
    s = quest_scores_reference(q, kmax, kmin, layer, seq_lens, page_size=page_size, scale=scale)
    return topk.pad_and_chunk_max(s, chunk)


@_common.register(OP_CMAX, "xla")
def quest_scores_cmax_xla(q, kmax, kmin, layer, seq_lens, *, page_size, chunk, scale=None,
                          **tuning):
    """:func:`quest_scores_xla` plus chunk maxima (tuning arguments are ignored); result as
    :func:`quest_scores_cmax_reference`."""
    del tuning
    s = quest_scores_xla(q, kmax, kmin, layer, seq_lens, page_size=page_size, scale=scale)
    return topk.pad_and_chunk_max(s, chunk)


def quest_scores_cmax_pallas(q, kmax, kmin, layer, seq_lens, *, page_size, chunk,
                             block_pages=None, num_warps=4, unmasked=False, eviction_policy=None,
                             interpret=None, scale=None):
    """The scores kernel writing chunk maxima too (result as ``quest_scores_cmax_reference``,
    ``Np_pad`` a multiple of ``max(block_pages, chunk)``). A program covers
    ``max(block_pages, chunk)`` pages (``chunk / block_pages`` blocks in a row when the chunk is
    larger). Tuning as ``quest_scores_pallas``."""
    return _scores_call(q, kmax, kmin, layer, seq_lens, page_size=page_size, chunk=chunk,
                        block_pages=block_pages, num_warps=num_warps,
                        unmasked=unmasked, eviction_policy=eviction_policy,
                        interpret=interpret, scale=scale)


_common.register(OP_CMAX, "pallas")(quest_scores_cmax_pallas)


def quest_scores_with_chunk_max(q, kmax, kmin, layer, seq_lens, *, page_size, chunk,
                                implementation=None, scale=None, **tuning):
    """Quest scores and their chunk maxima (what ``topk.select_top_pages_pallas(chunk_max=)``
    takes). q [B, Hq, D]; kmax/kmin [L, B, Np, H, D]; layer int32 scalar; seq_lens [B];
    ``chunk`` a power of two. Returns (scores [B, H, Np_pad] f32, cmax [B, H, Np_pad // chunk]
    f32): scores -inf past ``ceil(seq_lens / page_size)`` and in padding; ``cmax[..., c]`` = max
    of the scores of pages ``c*chunk .. (c+1)*chunk - 1``, NaN taken as -inf. ``tuning`` goes
    to the Pallas kernel (``quest_scores_cmax_pallas``) and is ignored by the reference."""
    fn = _common.resolve(OP_CMAX, implementation)
    return fn(q, kmax, kmin, jnp.asarray(layer, jnp.int32), seq_lens, page_size=page_size,
              chunk=chunk, scale=scale, **tuning)


@_common.register(OP_UPDATE_CMAX, "xla")
def quest_update_scores_cmax_xla(q, kmax, kmin, layer, seq_lens, k_new, positions, *, page_size,
                                 chunk, scale=None, shift=None, **tuning):
    """:func:`quest_update` then :func:`quest_scores_cmax_xla` on the updated summaries.
    Returns (scores, cmax, kmax, kmin), then the updated ``scale`` where one is given."""
    bounds = quest_update(kmax, kmin, layer, k_new, positions, page_size=page_size, scale=scale,
                          shift=shift)
    out = (*quest_scores_cmax_xla(q, *bounds[:2], layer, seq_lens, page_size=page_size,
                                  chunk=chunk, scale=bounds[2] if scale is not None else None,
                                  **tuning), *bounds)
    return out


@_common.register(OP_UPDATE_CMAX, "pallas")
def quest_update_scores_cmax_pallas(q, kmax, kmin, layer, seq_lens, k_new, positions, *,
                                    page_size, chunk, block_pages=None, num_warps=4,
                                    unmasked=False, eviction_policy=None, interpret=None,
                                    scale=None, shift=None):
    """The scores + chunk-maxima kernel folding the new token into its page's summary first
    (kmax / kmin aliased in place: one launch instead of two scatters and the scores). Result as
    :func:`quest_update_scores_cmax_xla` (scores padded as ``quest_scores_cmax_pallas``)."""
    return _scores_call(q, kmax, kmin, layer, seq_lens, page_size=page_size, chunk=chunk,
                        block_pages=block_pages, num_warps=num_warps,
                        unmasked=unmasked, eviction_policy=eviction_policy,
                        interpret=interpret, update=(k_new, positions), scale=scale,
                        shift=shift)


def quest_update_select(q, kmax, kmin, layer, seq_lens, k_new, positions, *, k, page_size,
                        num_sink_pages, implementation=None, topk_method="auto",
                        cmax_min_pages=ds.CMAX_MIN_PAGES, ordered=True, pieces=1,
                        scale=None, shift=None):
    """One decode step of Quest for one layer: :func:`quest_update` then :func:`quest_select`.

    q [B, Hq, D]; kmax, kmin [L, B, Np, H, D]; layer int32 scalar; seq_lens [B] int32 (tokens
    incl. the new one); k_new [B, H, D], or the token's stacked K/V [B, 2, H, D] (the kernel
    then reads its K in place: no slice kernel); positions [B] int32 (-1 = inactive). Returns (kmax,
    kmin, pages [B, H, k] int32). With the "pallas_cmax" top-k the update runs inside the
    scores kernel (op ``quest_update_scores_cmax``: one launch; summaries updated in place when
    they are donated or loop-carried); the XLA top-k methods take the same kernel's scores
    when the implementation is "pallas". ``topk_method`` / ``cmax_min_pages``: as in
    :func:`quest_select`; ``ordered`` / ``pieces``: as in ``dense_select.select_top_pages``
    (pieces > 1: a candidate set, the top k / pieces of each strided piece of a row).
    ``scale``: quantized bounds (module docstring); the updated scale then follows kmin in the
    result: (kmax, kmin, scale, pages); ``shift``: the keys' (module docstring)."""
    nb = 2 if scale is None else 3
    np_ = kmax.shape[2]
    method = ds.resolve_topk_method(np_, implementation, topk_method,
                                    cmax_min_pages if pieces == 1 else None, k)
    if pieces != 1 and method == "pallas_cmax":
        raise ValueError("the chunk-maxima top-k takes no pieces: use topk_method 'auto', "
                         "'pallas' or an XLA method")
    pallas = _common.implementation_name(implementation) == "pallas"
    if method == "auto" and pieces == 1 and ds.takes_topk_kernel(np_, k, implementation):
        method = "pallas"
    if method == "pallas_cmax" or pallas:
        # the update and the scores in one launch; the full-row and XLA top-k leave the chunk
        # maxima unused
        chunk = topk.default_cmax_chunk(np_, k)
        fn = _common.resolve(OP_UPDATE_CMAX, implementation)
        out = fn(q, kmax, kmin, jnp.asarray(layer, jnp.int32), seq_lens, k_new, positions,
                 page_size=page_size, chunk=chunk, scale=scale, shift=shift)
        scores, cmax, bounds = out[0], out[1], out[2:2 + nb]
        if method == "pallas_cmax":
            pages = topk.select_top_pages_pallas(scores, seq_lens, chunk=chunk, chunk_max=cmax,
                                                 num_pages=np_, k=k, page_size=page_size,
                                                 num_sink_pages=num_sink_pages)
        elif method == "pallas" and pieces == 1:
            pages = topk.select_top_pages_pallas(scores, seq_lens, num_pages=np_, k=k,
                                                 page_size=page_size,
                                                 num_sink_pages=num_sink_pages)
        else:
            pages = ds.select_top_pages(scores, seq_lens, num_pages=np_, k=k,
                                        page_size=page_size, num_sink_pages=num_sink_pages,
                                        method=method, implementation=implementation,
                                        ordered=ordered, pieces=pieces)
        return (*bounds, pages)
    bounds = quest_update(kmax, kmin, layer, k_new, positions, page_size=page_size, scale=scale,
                          shift=shift)
    if not pallas:
        # the XLA scores then read the summaries after the in-place update: fused with it,
        # they would recompute the update from the old arrays, and XLA would copy both
        # whole [L, ...] arrays (every layer of every step) to keep the old ones alive
        bounds = lax.optimization_barrier(bounds)
    pages = quest_select(q, *bounds[:2], layer, seq_lens, k=k, page_size=page_size,
                         num_sink_pages=num_sink_pages, implementation=implementation,
                         topk_method=method, cmax_min_pages=cmax_min_pages, ordered=ordered,
                         pieces=pieces, scale=bounds[2] if nb == 3 else None)
    return (*bounds, pages)


@functools.partial(jax.jit, static_argnames=("k", "page_size", "num_sink_pages",
                                             "implementation", "topk_method", "cmax_min_pages",
                                             "ordered", "pieces"))
def quest_select(q, kmax, kmin, layer, seq_lens, *, k, page_size, num_sink_pages,
                 implementation=None, topk_method="auto", cmax_min_pages=ds.CMAX_MIN_PAGES,
                 ordered=True, pieces=1, scale=None):
    """Quest top-``k`` pages per KV head.

    q: [B, Hq, D] (post-RoPE query); kmax, kmin: [L, B, Np, H, D] (whole, all layers);
    layer: int32 scalar; seq_lens: [B] int32 (tokens incl. the current one).
    Returns [B, H, k] int32 page indices, ascending, -1 padded last; sinks and the last page
    always included (see ``dense_select`` module docstring).
    ``topk_method``: a ``dense_select.TOPK_METHODS`` name. "pallas_cmax": the scores op writes
    chunk maxima too (``quest_scores_with_chunk_max``, ``implementation`` picks its kernel or
    reference) and the Pallas top-k kernel reads only those and the chosen chunks. "auto"
    takes it for rows of ``>= cmax_min_pages`` pages when the implementation is "pallas" (None:
    never; ``dense_select.resolve_topk_method``), else ``select_top_pages``'s auto.
    ``ordered`` / ``pieces``: as in ``dense_select.select_top_pages``. ``scale``: quantized
    bounds' [L, B, Np, H] (module docstring).
    """
    np_ = kmax.shape[2]
    layer = jnp.asarray(layer, jnp.int32)
    sel_kw = dict(num_pages=np_, k=k, page_size=page_size, num_sink_pages=num_sink_pages)
    topk_method = ds.resolve_topk_method(np_, implementation, topk_method,
                                         cmax_min_pages if pieces == 1 else None, k)
    if pieces != 1 and topk_method == "pallas_cmax":
        raise ValueError("the chunk-maxima top-k takes no pieces: use topk_method 'auto', "
                         "'pallas' or an XLA method")
    if topk_method == "pallas_cmax":
        chunk = topk.default_cmax_chunk(np_, k)
        scores, cmax = quest_scores_with_chunk_max(q, kmax, kmin, layer, seq_lens,
                                                   page_size=page_size, chunk=chunk,
                                                   implementation=implementation, scale=scale)
        return topk.select_top_pages_pallas(scores, seq_lens, chunk=chunk, chunk_max=cmax,
                                            **sel_kw)
    scores = _common.resolve(OP, implementation)(q, kmax, kmin, layer, seq_lens,
                                                 page_size=page_size, scale=scale)
    return select_top_pages(scores, seq_lens, method=topk_method,
                            implementation=implementation, ordered=ordered, pieces=pieces,
                            **sel_kw)


def quest_update(kmax, kmin, layer, k_new, positions, *, page_size, scale=None, shift=None):
    """Fold one decode token's keys into the summaries of its page.

    kmax, kmin: [L, B, Np, H, D]; layer: int32 scalar; k_new: [B, H, D] (post-RoPE), or the
    stacked K/V [B, 2, H, D] (K used);
    positions: [B] int32 token position (page ``pos // page_size``). Offset 0 (a page's first
    token) resets the page summary to ``k_new``; other offsets take the elementwise max / min.
    ``positions < 0`` (inactive request) or pages ``>= Np`` change nothing. Returns
    (kmax, kmin), same shapes and dtypes (in place when donated), and the updated ``scale``
    after them for quantized bounds (folded by :func:`requantize_row`; ``shift``: module
    docstring).
    """
    np_ = kmax.shape[2]
    b = positions.shape[0]
    positions = positions.astype(jnp.int32)
    page = jnp.where(positions >= 0, positions // page_size, np_)
    page = jnp.where(page < np_, page, np_)  # np_ = out of range: dropped by the scatter
    first = (positions % page_size == 0)[:, None, None]
    rows = jnp.arange(b)
    layer = jnp.asarray(layer, jnp.int32)
    pc = jnp.minimum(page, np_ - 1)
    kn = k_new if k_new.ndim == 3 else k_new[:, 0]
    if scale is not None:
        kn = kn.astype(jnp.float32)
        if shift is not None:
            kn = kn - shift[layer]
        new_max, new_min, new_scale = requantize_row(
            kmax[layer, rows, pc], kmin[layer, rows, pc], scale[layer, rows, pc], kn,
            first[:, :, 0])
        return (kmax.at[layer, rows, page].set(new_max.astype(jnp.int8), mode="drop"),
                kmin.at[layer, rows, page].set(new_min.astype(jnp.int8), mode="drop"),
                scale.at[layer, rows, page].set(new_scale, mode="drop"))
    kn = kn.astype(kmax.dtype)
    new_max = jnp.where(first, kn, jnp.maximum(kmax[layer, rows, pc], kn))
    new_min = jnp.where(first, kn, jnp.minimum(kmin[layer, rows, pc], kn))
    kmax = kmax.at[layer, rows, page].set(new_max, mode="drop")
    kmin = kmin.at[layer, rows, page].set(new_min, mode="drop")
    return kmax, kmin


def quest_summarize(k, page_size, valid_len):
    """Page summaries for prefill.

    k: [B, T, H, D] post-RoPE keys, T a multiple of ``page_size``; valid_len: [B] int32
    (tokens ``>= valid_len[b]`` are ignored). Returns (kmax, kmin) [B, T // page_size, H, D]
    in k's dtype. A page with no valid token holds -inf / +inf; scorers never read such pages
    (they are past the sequence).
    """
    b, t, h, d = k.shape
    if t % page_size:
        raise ValueError(f"T={t} must be a multiple of page_size={page_size}")
    valid = jnp.arange(t)[None, :] < jnp.asarray(valid_len)[:, None]
    valid = valid.reshape(b, t // page_size, page_size, 1, 1)
    kp = k.reshape(b, t // page_size, page_size, h, d)
    kmax = jnp.where(valid, kp, -jnp.inf).max(axis=2).astype(k.dtype)
    kmin = jnp.where(valid, kp, jnp.inf).min(axis=2).astype(k.dtype)
    return kmax, kmin
