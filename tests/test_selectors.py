"""Page selectors (Quest, indexer, dense): kernels vs references and selection invariants.

CPU: Pallas kernels run in interpret mode; ``test_*_lowers_for_gpu`` lower the Triton kernels
for an abstract H200 (catches non-power-of-two blocks and unsupported ops without a GPU).
``@pytest.mark.gpu`` tests run the real kernels on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowering import lower_for_h200
from jaxkv.kernels import _common
from jaxkv.kernels import dense_select as ds
from jaxkv.kernels import indexer, quest, topk

TOPK_METHODS = ("sort", "rounds", "chunked", "radix", "pallas", "pallas_cmax")


def _rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh seed, printed on failure
    print("seed", seed)
    return np.random.default_rng(seed)


def _n_valid(seq_lens, ps, np_):
    return np.minimum((np.maximum(np.asarray(seq_lens), 0) + ps - 1) // ps, np_)


def check_selection(sel, seq_lens, *, k, page_size, num_sink_pages, num_pages, scores=None,
                    tol=0.0):
    """Assert the selector convention on ``sel`` [B, (H,) k]; if ``scores`` [B, (H,) >= Np]
    (reference, -inf invalid) is given, also that the unforced picks are a top set."""
    sel = np.asarray(sel)
    assert sel.dtype == np.int32 and sel.shape[-1] == k
    nv = _n_valid(seq_lens, page_size, num_pages)
    rows = sel.reshape(sel.shape[0], -1, k)
    sc = None
    if scores is not None:
        sc = np.asarray(scores, np.float64).reshape(sel.shape[0], -1, scores.shape[-1])
    for b in range(rows.shape[0]):
        n = int(nv[b])
        for h in range(rows.shape[1]):
            r = rows[b, h]
            got = r[r >= 0]
            assert np.all(r[len(got):] == -1), f"-1 padding not last: {r}"
            assert np.all(np.diff(got) > 0), f"not ascending / duplicates: {r}"
            assert len(got) == min(k, n), f"row {b},{h}: {len(got)} pages for n_valid={n}: {r}"
            assert np.all(got < n), f"page beyond the sequence: {r} (n_valid={n})"
            forced = set(range(min(num_sink_pages, n))) | ({n - 1} if n else set())
            assert forced <= set(got.tolist()), f"missing forced {forced}: {r}"
            if sc is not None and n > k:
                s = sc[b, h, :n]
                picked = np.zeros(n, bool)
                picked[got] = True
                free = picked.copy()
                free[list(forced)] = False
                if free.any():
                    worst = s[free].min()
                    best_left = s[~picked].max()
                    assert worst >= best_left - tol, (b, h, worst, best_left)


def _poison(meta, seq_lens, layer, ps, page_axis=2):
    """NaN in every layer but ``layer`` and in pages past each sequence (never to be read)."""
    m = np.array(meta, dtype=np.float32)
    keep = np.zeros(m.shape[:3], bool)
    nv = _n_valid(seq_lens, ps, m.shape[page_axis])
    for b, n in enumerate(nv):
        keep[layer, b, :n] = True
    m[~keep] = np.nan
    return m


# ----------------------------------------------------------------------------- Quest


def _quest_inputs(rng, *, L, B, Np, H, G, D, ps, dtype, seq_lens, layer):
    kmax = rng.normal(size=(L, B, Np, H, D)).astype(np.float32)
    kmin = kmax - np.abs(rng.normal(size=kmax.shape)).astype(np.float32)
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    kmax = _poison(kmax, seq_lens, layer, ps)
    kmin = _poison(kmin, seq_lens, layer, ps)
    return (jnp.asarray(q, dtype), jnp.asarray(kmax, dtype), jnp.asarray(kmin, dtype))


def _quest_scale(q, kmax, kmin, layer):
    """Sum of |terms| per score, for an absolute tolerance."""
    b, hq, d = q.shape
    h = kmax.shape[3]
    qg = np.abs(np.asarray(q, np.float32)).reshape(b, h, hq // h, d).sum(2)
    m = np.maximum(np.abs(np.asarray(kmax[layer], np.float32)),
                   np.abs(np.asarray(kmin[layer], np.float32)))
    return np.einsum("bhd,bphd->bhp", qg, np.nan_to_num(m))


QUEST_CASES = [  # G, H, D, dtype, Np, block_pages, unmasked
    (1, 2, 16, jnp.float32, 21, 8, False),
    (3, 3, 32, jnp.bfloat16, 37, 4, True),
    (4, 4, 16, jnp.bfloat16, 16, None, False),
]


@pytest.mark.parametrize("G,H,D,dtype,Np,bp,unmasked", QUEST_CASES)
def test_quest_scores_match_reference(G, H, D, dtype, Np, bp, unmasked):
    rng = _rng()
    ps, L, layer = 4, 2, 1
    seq_lens = np.array([1, rng.integers(2, Np * ps), Np * ps], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=3, Np=Np, H=H, G=G, D=D, ps=ps, dtype=dtype,
                                  seq_lens=seq_lens, layer=layer)
    ref = np.asarray(quest.quest_scores_reference(q, kmax, kmin, jnp.int32(layer),
                                                  jnp.asarray(seq_lens), page_size=ps))
    got = np.asarray(quest.quest_scores_pallas(q, kmax, kmin, jnp.int32(layer),
                                               jnp.asarray(seq_lens), page_size=ps,
                                               block_pages=bp, unmasked=unmasked))
    assert got.shape[:2] == (3, H) and got.shape[2] >= Np
    assert np.all(got[..., Np:] == -np.inf)
    got = got[..., :Np]
    assert np.array_equal(np.isneginf(ref), np.isneginf(got))
    fin = np.isfinite(ref)
    assert fin.any() and np.all(np.isfinite(got[fin]))
    scale = _quest_scale(q, kmax, kmin, layer)
    np.testing.assert_array_less(np.abs(got[fin] - ref[fin]), (2e-5 * scale + 1e-6)[fin])


def quest_scores_numpy(q, kmax, kmin, layer, seq_lens, *, page_size):
    """Quest's page score in float64 loops: for KV head h and page p, the sum over the head's
    query heads and the dimensions of max(q * kmax, q * kmin); -inf past the sequence."""
    q = np.asarray(q, np.float64)
    mx = np.asarray(kmax[layer], np.float64)
    mn = np.asarray(kmin[layer], np.float64)
    b, np_, h, d = mx.shape
    g = q.shape[1] // h
    out = np.full((b, h, np_), -np.inf)
    for bi in range(b):
        for p in range(int(_n_valid(seq_lens[bi], page_size, np_))):
            for hi in range(h):
                qh = q[bi, hi * g:(hi + 1) * g]  # [G, D]
                out[bi, hi, p] = np.maximum(qh * mx[bi, p, hi], qh * mn[bi, p, hi]).sum()
    return out


@pytest.mark.parametrize("G,H,D,dtype,Np,bp,unmasked", QUEST_CASES)
def test_quest_scores_every_implementation_matches_numpy(G, H, D, dtype, Np, bp, unmasked):
    """The literal reference, the registered "xla" linear form and the kernel against the
    numpy rule, NaN-poisoned pages past each sequence included."""
    rng = _rng()
    ps, L, layer = 4, 2, 1
    seq_lens = np.array([0, rng.integers(1, Np * ps), Np * ps], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=3, Np=Np, H=H, G=G, D=D, ps=ps, dtype=dtype,
                                  seq_lens=seq_lens, layer=layer)
    want = quest_scores_numpy(q, kmax, kmin, layer, seq_lens, page_size=ps)
    fin = np.isfinite(want)
    tol = (2e-5 * _quest_scale(q, kmax, kmin, layer) + 1e-6)[fin]
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens))
    for name, fn in (("reference", quest.quest_scores_reference),
                     ("xla", quest.quest_scores_xla),
                     ("pallas", functools.partial(quest.quest_scores_pallas, block_pages=bp,
                                                  unmasked=unmasked))):
        got = np.asarray(fn(*args, page_size=ps))[..., :Np]
        assert np.array_equal(np.isneginf(got), ~fin), name
        np.testing.assert_array_less(np.abs(got[fin] - want[fin]), tol, err_msg=name)


@pytest.mark.parametrize("G,H,D,dtype,Np", [c[:5] for c in QUEST_CASES])
def test_quest_scores_xla_linear_form_matches_literal(G, H, D, dtype, Np):
    """The registered "xla" scores (linear group form) vs the literal formula."""
    rng = _rng()
    ps, L, layer = 4, 2, 0
    seq_lens = np.array([1, rng.integers(2, Np * ps), Np * ps], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=3, Np=Np, H=H, G=G, D=D, ps=ps, dtype=dtype,
                                  seq_lens=seq_lens, layer=layer)
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens))
    ref = np.asarray(quest.quest_scores_reference(*args, page_size=ps))
    got = np.asarray(_common.resolve(quest.OP, "xla")(*args, page_size=ps))
    assert got.shape == ref.shape
    assert np.array_equal(np.isneginf(ref), np.isneginf(got))
    fin = np.isfinite(ref)
    scale = _quest_scale(q, kmax, kmin, layer)
    np.testing.assert_array_less(np.abs(got[fin] - ref[fin]), (2e-5 * scale + 1e-6)[fin])


@pytest.mark.parametrize("impl,method", [("pallas", "auto"), ("xla", "sort"), ("xla", "rounds"),
                                         ("xla", "chunked"), ("pallas", "pallas_cmax")])
def test_quest_select_invariants(impl, method):
    rng = _rng()
    L, Np, H, G, D, ps, k, sinks, layer = 2, 24, 2, 3, 16, 4, 6, 2, 0
    # inactive, one token, k pages exactly, fewer than k pages, full, random
    seq_lens = np.array([0, 1, k * ps, (k - 1) * ps - 3, Np * ps, rng.integers(1, Np * ps)],
                        np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=len(seq_lens), Np=Np, H=H, G=G, D=D, ps=ps,
                                  dtype=jnp.bfloat16, seq_lens=seq_lens, layer=layer)
    sel = quest.quest_select(q, kmax, kmin, layer, jnp.asarray(seq_lens), k=k, page_size=ps,
                             num_sink_pages=sinks, implementation=impl, topk_method=method)
    assert sel.shape == (len(seq_lens), H, k)
    ref = quest.quest_scores_reference(q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens),
                                       page_size=ps)
    tol = 1e-4 * float(np.nanmax(_quest_scale(q, kmax, kmin, layer)))
    check_selection(sel, seq_lens, k=k, page_size=ps, num_sink_pages=sinks, num_pages=Np,
                    scores=ref, tol=tol)
    assert np.all(np.asarray(sel)[0] == -1)


def _chunk_max_np(scores, chunk):
    """Chunk maxima of [B, H, N] scores (N a multiple of chunk), NaN as -inf."""
    s = np.where(np.isnan(scores), -np.inf, scores)
    return s.reshape(s.shape[:-1] + (-1, chunk)).max(-1)


# G, H, D, dtype, Np, chunk, block_pages, unmasked
QUEST_CMAX_CASES = [
    (2, 2, 16, jnp.float32, 37, 4, 8, False),   # chunk < block, Np not a power of two
    (3, 3, 32, jnp.bfloat16, 37, 8, 2, True),   # chunk > block: 4 blocks per program
    (1, 4, 16, jnp.bfloat16, 64, 4, 4, True),   # chunk == block, Np a multiple of it
]


@pytest.mark.parametrize("G,H,D,dtype,Np,chunk,bp,unmasked", QUEST_CMAX_CASES)
def test_quest_scores_cmax_match_reference(G, H, D, dtype, Np, chunk, bp, unmasked):
    """Scores as the reference (NaN poison past each sequence never leaks, also with unmasked
    loads); cmax == chunk max of the kernel's own scores, exactly (NaN in a valid page's
    summary -> NaN score, ignored by cmax); the XLA op's cmax matches too."""
    rng = _rng()
    ps, L, layer, B = 4, 2, 1, 4
    seq_lens = np.array([0, 1, rng.integers(2, Np * ps), Np * ps], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=B, Np=Np, H=H, G=G, D=D, ps=ps, dtype=dtype,
                                  seq_lens=seq_lens, layer=layer)
    kmax = kmax.at[layer, 3, Np // 2, 0, :].set(jnp.nan)  # a valid page with a NaN score
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens))
    got, cm = quest.quest_scores_with_chunk_max(*args, page_size=ps, chunk=chunk,
                                                implementation="pallas", block_pages=bp,
                                                unmasked=unmasked)
    got, cm = np.asarray(got), np.asarray(cm)
    ref_s, ref_c = (np.asarray(x) for x in quest.quest_scores_with_chunk_max(
        *args, page_size=ps, chunk=chunk, implementation="xla"))
    assert got.shape[:2] == (B, H) and got.shape[2] >= Np and got.shape[2] % max(chunk, bp) == 0
    assert cm.shape == (B, H, got.shape[2] // chunk)
    assert ref_s.shape == (B, H, -(-Np // chunk) * chunk) and ref_c.shape[-1] == -(-Np // chunk)
    assert np.all(got[..., Np:] == -np.inf) and np.all(ref_s[..., Np:] == -np.inf)
    np.testing.assert_array_equal(cm, _chunk_max_np(got, chunk))
    n = ref_s.shape[-1]
    assert np.array_equal(np.isneginf(ref_s), np.isneginf(got[..., :n]))
    assert np.array_equal(np.isnan(ref_s), np.isnan(got[..., :n]))
    assert np.isnan(got[3, 0, Np // 2]) and np.isnan(got).sum() == 1
    fin = np.isfinite(ref_s)
    assert np.all(np.isfinite(got[..., :n][fin]))
    scale = _quest_scale(q, kmax, kmin, layer)
    scale = np.pad(scale, ((0, 0), (0, 0), (0, n - Np)))
    np.testing.assert_array_less(np.abs(got[..., :n][fin] - ref_s[fin]), (2e-5 * scale + 1e-6)[fin])
    np.testing.assert_array_equal(ref_c, _chunk_max_np(ref_s, chunk))
    np.testing.assert_array_equal(np.isneginf(ref_c), np.isneginf(cm[..., :ref_c.shape[-1]]))
    assert np.all(cm[..., ref_c.shape[-1]:] == -np.inf)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_quest_select_cmax_exact(impl):
    """quest_select(topk_method="pallas_cmax") == the selection rule on the same scores, bit
    for bit: integer summaries and queries (many exactly tied scores), NaN poison past each
    sequence, seq_len 0, rows shorter than k pages, sinks, B > 1 with different lengths."""
    rng = _rng()
    L, Np, H, G, D, ps, k, sinks, layer = 2, 200, 2, 2, 16, 4, 6, 2, 1
    seq_lens = np.array([0, 3 * ps + 1, Np * ps, rng.integers(k * ps, Np * ps)], np.int32)
    B = len(seq_lens)
    kmax = rng.integers(-1, 2, size=(L, B, Np, H, D)).astype(np.float32)
    kmin = kmax - rng.integers(0, 2, size=kmax.shape)
    q = jnp.asarray(rng.integers(-1, 2, size=(B, H * G, D)), jnp.float32)
    kmax = jnp.asarray(_poison(kmax, seq_lens, layer, ps), jnp.bfloat16)
    kmin = jnp.asarray(_poison(kmin, seq_lens, layer, ps), jnp.bfloat16)
    chunk = topk.default_cmax_chunk(Np, k)
    assert chunk > 1
    scores, _ = quest.quest_scores_with_chunk_max(q, kmax, kmin, layer, jnp.asarray(seq_lens),
                                                  page_size=ps, chunk=chunk,
                                                  implementation=impl)
    kw = dict(k=k, page_size=ps, num_sink_pages=sinks)
    want = select_rule_numpy(np.asarray(scores), seq_lens, num_pages=Np, **kw)
    got = quest.quest_select(q, kmax, kmin, layer, jnp.asarray(seq_lens), implementation=impl,
                             topk_method="pallas_cmax", **kw)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.all(np.asarray(got)[0] == -1)
    check_selection(got, seq_lens, num_pages=Np, **kw)


def test_quest_select_auto_cmax_rule():
    """"auto" takes "pallas_cmax" from ``cmax_min_pages`` pages on (None: never) and only
    with the "pallas" implementation."""
    def jaxpr(np_, impl, cmax_min_pages):
        meta = jnp.zeros((1, 1, np_, 1, 16))
        return str(jax.make_jaxpr(lambda q, m, l: quest.quest_select(
            q, m, m, 0, l, k=4, page_size=1, num_sink_pages=1, implementation=impl,
            cmax_min_pages=cmax_min_pages))(jnp.zeros((1, 1, 16)), meta, jnp.array([np_])))
    assert "quest_scores_cmax" not in jaxpr(33, "pallas", None)
    assert "quest_scores_cmax" in jaxpr(34, "pallas", 32)
    assert "quest_scores_cmax" not in jaxpr(31, "pallas", 32)
    assert "quest_scores_cmax" not in jaxpr(35, "xla", 32)


def test_quest_select_k_larger_than_num_pages():
    rng = _rng()
    Np, ps = 5, 4
    seq_lens = np.array([Np * ps, 7], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=1, B=2, Np=Np, H=1, G=4, D=16, ps=ps,
                                  dtype=jnp.float32, seq_lens=seq_lens, layer=0)
    for impl in ("pallas", "xla"):
        sel = quest.quest_select(q, kmax, kmin, 0, jnp.asarray(seq_lens), k=8, page_size=ps,
                                 num_sink_pages=1, implementation=impl)
        np.testing.assert_array_equal(np.asarray(sel)[:, 0],
                                      [[0, 1, 2, 3, 4, -1, -1, -1], [0, 1, -1, -1, -1, -1, -1, -1]])


@pytest.mark.parametrize("G", [1, 3])
def test_quest_score_bounds_page_max(G):
    """U[h, p] >= max over the page's tokens t of sum_g q_g . k_t (Quest's upper bound)."""
    rng = _rng()
    B, H, D, ps, Np = 2, 2, 16, 8, 6
    T = Np * ps
    valid_len = np.array([T, rng.integers(1, T)], np.int32)
    keys = rng.normal(size=(B, T, H, D)).astype(np.float32)
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    kmax, kmin = quest.quest_summarize(jnp.asarray(keys), ps, jnp.asarray(valid_len))
    s = np.asarray(quest.quest_scores_pallas(jnp.asarray(q), kmax[None], kmin[None],
                                             jnp.int32(0), jnp.asarray(valid_len),
                                             page_size=ps))[..., :Np]
    qk = np.einsum("bhgd,bthd->bht", q.reshape(B, H, G, D), keys)  # group-summed q.k
    nv = _n_valid(valid_len, ps, Np)
    for b in range(B):
        for p in range(nv[b]):
            t = np.arange(p * ps, min((p + 1) * ps, valid_len[b]))
            true_max = qk[b][:, t].max(axis=-1)
            assert np.all(s[b, :, p] >= true_max - 1e-4 * (1 + np.abs(true_max)))
        assert np.all(s[b, :, nv[b]:] == -np.inf)


def test_quest_update_matches_summarize():
    rng = _rng()
    L, B, H, D, ps, Np, layer = 2, 3, 2, 16, 4, 6, 1
    T = Np * ps
    valid_len = np.array([T, 9, 0], np.int32)
    keys = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.bfloat16)
    junk = jnp.full((L, B, Np, H, D), jnp.nan, jnp.bfloat16)

    @jax.jit
    def build(kmax, kmin):
        def body(t, c):
            pos = jnp.where(t < jnp.asarray(valid_len), t, -1)
            return quest.quest_update(*c, jnp.int32(layer), keys[:, t], pos, page_size=ps)
        return jax.lax.fori_loop(0, T, body, (kmax, kmin))

    kmax, kmin = build(junk, junk)
    smax, smin = quest.quest_summarize(keys, ps, jnp.asarray(valid_len))
    nv = _n_valid(valid_len, ps, Np)
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(kmax[layer, b, :nv[b]], np.float32),
                                      np.asarray(smax[b, :nv[b]], np.float32))
        np.testing.assert_array_equal(np.asarray(kmin[layer, b, :nv[b]], np.float32),
                                      np.asarray(smin[b, :nv[b]], np.float32))
        assert np.all(np.isnan(np.asarray(kmax[layer, b, nv[b]:], np.float32)))
    assert np.all(np.isnan(np.asarray(kmax[0], np.float32)))  # other layer untouched
    sm = np.asarray(smax, np.float32)
    assert np.all(np.isneginf(sm[1, nv[1]:])) and np.all(np.isneginf(sm[2]))


def test_quest_update_reset_and_drop():
    """Offset 0 resets stale summaries; positions < 0 and pages >= Np write nothing."""
    L, B, Np, H, D, ps = 1, 3, 2, 1, 16, 4
    kmax = jnp.full((L, B, Np, H, D), 5.0)
    kmin = jnp.full((L, B, Np, H, D), -5.0)
    k_new = jnp.ones((B, H, D))
    kmax, kmin = quest.quest_update(kmax, kmin, 0, k_new, jnp.array([4, -1, Np * ps]),
                                    page_size=ps)
    np.testing.assert_array_equal(np.asarray(kmax[0, 0, 1, 0]), 1.0)
    np.testing.assert_array_equal(np.asarray(kmin[0, 0, 1, 0]), 1.0)
    np.testing.assert_array_equal(np.asarray(kmax[0, 0, 0]), 5.0)
    np.testing.assert_array_equal(np.asarray(kmax[0, 1:]), 5.0)
    np.testing.assert_array_equal(np.asarray(kmin[0, 1:]), -5.0)


UPDATE_CASES = [  # G, H, D, dtype, Np, chunk, block_pages, unmasked
    (2, 2, 16, jnp.bfloat16, 40, 4, None, False),
    (3, 3, 32, jnp.bfloat16, 37, 8, 2, True),   # several blocks per program
    (1, 4, 16, jnp.float32, 64, 4, 4, True),
]


def _update_case(rng, *, L, Np, H, G, D, ps, dtype, layer):
    """A decode step's Quest inputs at four positions: a page's first token (reset),
    mid-page, inactive (-1) and one past the last page (dropped). Returns (positions,
    seq_lens, q, kmax, kmin)."""
    positions = np.array([rng.integers(1, Np) * ps, rng.integers(0, Np * ps - 1) | 1, -1,
                          Np * ps], np.int32)
    seq_lens = np.maximum(positions + 1, 1)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=len(positions), Np=Np, H=H, G=G, D=D, ps=ps,
                                  dtype=dtype, seq_lens=seq_lens, layer=layer)
    return positions, seq_lens, q, kmax, kmin


@pytest.mark.parametrize("G,H,D,dtype,Np,chunk,bp,unmasked", UPDATE_CASES)
def test_quest_update_scores_cmax_kernel_matches_reference(G, H, D, dtype, Np, chunk, bp, unmasked):
    """The fused op (summary update inside the scores kernel) == quest_update then the scores:
    summaries bit for bit (only the new token's row changes: NaN poison elsewhere stays),
    scores to f32 rounding (the kernel forms the query's group sums itself), cmax of its own
    scores. Positions: a page's first token (reset), mid-page, inactive (-1) and one past the
    last page (dropped)."""
    rng = _rng()
    ps, L, layer = 4, 2, 1
    positions, seq_lens, q, kmax, kmin = _update_case(rng, L=L, Np=Np, H=H, G=G, D=D, ps=ps,
                                                      dtype=dtype, layer=layer)
    B = len(positions)
    k_new = jnp.asarray(rng.normal(size=(B, H, D)), dtype)
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens), k_new, jnp.asarray(positions))
    s, cm, mx, mn = quest.quest_update_scores_cmax_pallas(
        *args, page_size=ps, chunk=chunk, block_pages=bp, unmasked=unmasked)
    rs, rc, rmx, rmn = quest.quest_update_scores_cmax_xla(*args, page_size=ps, chunk=chunk)
    for got, want in ((mx, rmx), (mn, rmn)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(mx, np.float32), np.asarray(kmax, np.float32),
                              equal_nan=True)  # something was written
    s, cm, rs = np.asarray(s), np.asarray(cm), np.asarray(rs)
    n = rs.shape[-1]
    assert np.array_equal(np.isneginf(rs), np.isneginf(s[..., :n]))
    fin = np.isfinite(rs)
    scale = _quest_scale(q, rmx, rmn, layer)
    scale = np.pad(scale, ((0, 0), (0, 0), (0, n - Np)))
    np.testing.assert_array_less(np.abs(s[..., :n][fin] - rs[fin]), (2e-5 * scale + 1e-6)[fin])
    np.testing.assert_array_equal(cm, _chunk_max_np(s, chunk))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_quest_update_takes_stacked_kv(impl):
    """k_new given as the token's stacked K/V [B, 2, H, D] (V poisoned with NaN) gives the
    results of k_new = K [B, H, D], bit for bit."""
    rng = _rng()
    ps, L, layer, Np, H, G, D = 4, 2, 1, 40, 2, 3, 16
    positions = np.array([rng.integers(1, Np) * ps, rng.integers(0, Np * ps - 1) | 1, -1], np.int32)
    seq_lens = np.maximum(positions + 1, 1)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=3, Np=Np, H=H, G=G, D=D, ps=ps,
                                  dtype=jnp.bfloat16, seq_lens=seq_lens, layer=layer)
    k_new = jnp.asarray(rng.normal(size=(3, H, D)), jnp.bfloat16)
    kv = jnp.stack([k_new, jnp.full_like(k_new, jnp.nan)], axis=1)
    fn = _common.resolve(quest.OP_UPDATE_CMAX, impl)
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens))
    a = fn(*args, k_new, jnp.asarray(positions), page_size=ps, chunk=8)
    b = fn(*args, kv, jnp.asarray(positions), page_size=ps, chunk=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    sep = quest.quest_update(kmax, kmin, layer, kv, jnp.asarray(positions), page_size=ps)
    for x, y in zip(a[2:], sep):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("impl,method,ordered", [("pallas", "pallas_cmax", True),
                                                  ("xla", "pallas_cmax", True),
                                                  ("pallas", "sort", True),
                                                  ("pallas", "sort", False),
                                                  ("pallas", "chunked", False),
                                                  ("xla", "sort", False)])
def test_quest_update_select_equals_update_then_select(impl, method, ordered):
    """quest_update_select (the update fused into the scores kernel with the Pallas
    implementation) == quest_update + quest_select, bit for bit, over several decode steps
    (integer keys and queries: exact scores, many ties); with ``ordered=False`` the same pages
    in any order, -1 last (the XLA top-k's ties may pick other pages: for "sort" / "chunked"
    the check is the selection rule and the set of values chosen)."""
    rng = _rng()
    L, Np, H, G, D, ps, k, sinks, layer = 2, 64, 2, 3, 16, 4, 6, 1, 1
    lengths = np.array([0, 5 * ps, Np * ps - 3, rng.integers(k * ps, Np * ps - 3)], np.int32)
    B = len(lengths)
    kmax = rng.integers(-2, 3, size=(L, B, Np, H, D)).astype(np.float32)
    kmin = kmax - rng.integers(0, 2, size=kmax.shape)
    kmax = jnp.asarray(_poison(kmax, lengths, layer, ps), jnp.bfloat16)
    kmin = jnp.asarray(_poison(kmin, lengths, layer, ps), jnp.bfloat16)
    fused, plain = (kmax, kmin), (kmax, kmin)
    kw = dict(k=k, page_size=ps, num_sink_pages=sinks)
    for step in range(3):
        pos = np.where(np.arange(B) == 0, -1, lengths + step).astype(np.int32)
        seq = jnp.asarray(np.maximum(pos + 1, 1))
        q = jnp.asarray(rng.integers(-1, 2, size=(B, H * G, D)), jnp.bfloat16)
        k_new = jnp.asarray(rng.integers(-2, 3, size=(B, H, D)), jnp.bfloat16)
        *fused, got = quest.quest_update_select(q, *fused, jnp.int32(layer), seq, k_new,
                                                jnp.asarray(pos), implementation=impl,
                                                topk_method=method, ordered=ordered, **kw)
        plain = quest.quest_update(*plain, jnp.int32(layer), k_new, jnp.asarray(pos), page_size=ps)
        want = quest.quest_select(q, *plain, jnp.int32(layer), seq, implementation="xla",
                                  topk_method="sort", **kw)
        for a, b in zip(fused, plain):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        got = np.asarray(got)
        if not ordered:
            for row in got.reshape(-1, k):  # -1 last, then put in the convention's order
                n = int((row >= 0).sum())
                assert np.all(row[:n] >= 0) and np.all(row[n:] == -1)
            got = np.where(got < 0, 2**31 - 1, got)
            got = np.sort(got, axis=-1)
            got = np.where(got == 2**31 - 1, -1, got).astype(np.int32)
        check_selection(got, np.asarray(seq), num_pages=Np, **kw)
        if method == "pallas_cmax":
            np.testing.assert_array_equal(got, np.asarray(want))
        else:  # same multiset of scores chosen (ties may differ)
            scores = np.asarray(quest.quest_scores_reference(q, *plain, jnp.int32(layer), seq,
                                                             page_size=ps))
            for b_, h_ in np.ndindex(got.shape[:2]):
                pick = lambda r: np.sort([scores[b_, h_, p] if p >= sinks else np.inf  # noqa: E731
                                          for p in r if p >= 0])
                np.testing.assert_array_equal(pick(got[b_, h_]), pick(np.asarray(want)[b_, h_]))


# ----------------------------------------------------------------------------- indexer


def _indexer_inputs(rng, *, L, B, Np, HI, dI, ps, seq_lens, layer, qdtype=jnp.float32):
    pk = _poison(rng.normal(size=(L, B, Np, dI)).astype(np.float32) * ps, seq_lens, layer, ps)
    q = rng.normal(size=(B, HI, dI)).astype(np.float32)
    w = rng.normal(size=(B, HI)).astype(np.float32) * HI ** -0.5
    return jnp.asarray(q, qdtype), jnp.asarray(w), jnp.asarray(pk)


def _indexer_scale(q, w, pk, layer, ps):
    qa = np.abs(np.asarray(q, np.float32))
    ka = np.nan_to_num(np.abs(np.asarray(pk[layer]))) / ps
    return np.einsum("bj,bjd,bpd->bp", np.abs(np.asarray(w)), qa, ka) / np.sqrt(q.shape[-1])


def indexer_scores_numpy(q_idx, weights, page_keys, layer, seq_lens, *, page_size):
    """The indexer's page score in float64 loops: the page's mean key (its key sum over the
    tokens it holds), each indexer head's ReLU'd dot product with it, weighted, summed and
    divided by sqrt(dI); -inf past the sequence."""
    q = np.asarray(q_idx, np.float64)
    w = np.asarray(weights, np.float64)
    sums = np.asarray(page_keys[layer], np.float64)
    b, np_, di = sums.shape
    out = np.full((b, np_), -np.inf)
    for bi in range(b):
        for p in range(int(_n_valid(seq_lens[bi], page_size, np_))):
            mean = sums[bi, p] / min(int(seq_lens[bi]) - p * page_size, page_size)
            out[bi, p] = sum(w[bi, j] * max(float(q[bi, j] @ mean), 0.0)
                             for j in range(q.shape[1])) / np.sqrt(di)
    return out


@pytest.mark.parametrize("HI,dI,Np,bp", [(6, 16, 37, 16), (16, 32, 20, 64)])
def test_indexer_scores_every_implementation_matches_numpy(HI, dI, Np, bp):
    rng = _rng()
    ps, L, layer = 4, 2, 1
    seq_lens = np.array([0, rng.integers(1, Np * ps), Np * ps], np.int32)
    q, w, pk = _indexer_inputs(rng, L=L, B=3, Np=Np, HI=HI, dI=dI, ps=ps, seq_lens=seq_lens,
                               layer=layer, qdtype=jnp.bfloat16)
    want = indexer_scores_numpy(q, w, pk, layer, seq_lens, page_size=ps)
    fin = np.isfinite(want)
    tol = (1e-5 * _indexer_scale(q, w, pk, layer, ps) + 1e-6)[fin]
    args = (q, w, pk, jnp.int32(layer), jnp.asarray(seq_lens))
    for name, fn in (("reference", indexer.indexer_scores_reference),
                     ("pallas", functools.partial(indexer.indexer_scores_pallas,
                                                  block_pages=bp))):
        got = np.asarray(fn(*args, page_size=ps))
        assert got.shape[0] == 3 and got.shape[1] >= Np and np.all(got[:, Np:] == -np.inf)
        got = got[:, :Np]
        assert np.array_equal(np.isneginf(got), ~fin), name
        np.testing.assert_array_less(np.abs(got[fin] - want[fin]), tol, err_msg=name)


def test_indexer_scores_pooled_mean_by_hand():
    """Partial last page: the pooled key divides by the tokens actually in the page."""
    ps, dI = 4, 16
    pk = np.zeros((1, 1, 2, dI), np.float32)
    pk[0, 0, 0, 0] = 8.0   # full page: mean 2
    pk[0, 0, 1, 0] = 3.0   # 1 token (seq_len 5): mean 3
    q = np.zeros((1, 1, dI), np.float32)
    q[0, 0, 0] = 1.0
    w = np.ones((1, 1), np.float32)
    for impl in (indexer.indexer_scores_reference, indexer.indexer_scores_pallas):
        s = np.asarray(impl(jnp.asarray(q), jnp.asarray(w), jnp.asarray(pk), jnp.int32(0),
                            jnp.array([5]), page_size=ps))[0, :2]
        np.testing.assert_allclose(s, np.array([2.0, 3.0]) / 4.0, rtol=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_indexer_select_invariants(impl):
    rng = _rng()
    L, Np, HI, dI, ps, k, sinks, layer = 2, 40, 8, 16, 4, 7, 1, 1
    seq_lens = np.array([0, 1, k * ps - 1, Np * ps, rng.integers(1, Np * ps)], np.int32)
    q, w, pk = _indexer_inputs(rng, L=L, B=len(seq_lens), Np=Np, HI=HI, dI=dI, ps=ps,
                               seq_lens=seq_lens, layer=layer)
    sel = indexer.indexer_select(q, w, pk, jnp.int32(layer), jnp.asarray(seq_lens), k=k,
                                 page_size=ps, num_sink_pages=sinks, implementation=impl)
    assert sel.shape == (len(seq_lens), k)
    ref = indexer.indexer_scores_reference(q, w, pk, jnp.int32(layer), jnp.asarray(seq_lens),
                                           page_size=ps)
    tol = 1e-4 * float(np.max(_indexer_scale(q, w, pk, layer, ps)))
    check_selection(sel, seq_lens, k=k, page_size=ps, num_sink_pages=sinks, num_pages=Np,
                    scores=ref, tol=tol)


def test_indexer_update_matches_summarize():
    rng = _rng()
    L, B, dI, ps, Np, layer = 2, 3, 16, 4, 5, 0
    T = Np * ps
    valid_len = np.array([T, 6, 0], np.int32)
    keys = jnp.asarray(rng.normal(size=(B, T, dI)), jnp.float32)

    @jax.jit
    def build(pk):
        def body(t, pk):
            pos = jnp.where(t < jnp.asarray(valid_len), t, -1)
            return indexer.indexer_update(pk, layer, keys[:, t], pos, page_size=ps)
        return jax.lax.fori_loop(0, T, body, pk)

    pk = build(jnp.full((L, B, Np, dI), jnp.nan))
    summ = np.asarray(indexer.indexer_summarize(keys, ps, jnp.asarray(valid_len)))
    nv = _n_valid(valid_len, ps, Np)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(pk[layer, b, :nv[b]]), summ[b, :nv[b]],
                                   rtol=1e-5, atol=1e-5)
        assert np.all(np.isnan(np.asarray(pk[layer, b, nv[b]:])))
        assert np.all(summ[b, nv[b]:] == 0)
    assert np.all(np.isnan(np.asarray(pk[1])))


def test_indexer_rejects_bad_index_dim():
    z = jnp.zeros
    with pytest.raises(ValueError):
        indexer.indexer_scores_pallas(z((1, 4, 24)), z((1, 4)), z((1, 1, 8, 24)), 0,
                                      jnp.array([3]), page_size=4)


# ----------------------------------------------------------------------------- dense / top-k


def test_dense_select():
    seq_lens = np.array([0, 1, 8, 9, 40], np.int32)
    sel = ds.dense_select(jnp.asarray(seq_lens), num_pages=10, num_kv_heads=3, page_size=4)
    assert sel.shape == (5, 3, 10)
    check_selection(sel, seq_lens, k=10, page_size=4, num_sink_pages=1, num_pages=10)
    np.testing.assert_array_equal(np.asarray(sel)[3, 2], [0, 1, 2, -1, -1, -1, -1, -1, -1, -1])


def test_select_top_pages_rejects_small_k():
    with pytest.raises(ValueError):
        ds.select_top_pages(jnp.zeros((1, 8)), jnp.array([32]), num_pages=8, k=2, page_size=4,
                            num_sink_pages=2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_select_top_pages_property(data):
    """Random shapes, lengths, ties (small-integer scores) and NaN garbage past each sequence."""
    B = data.draw(st.integers(1, 3))
    H = data.draw(st.sampled_from([None, 2]))
    np_ = data.draw(st.sampled_from([1, 5, 16, 37, 200]))  # few shapes: each one compiles
    pad = data.draw(st.sampled_from([0, 3]))
    ps = data.draw(st.sampled_from([1, 4]))
    sinks = data.draw(st.integers(0, 2))
    k = data.draw(st.sampled_from([3, 8, 20, 40]))
    method = data.draw(st.sampled_from(TOPK_METHODS))
    seq_lens = np.array(data.draw(st.lists(st.integers(0, np_ * ps), min_size=B, max_size=B)),
                        np.int32)
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    shape = (B, np_ + pad) if H is None else (B, H, np_ + pad)
    scores = rng.integers(-3, 4, size=shape).astype(np.float32)
    nv = _n_valid(seq_lens, ps, np_)
    junk = np.arange(np_ + pad)[None] >= nv[:, None]
    scores[junk if H is None else np.broadcast_to(junk[:, None], shape)] = np.nan
    sel = ds.select_top_pages(jnp.asarray(scores), jnp.asarray(seq_lens), num_pages=np_, k=k,
                              page_size=ps, num_sink_pages=sinks, method=method)
    ref = np.where(np.isnan(scores), -np.inf, scores)
    check_selection(sel, seq_lens, k=k, page_size=ps, num_sink_pages=sinks, num_pages=np_,
                    scores=ref[..., :np_])


def test_topk_methods_agree_on_distinct_scores():
    rng = _rng()
    B, H, N, k = 2, 3, 3000, 40
    scores = jnp.asarray(rng.permutation(B * H * N).reshape(B, H, N).astype(np.float32))
    seq_lens = jnp.array([N * 4, 1234 * 4 - 1])
    kw = dict(num_pages=N, k=k, page_size=4, num_sink_pages=2)
    a = ds.select_top_pages(scores, seq_lens, method="sort", **kw)
    for method in ("rounds", "chunked", "radix", "auto"):
        b = ds.select_top_pages(scores, seq_lens, method=method, **kw)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Few distinct values: ties everywhere; -0.0 next to +0.0, +-inf, NaN of either sign.
_TIE_POOL = np.array([0.0, -0.0, 1.0, -1.0, 2.5, 1e-30, -3e38, np.inf, -np.inf, np.nan,
                      -np.nan], np.float32)


def _total_order_key(x):
    """numpy keys in lax.top_k's order (-NaN < -inf < -0.0 < +0.0 < +inf < +NaN)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return np.where(u >> 31 == 1, ~u, u | np.uint32(2**31))


@functools.partial(jax.jit, static_argnames=("digits", "histogram"))
def _radix_any_k(x, k, digits=ds.RADIX_DIGITS, histogram="scatter"):
    """``_topk_radix`` with a traced k (picks in the first k columns): one compile a shape."""
    return ds._radix_select(x, k, x.shape[1], digits, histogram)


def _check_radix_picks(x, k, vals, idx):
    """The first k of ``idx`` [R, >= k] are lax.top_k's index set, ``vals`` their values, the
    ties of the k-th value last."""
    x = np.asarray(x)
    vals, idx = np.asarray(vals)[:, :k], np.asarray(idx)[:, :k]
    want = np.asarray(jax.lax.top_k(jnp.asarray(x), k)[1])
    for r in range(x.shape[0]):
        assert sorted(idx[r].tolist()) == sorted(want[r].tolist()), (r, k, x[r], idx[r], want[r])
    np.testing.assert_array_equal(vals.view(np.uint32),
                                  np.take_along_axis(x, idx, 1).view(np.uint32))
    key = _total_order_key(vals)
    tie = key == key.min(axis=1, keepdims=True)
    for r, n_tie in enumerate(tie.sum(axis=1)):
        assert tie[r, k - n_tie:].all(), ("the k-th value's ties not last", vals[r])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_radix_topk_matches_lax_top_k(data):
    """The radix select picks lax.top_k's index set for any k (ties at the k-th value: the
    lowest columns; -0.0 below +0.0) on rows of a few distinct values (+-inf, NaN)."""
    R, N = data.draw(st.sampled_from([(1, 300), (2, 37), (3, 1), (4, 300)]))  # each compiles
    k = data.draw(st.integers(1, N))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    pool = rng.choice(_TIE_POOL, size=data.draw(st.integers(1, len(_TIE_POOL))), replace=False)
    x = rng.choice(pool, size=(R, N)).astype(np.float32)
    if data.draw(st.booleans()):  # some distinct values among the ties
        x = np.where(rng.random((R, N)) < 0.5, rng.normal(size=(R, N)).astype(np.float32), x)
    _check_radix_picks(x, k, *_radix_any_k(jnp.asarray(x), k))


@pytest.mark.parametrize("digits,histogram", [((8, 8, 8, 8), "scatter"), ((4,) * 8, "compare"),
                                              ((16, 16), "scatter")])
def test_radix_topk_digit_splits(digits, histogram):
    """Other digit widths and the compare histogram pick the same set."""
    rng = _rng()
    x = rng.choice(_TIE_POOL, size=(4, 300)).astype(np.float32)
    x[1] = rng.normal(size=300)
    x[2, :290] = -np.inf
    for k in (1, 150, 300):
        _check_radix_picks(x, k, *_radix_any_k(jnp.asarray(x), k, digits, histogram))


def test_select_top_pages_radix_matches_sort():
    """select_top_pages with "radix" == with "sort" (lax.top_k) on tied scores, short and
    inactive sequences and NaN past them: ordered, the same rows; unordered, the same pages
    with the -1 padding last."""
    rng = _rng()
    B, H, N, ps, k = 4, 2, 300, 4, 40
    seq_lens = jnp.array([0, 17 * ps - 1, N * ps, int(rng.integers(1, N * ps))], jnp.int32)
    scores = rng.integers(-2, 3, size=(B, H, N)).astype(np.float32)
    scores[scores == 0] = rng.choice(np.float32([0.0, -0.0]), size=int((scores == 0).sum()))
    junk = np.arange(N)[None, None] >= _n_valid(seq_lens, ps, N)[:, None, None]
    scores[np.broadcast_to(junk, scores.shape)] = np.nan
    kw = dict(num_pages=N, k=k, page_size=ps, num_sink_pages=2)
    args = (jnp.asarray(scores), seq_lens)
    np.testing.assert_array_equal(np.asarray(ds.select_top_pages(*args, method="radix", **kw)),
                                  np.asarray(ds.select_top_pages(*args, method="sort", **kw)))
    got = np.asarray(ds.select_top_pages(*args, method="radix", ordered=False, **kw))
    want = np.asarray(ds.select_top_pages(*args, method="sort", ordered=False, **kw))
    for g, w in zip(got.reshape(-1, k), want.reshape(-1, k)):
        n = int((g >= 0).sum())
        assert np.all(g[:n] >= 0) and np.all(g[n:] == -1), g
        assert sorted(g.tolist()) == sorted(w.tolist())


def select_rule_numpy(scores, seq_lens, *, num_pages, k, page_size, num_sink_pages):
    """The written-down selection rule (``jaxkv.kernels.topk`` docstring) in numpy: forced
    pages +inf, NaN -inf, invalid pages out; stable sort by descending value (ties: lowest
    index first); the first k, ascending, -1 padded. scores [B, (H,) N]."""
    s = np.asarray(scores, np.float32)
    lead, n = s.shape[:-1], s.shape[-1]
    rows = s.reshape(-1, n)
    heads = rows.shape[0] // lead[0]
    nv = _n_valid(seq_lens, page_size, num_pages)
    out = np.full((rows.shape[0], k), -1, np.int32)
    for r in range(rows.shape[0]):
        m = min(int(nv[r // heads]), n)
        v = np.where(np.isnan(rows[r, :m]), -np.inf, rows[r, :m]).astype(np.float64)
        cols = np.arange(m)
        v[(cols < num_sink_pages) | (cols == nv[r // heads] - 1)] = np.inf
        pick = np.sort(np.lexsort((cols, -v))[:k])
        out[r, :len(pick)] = pick
    return out.reshape(lead + (k,))


# shape, num_pages, k, page_size, sinks, chunk, radix_bits, tied scores
PALLAS_TOPK_CASES = [
    ((5, 37), 37, 8, 4, 1, None, 4, False),     # N not a power of two, [B, k] form
    ((5, 37), 35, 8, 4, 1, None, 4, True),      # padding columns past num_pages
    ((2, 3, 64), 64, 8, 1, 2, None, 4, True),   # two stages (chunk 2), [B, H, k] form
    ((3, 2, 512), 500, 16, 2, 1, None, 4, True),  # two stages (chunk 4)
    ((3, 2, 512), 500, 16, 2, 1, 1, 2, True),   # single stage, 2-bit radix
    ((2, 2, 256), 256, 32, 1, 0, 4, 1, False),  # no sinks, 1-bit radix (bisection)
    ((3, 5), 5, 8, 1, 1, None, 4, False),       # k larger than N
    ((2, 2, 2048), 2040, 256, 4, 1, None, None, True),  # large k: default single stage, 2 bits
]


@pytest.mark.parametrize("shape,np_,k,ps,sinks,chunk,bits,tied", PALLAS_TOPK_CASES)
def test_pallas_topk_matches_rule(shape, np_, k, ps, sinks, chunk, bits, tied):
    """Kernel (interpret mode) and jnp reference == numpy rule, exactly, ties included;
    NaN / garbage in invalid and padding columns; seq_lens 0, 1, full, random."""
    rng = _rng()
    B = shape[0]
    if tied:
        scores = rng.integers(-2, 3, size=shape).astype(np.float32)
    else:
        scores = rng.normal(size=shape).astype(np.float32)
    seq_lens = rng.integers(1, np_ * ps + 1, size=B).astype(np.int32)
    seq_lens[:3] = [0, np_ * ps, 1][:B]
    nv = _n_valid(seq_lens, ps, np_)
    junk = np.arange(shape[-1])[None] >= nv[:, None]
    junk = junk if len(shape) == 2 else np.broadcast_to(junk[:, None], shape)
    scores[junk] = rng.choice([np.nan, np.inf, 1e30], size=int(junk.sum()))
    kw = dict(num_pages=np_, k=k, page_size=ps, num_sink_pages=sinks)
    want = select_rule_numpy(scores, seq_lens, **kw)
    args = (jnp.asarray(scores), jnp.asarray(seq_lens))
    got = topk.select_top_pages_pallas(*args, chunk=chunk, radix_bits=bits, **kw)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(topk.select_top_pages_reference(*args, **kw)), want)
    check_selection(got, seq_lens, **kw, scores=np.where(junk, -np.inf, scores)[..., :np_])
    assert np.all(np.asarray(got)[0] == -1)  # seq_len 0


# shape, num_pages, k, page_size, sinks, chunk
PALLAS_TOPK_CMAX_CASES = [
    ((3, 2, 64), 64, 8, 1, 2, 2),     # [B, H, k] form
    ((4, 37), 35, 4, 4, 1, 4),        # N not a power of two, padding columns, [B, k] form
    ((3, 2, 200), 200, 8, 2, 0, 8),   # no sinks, 25 chunks (padded to 32)
    ((4, 24), 24, 6, 4, 2, 16),       # 2 chunks: fewer than k, all chosen
]


@pytest.mark.parametrize("shape,np_,k,ps,sinks,chunk", PALLAS_TOPK_CMAX_CASES)
def test_pallas_topk_cmax_matches_rule(shape, np_, k, ps, sinks, chunk):
    """Top-k from chunk maxima == the numpy rule, exactly: small-integer scores (ties), NaN in
    valid pages' scores, garbage past each sequence (and in the maxima of chunks without a
    valid page), seq_lens 0 / shorter than k pages / full / random."""
    rng = _rng()
    B = shape[0]
    scores = rng.integers(-2, 3, size=shape).astype(np.float32)
    scores[rng.random(shape) < 0.1] = np.nan
    seq_lens = rng.integers(1, np_ * ps + 1, size=B).astype(np.int32)
    seq_lens[:3] = [0, (k - 2) * ps - 1, np_ * ps]
    nv = _n_valid(seq_lens, ps, np_)
    junk = np.arange(shape[-1])[None] >= nv[:, None]
    junk = junk if len(shape) == 2 else np.broadcast_to(junk[:, None], shape)
    scores[junk] = rng.choice([np.nan, np.inf, 1e30], size=int(junk.sum()))
    kw = dict(num_pages=np_, k=k, page_size=ps, num_sink_pages=sinks)
    cm = np.array(topk.chunk_max(jnp.asarray(scores), jnp.asarray(seq_lens), num_pages=np_,
                                 page_size=ps, chunk=chunk))
    assert cm.shape == shape[:-1] + (-(-shape[-1] // chunk),)
    empty = np.arange(cm.shape[-1])[None] * chunk >= nv[:, None]
    empty = empty if len(shape) == 2 else np.broadcast_to(empty[:, None], cm.shape)
    cm[empty] = rng.choice([np.nan, np.inf], size=int(empty.sum()))  # never used
    want = select_rule_numpy(scores, seq_lens, **kw)
    got = topk.select_top_pages_pallas(jnp.asarray(scores), jnp.asarray(seq_lens),
                                       chunk_max=jnp.asarray(cm), **kw)  # chunk inferred
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.all(np.asarray(got)[0] == -1)


def test_pallas_topk_cmax_rejects_bad_shape():
    with pytest.raises(ValueError):
        topk.select_top_pages_pallas(jnp.zeros((1, 64)), jnp.array([64]), num_pages=64, k=4,
                                     page_size=1, num_sink_pages=1, chunk=4,
                                     chunk_max=jnp.zeros((1, 8)))


def test_pallas_topk_ties_lowest_index_by_hand():
    """All scores equal: sinks, the last page, then the lowest indices; -0.0 ties +0.0."""
    scores = jnp.asarray(np.array([[1.0] * 16, [0.0, -0.0] * 8], np.float32))
    got = ds.select_top_pages(scores, jnp.array([64, 40]), num_pages=16, k=5, page_size=4,
                              num_sink_pages=1, method="pallas")
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 2, 3, 15], [0, 1, 2, 3, 9]])


def test_pallas_topk_matches_sort_on_distinct_scores():
    """Distinct scores: the same selected set as lax.top_k ("sort"), N not a power of two."""
    rng = _rng()
    B, H, N, k = 2, 3, 300, 16
    scores = rng.permutation(B * H * N).reshape(B, H, N).astype(np.float32) - B * H * N / 2
    seq_lens = jnp.array([N * 4, 123 * 4 - 1])
    kw = dict(num_pages=N, k=k, page_size=4, num_sink_pages=2)
    a = ds.select_top_pages(jnp.asarray(scores), seq_lens, method="sort", **kw)
    b = ds.select_top_pages(jnp.asarray(scores), seq_lens, method="pallas", **kw)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("env", [None, "pallas", "xla"])
def test_auto_resolution(monkeypatch, env):
    """"auto" is the Pallas kernel on the GPU (or with JAXKV_IMPL=pallas), else XLA."""
    from jaxkv.kernels import _common
    if env is None:
        monkeypatch.delenv("JAXKV_IMPL", raising=False)
    else:
        monkeypatch.setenv("JAXKV_IMPL", env)
    n = {None: 23, "pallas": 22, "xla": 21}[env]  # a new static argument: traced again
    kw = dict(num_pages=n, k=4, page_size=1, num_sink_pages=1)
    jaxpr = str(jax.make_jaxpr(lambda s, l: ds.select_top_pages(s, l, method="auto", **kw))(
        jnp.zeros((1, n)), jnp.array([n])))
    assert ("pallas_call" in jaxpr) == (env == "pallas" or (env is None and _common.on_gpu()))


# ----------------------------------------------------------------------------- GPU lowering


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("L,B,Np,H,G,D", [(4, 1, 16384, 8, 4, 128), (2, 3, 21, 3, 3, 16)])
def test_quest_lowers_for_gpu(no_interpret, L, B, Np, H, G, D):
    def loop(q, kmax, kmin, seq_lens):
        def body(i, acc):
            sel = quest.quest_select(q, kmax, kmin, i % L, seq_lens, k=8, page_size=64,
                                     num_sink_pages=1, implementation="pallas",
                                     topk_method="chunked")  # one Triton call: the scores
            return acc + sel.sum()
        return jax.lax.fori_loop(0, 2 * L, body, jnp.int32(0))
    meta = S((L, B, Np, H, D), jnp.bfloat16)
    txt = lower_for_h200(loop, S((B, H * G, D), jnp.bfloat16), meta, meta, S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.while" in txt


@pytest.mark.parametrize("L,B,Np,HI,dI", [(4, 1, 16384, 64, 128), (2, 3, 37, 6, 16)])
def test_indexer_lowers_for_gpu(no_interpret, L, B, Np, HI, dI):
    txts = [lower_for_h200(
        functools.partial(indexer.indexer_select, k=8, page_size=64, num_sink_pages=1,
                          implementation="pallas", topk_method=method),
        S((B, HI, dI), jnp.bfloat16), S((B, HI), jnp.float32), S((L, B, Np, dI), jnp.float32),
        S((), jnp.int32), S((B,), jnp.int32)) for method in ("chunked", "pallas")]
    assert [t.count("__gpu$xla.gpu.triton") for t in txts] == [1, 2]


@pytest.mark.parametrize("L,B,Np,H,G,D", [(4, 1, 16384, 8, 4, 128), (2, 3, 21, 3, 3, 16)])
def test_quest_pallas_topk_lowers_for_gpu(no_interpret, L, B, Np, H, G, D):
    """Scores kernel + top-k kernel: two Triton calls and nothing else of note (the scores
    kernel forms the query's group sums: no reduction before it)."""
    fn = functools.partial(quest.quest_select, k=32, page_size=64, num_sink_pages=1,
                           implementation="pallas", topk_method="pallas")
    meta = S((L, B, Np, H, D), jnp.bfloat16)
    txt = lower_for_h200(fn, S((B, H * G, D), jnp.bfloat16), meta, meta, S((), jnp.int32),
                          S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 2
    assert "stablehlo.sort" not in txt and "TopK" not in txt
    assert "stablehlo.reduce" not in txt


@pytest.mark.parametrize("shape,k,chunk,bits", [((8, 8, 2048), 32, None, 4),
                                                ((1, 8, 16384), 32, 1, 4),
                                                ((3, 37), 8, None, 2), ((2, 5), 8, None, 1)])
def test_pallas_topk_lowers_for_gpu(shape, k, chunk, bits):
    fn = functools.partial(topk.select_top_pages_pallas, num_pages=shape[-1] - 1, k=k,
                           page_size=64, num_sink_pages=1, chunk=chunk, radix_bits=bits,
                           interpret=False)
    txt = lower_for_h200(fn, S(shape, jnp.float32), S((shape[0],), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("shape,k,chunk", [((8, 2, 2048), 32, 8), ((1, 8, 16384), 32, 16),
                                           ((3, 37), 6, 4)])
def test_pallas_topk_cmax_lowers_for_gpu(shape, k, chunk):
    """The chunk-maxima top-k lowers to one Triton call (Qwen-like 128k B=8, 8B-like 1M B=1,
    a small non-power-of-two k)."""
    fn = functools.partial(topk.select_top_pages_pallas, num_pages=shape[-1] - 1, k=k,
                           page_size=64, num_sink_pages=1, chunk=chunk, interpret=False)
    cm = S(shape[:-1] + (-(-shape[-1] // chunk),), jnp.float32)
    txt = lower_for_h200(lambda s, n, c: fn(s, n, chunk_max=c), S(shape, jnp.float32),
                         S((shape[0],), jnp.int32), cm)
    assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("unmasked,chunk,bp", [(False, 16, None), (True, 16, None),
                                               (True, 8, 16)])
def test_quest_cmax_lowers_for_gpu(no_interpret, unmasked, chunk, bp):
    """pallas_cmax at 16k pages: scores+cmax kernel and top-k kernel, no XLA sort / top-k."""
    meta = S((4, 1, 16384, 8, 128), jnp.bfloat16)
    args = (S((1, 32, 128), jnp.bfloat16), meta, meta, S((), jnp.int32), S((1,), jnp.int32))
    if bp is None:
        fn = functools.partial(quest.quest_select, k=32 + unmasked, page_size=64,
                               num_sink_pages=1, implementation="pallas",
                               topk_method="pallas_cmax")
        txt = lower_for_h200(fn, *args)
        assert txt.count("__gpu$xla.gpu.triton") == 2
        assert "stablehlo.sort" not in txt and "TopK" not in txt
    else:
        fn = functools.partial(quest.quest_scores_cmax_pallas, page_size=64, chunk=chunk,
                               block_pages=bp, unmasked=unmasked, eviction_policy="evict_first")
        assert lower_for_h200(fn, *args).count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("L,B,Np,H,G,D", [(4, 8, 2058, 2, 6, 128), (4, 1, 16384, 8, 4, 128)])
def test_quest_update_select_lowers_for_gpu(no_interpret, L, B, Np, H, G, D):
    """The fused update + scores kernel and the top-k kernel: two Triton calls, no scatter,
    sort or top-k left in XLA (Qwen-like 128k B=8 and 8B-like 1M B=1 shapes)."""
    fn = functools.partial(quest.quest_update_select, k=32, page_size=64, num_sink_pages=1,
                           implementation="pallas")
    meta = S((L, B, Np, H, D), jnp.bfloat16)
    txt = lower_for_h200(fn, S((B, H * G, D), jnp.bfloat16), meta, meta, S((), jnp.int32),
                         S((B,), jnp.int32), S((B, H, D), jnp.bfloat16), S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 2
    assert "stablehlo.sort" not in txt and "TopK" not in txt and "scatter" not in txt


@pytest.mark.parametrize("B,H,Np,k", [(8, 2, 2048, 256), (1, 2, 16384, 128)])
def test_radix_topk_lowers_for_gpu(B, H, Np, k):
    """The first stage with the radix top-k (Qwen-like 128k B=8, 1M B=1): no sort, top-k or
    loop; a scatter per digit and one to place the picks."""
    fn = functools.partial(ds.select_top_pages, num_pages=Np, k=k, page_size=64,
                           num_sink_pages=1, method="radix", ordered=False)
    txt = lower_for_h200(fn, S((B, H, Np), jnp.float32), S((B,), jnp.int32))
    assert "stablehlo.sort" not in txt and "top_k" not in txt and "stablehlo.while" not in txt
    assert txt.count('"stablehlo.scatter"') == len(ds.RADIX_DIGITS) + 1


def test_rescore_first_stage_lowers_for_gpu(no_interpret):
    """The two-stage selector's first stage (256 candidates of 2058 pages, XLA's top-k, not
    ordered): one Triton call (update + scores), one top-k, no scatter and no second sort."""
    L, B, Np, H, G, D = 4, 8, 2058, 2, 6, 128
    fn = functools.partial(quest.quest_update_select, k=256, page_size=64, num_sink_pages=1,
                           implementation="pallas", topk_method="sort", ordered=False)
    meta = S((L, B, Np, H, D), jnp.bfloat16)
    txt = lower_for_h200(fn, S((B, H * G, D), jnp.bfloat16), meta, meta, S((), jnp.int32),
                         S((B,), jnp.int32), S((B, H, D), jnp.bfloat16), S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "scatter" not in txt
    assert txt.count("chlo.top_k") == 1 and "stablehlo.sort" not in txt


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("G,H", [(4, 8), (3, 3)])
def test_gpu_quest_kernel(G, H):
    rng = _rng()
    L, B, Np, D, ps, k, layer = 3, 2, 2000, 128, 64, 32, 2
    seq_lens = np.array([Np * ps, rng.integers(1, Np * ps)], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=B, Np=Np, H=H, G=G, D=D, ps=ps,
                                  dtype=jnp.bfloat16, seq_lens=seq_lens, layer=layer)
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens))
    ref = np.asarray(quest.quest_scores_reference(*args, page_size=ps))
    fin = np.isfinite(ref)
    scale = _quest_scale(q, kmax, kmin, layer)
    got = np.asarray(quest.quest_scores_pallas(*args, page_size=ps))[..., :Np]
    assert np.array_equal(np.isneginf(ref), np.isneginf(got))
    np.testing.assert_array_less(np.abs(got[fin] - ref[fin]), (1e-4 * scale + 1e-5)[fin])
    for method in TOPK_METHODS:
        sel = quest.quest_select(q, kmax, kmin, layer, jnp.asarray(seq_lens), k=k, page_size=ps,
                                 num_sink_pages=2, implementation="pallas", topk_method=method)
        check_selection(sel, seq_lens, k=k, page_size=ps, num_sink_pages=2, num_pages=Np,
                        scores=ref, tol=1e-3 * float(np.nanmax(scale)))


@pytest.mark.gpu
def test_gpu_indexer_kernel():
    rng = _rng()
    L, B, Np, HI, dI, ps, k, layer = 2, 2, 3000, 64, 128, 64, 32, 1
    seq_lens = np.array([Np * ps, rng.integers(1, Np * ps)], np.int32)
    q, w, pk = _indexer_inputs(rng, L=L, B=B, Np=Np, HI=HI, dI=dI, ps=ps, seq_lens=seq_lens,
                               layer=layer, qdtype=jnp.bfloat16)
    args = (q, w, pk, jnp.int32(layer), jnp.asarray(seq_lens))
    ref = np.asarray(indexer.indexer_scores_reference(*args, page_size=ps))
    got = np.asarray(indexer.indexer_scores_pallas(*args, page_size=ps))[:, :Np]
    assert np.array_equal(np.isneginf(ref), np.isneginf(got))
    fin = np.isfinite(ref)
    scale = _indexer_scale(q, w, pk, layer, ps)
    np.testing.assert_array_less(np.abs(got[fin] - ref[fin]), (1e-4 * scale + 1e-5)[fin])
    sel = indexer.indexer_select(*args, k=k, page_size=ps, num_sink_pages=1,
                                 implementation="pallas")
    check_selection(sel, seq_lens, k=k, page_size=ps, num_sink_pages=1, num_pages=Np,
                    scores=ref, tol=1e-3 * float(np.max(scale)))


@pytest.mark.gpu
def test_gpu_quest_in_loop_traced_layer():
    """Inside a jitted fori_loop the layer index is traced; every layer's selection matches."""
    rng = _rng()
    L, B, Np, H, G, D, ps, k = 4, 1, 1024, 8, 4, 128, 64, 16
    seq_lens = np.array([Np * ps - 5], np.int32)
    q = jnp.asarray(rng.normal(size=(B, H * G, D)), jnp.bfloat16)
    kmax = jnp.asarray(rng.normal(size=(L, B, Np, H, D)), jnp.bfloat16)
    kmin = kmax - jnp.asarray(np.abs(rng.normal(size=kmax.shape)), jnp.bfloat16)

    @jax.jit
    def loop(q, kmax, kmin, seq_lens):
        def body(i, out):
            sel = quest.quest_select(q, kmax, kmin, i, seq_lens, k=k, page_size=ps,
                                     num_sink_pages=1, implementation="pallas")
            return out.at[i].set(sel)
        return jax.lax.fori_loop(0, L, body, jnp.zeros((L, B, H, k), jnp.int32))

    out = np.asarray(loop(q, kmax, kmin, jnp.asarray(seq_lens)))
    for layer in range(L):
        ref = quest.quest_scores_reference(q, kmax, kmin, jnp.int32(layer),
                                           jnp.asarray(seq_lens), page_size=ps)
        check_selection(out[layer], seq_lens, k=k, page_size=ps, num_sink_pages=1,
                        num_pages=Np, scores=ref, tol=1e-2)


def _tied_rows(B, H, N, ps, shortest):
    """A first stage's inputs at decode sizes: (seq_lens [B], the first a full row, the others
    from ``shortest`` of it up; scores [B, H, N] of small integers (ties), NaN past each
    sequence)."""
    rng = _rng()
    seq_lens = rng.integers(int(N * ps * shortest), N * ps, size=B).astype(np.int32)
    seq_lens[0] = N * ps
    nv = _n_valid(seq_lens, ps, N)
    junk = np.broadcast_to((np.arange(N)[None] >= nv[:, None])[:, None], (B, H, N))
    tied = np.where(junk, np.nan, rng.integers(-50, 50, size=(B, H, N)).astype(np.float32))
    return seq_lens, tied


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,N,k", [(8, 2, 2048, 256), (1, 8, 8192, 1024),
                                     (8, 2, 8212, 512)])
def test_gpu_pallas_topk_large_k(B, H, N, k):
    """The full-row kernel's single stage (a two-stage selector's first stage) on the GPU:
    == the rule, ties included, NaN past the sequence."""
    ps = 64
    seq_lens, tied = _tied_rows(B, H, N, ps, 1 / 2)
    kw = dict(num_pages=N, k=k, page_size=ps, num_sink_pages=1)
    got = np.asarray(ds.select_top_pages(jnp.asarray(tied), jnp.asarray(seq_lens),
                                         method="pallas", **kw))
    np.testing.assert_array_equal(got, select_rule_numpy(tied, seq_lens, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,N,k,S", [(8, 2, 8212, 512, 8), (8, 2, 8212, 512, 16),
                                       (1, 8, 8192, 512, 8), (2, 8, 2048, 128, 4),
                                       (1, 2, 65552, 512, 8)])
def test_gpu_select_top_pages_pieces(B, H, N, k, S):
    """The first stage in strided pieces (``pieces``) with the pieces kernel on the GPU at the
    128k shapes and Qwen-like B=1's 1M (pieces of 8,194 columns): == the numpy rule, ties (small integers) and NaN past the sequence included,
    and place for place equal to its pure-jnp reference."""
    ps = 16
    seq_lens, tied = _tied_rows(B, H, N, ps, 1 / 8)
    kw = dict(num_pages=N, k=k, page_size=ps, num_sink_pages=1)
    x, lens = jnp.asarray(tied), jnp.asarray(seq_lens)
    got = np.asarray(ds.select_top_pages(x, lens, method="pallas", ordered=False, pieces=S,
                                         **kw))
    want = _pieces_reference(tied, seq_lens, pieces=S, **kw)
    for (b, h), pages in want.items():
        row = got[b, h][got[b, h] >= 0]
        assert len(row) == len(pages) and set(row.tolist()) == pages, (b, h)
    np.testing.assert_array_equal(got, np.asarray(topk.select_top_pieces_reference(
        x, lens, pieces=S, **kw)))


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,N", [(1, 8, 2048), (8, 8, 2048), (1, 8, 16384), (8, 8, 16384)])
def test_gpu_pallas_topk(B, H, N):
    """Real kernel at decode sizes: == "sort" on distinct scores, == the rule with ties."""
    rng = _rng()
    k, ps = 32, 64
    seq_lens = np.array([N * ps, 1, 0, 31 * ps, 33 * ps + 5, N * ps - 100, 7777, N * 10][:B],
                        np.int32)
    kw = dict(num_pages=N - 3, k=k, page_size=ps, num_sink_pages=2)
    nv = _n_valid(seq_lens, ps, N - 3)
    junk = np.broadcast_to((np.arange(N)[None] >= nv[:, None])[:, None], (B, H, N))
    distinct = rng.permutation(B * H * N).reshape(B, H, N).astype(np.float32)
    tied = rng.integers(-3, 4, size=(B, H, N)).astype(np.float32)
    for has_ties, scores in ((False, distinct), (True, tied)):
        scores = np.where(junk, np.nan, scores)
        args = (jnp.asarray(scores), jnp.asarray(seq_lens))
        got = np.asarray(ds.select_top_pages(*args, method="pallas", **kw))
        np.testing.assert_array_equal(got, select_rule_numpy(scores, seq_lens, **kw))
        if not has_ties:  # XLA's methods break ties their own way
            want = np.asarray(ds.select_top_pages(*args, method="sort", **kw))
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(  # auto: the kernel up to 4096 pages, chunked above
                np.asarray(ds.select_top_pages(*args, method="auto", **kw)), got)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,N", [(8, 2, 2048), (2, 8, 16384)])
def test_gpu_pallas_topk_cmax(B, H, N):
    """Compiled chunk-maxima top-k == the rule: distinct scores, and small integers with NaN
    (ties); seq_lens full, 1, 0, shorter than k pages, random."""
    rng = _rng()
    k, ps, sinks = 32, 64, 1
    chunk = topk.default_cmax_chunk(N, k)
    seq_lens = np.array([N * ps, 1, 0, 20 * ps + 3] + list(rng.integers(1, N * ps, size=4)),
                        np.int32)[:B]
    kw = dict(num_pages=N, k=k, page_size=ps, num_sink_pages=sinks)
    lens = jnp.asarray(seq_lens)
    distinct = rng.permutation(B * H * N).reshape(B, H, N).astype(np.float32)
    tied = rng.integers(-3, 4, size=(B, H, N)).astype(np.float32)
    tied[rng.random(tied.shape) < 0.01] = np.nan
    for scores in (distinct, tied):
        cm = topk.chunk_max(jnp.asarray(scores), lens, num_pages=N, page_size=ps, chunk=chunk)
        got = topk.select_top_pages_pallas(jnp.asarray(scores), lens, chunk=chunk, chunk_max=cm,
                                           **kw)
        np.testing.assert_array_equal(np.asarray(got), select_rule_numpy(scores, seq_lens, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_quest_cmax_16k(B):
    """16384 pages (1M tokens), compiled Triton: scores + cmax kernel (every load mode) vs the
    reference and its own chunk max; quest_select("pallas_cmax") == the rule on those scores;
    the cmax top-k == the rule on tied scores."""
    rng = _rng()
    L, Np, H, G, D, ps, k, layer, sinks = 2, 16384, 8, 4, 128, 64, 32, 1, 1
    seq_lens = np.array([Np * ps, rng.integers(1, Np * ps)][:B], np.int32)
    q, kmax, kmin = _quest_inputs(rng, L=L, B=B, Np=Np, H=H, G=G, D=D, ps=ps,
                                  dtype=jnp.bfloat16, seq_lens=seq_lens, layer=layer)
    args = (q, kmax, kmin, jnp.int32(layer), jnp.asarray(seq_lens))
    ref = np.asarray(quest.quest_scores_reference(*args, page_size=ps))
    scale = _quest_scale(q, kmax, kmin, layer)
    fin = np.isfinite(ref)
    chunk = topk.default_cmax_chunk(Np, k)
    for tuning in ({}, dict(unmasked=True), dict(unmasked=True, block_pages=16),
                   dict(unmasked=False, block_pages=32, num_warps=8)):
        s, cm = (np.asarray(x) for x in quest.quest_scores_with_chunk_max(
            *args, page_size=ps, chunk=chunk, implementation="pallas", **tuning))
        np.testing.assert_array_equal(cm, _chunk_max_np(s, chunk))
        s = s[..., :Np]
        assert np.array_equal(np.isneginf(ref), np.isneginf(s)), tuning
        np.testing.assert_array_less(np.abs(s[fin] - ref[fin]), (1e-4 * scale + 1e-5)[fin])
    kw = dict(k=k, page_size=ps, num_sink_pages=sinks)
    s, _ = quest.quest_scores_with_chunk_max(*args, page_size=ps, chunk=chunk,
                                             implementation="pallas")
    got = quest.quest_select(*args, topk_method="pallas_cmax", implementation="pallas", **kw)
    np.testing.assert_array_equal(np.asarray(got), select_rule_numpy(
        np.asarray(s), seq_lens, num_pages=Np, **kw))
    tied = rng.integers(-3, 4, size=(B, H, Np)).astype(np.float32)
    tied[rng.random(tied.shape) < 0.01] = np.nan
    lens = jnp.asarray(seq_lens)
    cm = topk.chunk_max(jnp.asarray(tied), lens, num_pages=Np, page_size=ps, chunk=chunk)
    got = topk.select_top_pages_pallas(jnp.asarray(tied), lens, num_pages=Np, chunk=chunk,
                                       chunk_max=cm, **kw)
    np.testing.assert_array_equal(np.asarray(got),
                                  select_rule_numpy(tied, seq_lens, num_pages=Np, **kw))


def test_full_row_topk_takes_a_single_stage_for_large_k():
    """The full-row kernel's defaults: Quest's budgets stay two-stage with 4-bit passes; a
    two-stage selector's first stage (k of 128-1024) takes the single stage with 2-bit
    passes, and so fits Triton's block cap where the chunk-maxima kernel does not."""
    assert topk._full_row_defaults(2048, 32, None, None) == (8, 4)
    assert topk._full_row_defaults(16384, 32, None, None) == (16, 4)
    assert topk._full_row_defaults(2048, 128, None, None) == (1, 2)
    assert topk._full_row_defaults(8192, 1024, None, None) == (1, 2)
    assert topk._full_row_defaults(512, 128, None, None) == (2, 4)  # [128, 256]: two-stage
    assert topk._full_row_defaults(2048, 256, 2, 1) == (2, 1)  # the caller's values stay
    assert topk.fits_full_row(8192, 1024) and not topk.fits(8192, 1024)


@pytest.mark.parametrize("B,Np,H,k", [(8, 2058, 2, 256), (1, 8192, 8, 1024)])
def test_rescore_first_stage_kernel_lowers_for_gpu(no_interpret, B, Np, H, k):
    """The first stage with the full-row top-k kernel (the two-stage selectors' GPU default):
    the update + scores kernel and the top-k kernel, nothing sorted, no top-k or scatter in
    XLA (Qwen-like 128k B=8 with 256 candidates, 8B-like with 1024 of 8192 pages)."""
    fn = functools.partial(quest.quest_update_select, k=k, page_size=64, num_sink_pages=1,
                           implementation="pallas", topk_method="pallas", ordered=False)
    meta = S((4, B, Np, H, 128), jnp.bfloat16)
    txt = lower_for_h200(fn, S((B, H * 4, 128), jnp.bfloat16), meta, meta, S((), jnp.int32),
                         S((B,), jnp.int32), S((B, H, 128), jnp.bfloat16), S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 2 and "scatter" not in txt
    assert "chlo.top_k" not in txt and "stablehlo.sort" not in txt


def test_rescore_first_stage_method():
    """The two-stage selector's first stage: the full-row kernel with the Pallas
    implementation for rows of up to 4096 entries (pages, or blocks of pages), and of 8192
    with 16 rows or more (requests x KV heads), XLA's top-k otherwise; a tuning's method
    wins. (24 candidates, 8x the budget: ``None``'s floor of 8192 tokens would make them
    2048 at these 4-token pages.)"""
    from jaxkv import CacheConfig, Tuning, engine
    from jaxkv.models import configs
    cfg = configs.tiny()
    for impl, tuning, ctx, r, want in (("pallas", Tuning(), 256, 1, "pallas"),
                                       ("xla", Tuning(), 256, 1, "sort"),
                                       ("pallas", Tuning(topk_method="sort"), 256, 1, "sort"),
                                       ("pallas", Tuning(), 4 * 8192, 1, "sort"),  # 8192 pages
                                       ("pallas", Tuning(), 4 * 8192, 4, "pallas")):  # 2048 blocks
        cache = CacheConfig(mode="resident", selector="quest_rescore8", page_size=4,
                            selected_pages=3, candidate_pages=24, implementation=impl,
                            tuning=tuning, max_context=ctx, candidate_block=r)
        plan = engine.Plan(model=cfg, cache=cache, batch=1, prompt_len=200, max_context=ctx,
                           num_stop=1)
        assert plan.selector._first_stage_kw(plan)["topk_method"] == want, (impl, tuning, ctx)
    cache = CacheConfig(mode="resident", selector="quest_rescore8", page_size=4,
                        selected_pages=3, candidate_pages=24, implementation="pallas",
                        max_context=4 * 8192)
    for batch, want in ((16 // cfg.num_kv_heads, "pallas"), (8 // cfg.num_kv_heads, "sort")):
        plan = engine.Plan(model=cfg, cache=cache, batch=batch, prompt_len=200,
                           max_context=4 * 8192, num_stop=1)
        assert plan.selector._first_stage_kw(plan)["topk_method"] == want, batch


def test_wide_first_stage_falls_back_from_the_topk_kernel():
    """Top-k kernels hold a [next_pow2(k), chunks] block that Triton caps at 2**20 elements:
    "auto" leaves them for rows they cannot compile (a two-stage selector's wide first stage:
    1024 candidates of 8192 pages)."""
    from jaxkv.kernels import dense_select, topk
    assert topk.fits(8192, 128) and topk.fits(2048, 256) and not topk.fits(8192, 1024)
    assert dense_select.resolve_topk_method(8192, "pallas", "auto", 2048, k=128) == "pallas_cmax"
    assert dense_select.resolve_topk_method(8192, "pallas", "auto", 2048, k=1024) == "auto"


def _pieces_reference(scores, seq_lens, *, num_pages, k, page_size, num_sink_pages, pieces):
    """``select_top_pages(pieces=)`` in numpy: per row, the pages of the sequence split into
    strided pieces (page p in piece p % pieces), each piece's forced pages (sinks, the current
    page) first, then its others by descending score (NaN as -inf, ties to the lower page),
    the first k / pieces of each; a page whose score is -inf (NaN) is left out, as the
    unordered XLA top-k leaves it. Returns {(b, h): the set of pages}."""
    B, H, _ = scores.shape
    nv = _n_valid(seq_lens, page_size, num_pages)
    out = {}
    for b in range(B):
        for h in range(H):
            got = set()
            for p in range(pieces):
                pages = list(range(p, int(nv[b]), pieces))
                forced = [i for i in pages if i < num_sink_pages or i == nv[b] - 1]
                s = np.nan_to_num(scores[b, h].astype(np.float64), nan=-np.inf)
                rest = sorted((i for i in pages if i not in forced), key=lambda i: (-s[i], i))
                got |= {i for i in (forced + rest)[:k // pieces]
                        if i in forced or s[i] != -np.inf}
            out[b, h] = got
    return out


@pytest.mark.parametrize("method,impl", [("pallas", None), ("sort", None), ("auto", "pallas"),
                                         ("auto", "xla"), ("chunked", None)])
@pytest.mark.parametrize("B,H,Np,pad,ps,k,S,sinks", [
    (2, 2, 64, 0, 16, 16, 4, 1),      # whole pieces
    (3, 2, 100, 3, 8, 24, 8, 2),      # a ragged last piece, padding columns, two sinks
    (1, 3, 37, 0, 4, 12, 4, 1),
    (2, 1, 30, 0, 4, 24, 8, 3),       # pieces shorter than their share (30 / 8 < 3)
])
def test_select_top_pages_pieces_matches_numpy(method, impl, B, H, Np, pad, ps, k, S, sinks):
    """``pieces``: the top k / pieces of each strided piece (fresh seeds, NaN garbage past each
    sequence and one NaN inside, short and empty sequences), every method, against numpy."""
    rng = np.random.default_rng(abs(hash((B, H, Np, S, method))) % 2**31)
    scores = rng.normal(size=(B, H, Np + pad)).astype(np.float32)
    seq_lens = np.array([Np * ps - 3] + [int(rng.integers(0, Np * ps)) for _ in range(B - 2)]
                        + ([0] if B > 1 else []), np.int32)
    nv = _n_valid(seq_lens, ps, Np)
    scores[np.broadcast_to((np.arange(Np + pad)[None] >= nv[:, None])[:, None], scores.shape)] \
        = np.nan
    scores[0, 0, min(5, Np - 2)] = np.nan
    got = np.asarray(ds.select_top_pages(jnp.asarray(scores), jnp.asarray(seq_lens),
                                         num_pages=Np, k=k, page_size=ps, num_sink_pages=sinks,
                                         method=method, implementation=impl, ordered=False,
                                         pieces=S))
    assert got.shape == (B, H, k)
    want = _pieces_reference(scores, seq_lens, num_pages=Np, k=k, page_size=ps,
                             num_sink_pages=sinks, pieces=S)
    for (b, h), pages in want.items():
        row = got[b, h][got[b, h] >= 0]
        assert len(set(row.tolist())) == len(row)                       # no duplicates
        assert set(row.tolist()) == pages, (b, h)
        if nv[b] <= k:                         # a short row: all of it but its NaN pages
            nan = set(np.flatnonzero(np.isnan(scores[b, h, :nv[b]])).tolist())
            assert pages == set(range(int(nv[b]))) - nan


@pytest.mark.parametrize("B,H,N,ps,k,S,sinks,shortest", [
    (2, 2, 64, 16, 16, 4, 1, 1 / 4),    # whole pieces
    (3, 2, 103, 8, 24, 8, 2, 1 / 8),    # a ragged last piece, two sinks
    (2, 3, 30, 4, 24, 8, 3, 1 / 2),     # pieces shorter than their share (30 / 8 < 3)
    (2, 2, 300, 4, 32, 4, 1, 1 / 16),   # two stages: pieces of 75 columns, 8 picks each
])
def test_pieces_kernel_equals_its_reference_place_for_place(B, H, N, ps, k, S, sinks,
                                                            shortest):
    """``method="pallas"`` with pieces (one program per piece, masking the row itself) gives
    the same array as its pure-jnp reference: the same pages in the same places, ``-1``
    included (ties of small integers, NaN past each sequence and inside one, an empty
    sequence, a permuted batch), and the numpy rule's pages."""
    seq_lens, tied = _tied_rows(B, H, N, ps, shortest)
    seq_lens[-1] = 0
    tied[0, 0, min(5, N - 2)] = np.nan
    tied[0, -1, 1] = -np.inf
    order = _rng().permutation(B)
    seq_lens, tied = seq_lens[order], tied[order]
    kw = dict(num_pages=N, k=k, page_size=ps, num_sink_pages=sinks, ordered=False, pieces=S)
    x, lens = jnp.asarray(tied), jnp.asarray(seq_lens)
    got = np.asarray(ds.select_top_pages(x, lens, method="pallas", **kw))
    np.testing.assert_array_equal(got, np.asarray(topk.select_top_pieces_reference(
        x, lens, **{n: kw[n] for n in ("num_pages", "k", "page_size", "num_sink_pages",
                                       "pieces")})))
    want = _pieces_reference(tied, seq_lens, pieces=S, **{n: kw[n] for n in
                             ("num_pages", "k", "page_size", "num_sink_pages")})
    for (b, h), pages in want.items():
        assert set(got[b, h][got[b, h] >= 0].tolist()) == pages, (b, h)


def test_select_top_pages_pieces_rejects_bad_arguments():
    x, lens = jnp.zeros((1, 2, 64)), jnp.array([256])
    kw = dict(num_pages=64, page_size=4, num_sink_pages=1, ordered=False)
    with pytest.raises(ValueError, match="must divide k=12"):
        ds.select_top_pages(x, lens, k=12, pieces=8, **kw)
    with pytest.raises(ValueError, match="cannot hold"):
        ds.select_top_pages(x, lens, k=8, pieces=8, **dict(kw, num_sink_pages=2))
    with pytest.raises(ValueError, match="ordered=False"):
        ds.select_top_pages(x, lens, k=8, pieces=4, **dict(kw, ordered=True))
    with pytest.raises(ValueError, match="takes no pieces"):
        quest.quest_select(jnp.zeros((1, 2, 8)), jnp.zeros((1, 1, 64, 2, 8)),
                           jnp.zeros((1, 1, 64, 2, 8)), 0, lens, k=8, page_size=4,
                           num_sink_pages=1, topk_method="pallas_cmax", ordered=False, pieces=4)


@pytest.mark.parametrize("shape,k,pieces", [((8, 2, 8212), 512, 8), ((1, 8, 8192), 512, 16),
                                            ((1, 2, 65552), 512, 8)])
def test_pallas_topk_pieces_lowers_for_gpu(no_interpret, shape, k, pieces):
    """The 128k first stages in pieces (Qwen-like B=8 in 16-token pages, 8B-like B=1) and
    Qwen-like B=1's at 1M (pieces of 8,194 columns) lower to one Triton kernel, one program per piece, for the H200; the pieces kernel reads the
    [B, H, N] scores as they are (no transposed copy before it)."""
    txt = lower_for_h200(functools.partial(ds.select_top_pages, num_pages=shape[-1], k=k,
                                           page_size=16, num_sink_pages=1, method="pallas",
                                           ordered=False, pieces=pieces),
                         S(shape, jnp.float32), S((shape[0],), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert f"grid_x = {shape[0] * shape[1] * pieces} : i32" in txt
    assert "stablehlo.transpose" not in txt
