"""The two-stage selectors' final choice (jaxkv.kernels.candidate_select): the kernel
(interpret mode off the GPU) and the reference against a numpy form of the rule, on fresh
seeds, with NaN in every statistic the op must not read and candidates in any order."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxkv.kernels import candidate_select as cs
from tests.lowering import lower_for_h200
from page_kernel_util import fresh_rng

IMPLS = ["pallas", "xla"]


def _rng():
    return fresh_rng()  # fresh seed each run, printed (shown when a test fails)


def select_numpy(m, l, cand, seq_lens, *, G, k, page_size, num_pages, num_sink_pages):
    """The rule in float64: masses per query head over the candidates, summed over the G
    heads; forced sinks and current page, then most mass, ties to the earlier candidate;
    ascending, -1 last."""
    B, H, C = cand.shape
    out = np.full((B, H, k), -1, np.int32)
    for b in range(B):
        n = min(-(-max(int(seq_lens[b]), 0) // page_size), num_pages)
        for h in range(H):
            c = cand[b, h]
            mm = m[b, h, :C, :G].astype(np.float64)
            ll = l[b, h, :C, :G].astype(np.float64)
            mm = np.where(c[:, None] >= 0, mm, -np.inf)
            ll = np.where(c[:, None] >= 0, ll, 0.0)
            top = mm.max(axis=0)
            w = ll * np.exp(mm - np.where(np.isfinite(top), top, 0.0))
            den = w.sum(axis=0)
            mass = (w / np.where(den > 0, den, 1.0)).sum(axis=1)
            score = [(np.inf if p < num_sink_pages or p == n - 1 else mass[i], i)
                     for i, p in enumerate(c) if 0 <= p < n]
            best = sorted(int(c[i]) for _, i in sorted(score, key=lambda t: (-t[0], t[1]))[:k])
            out[b, h, :len(best)] = best
    return out


def _case(rng, *, B=3, H=2, C=12, Cs=None, G=3, Gs=16, Np=40, ps=4, ties=False, sinks=1):
    """Statistics as the second stage writes them, NaN in the padding rows / columns and on
    the rows of -1 candidates (never data), candidates distinct in any order."""
    Cs = Cs or C
    seq_lens = np.array([Np * ps - 3, 37, 9, 0][:B], np.int32)
    cand = np.full((B, H, C), -1, np.int32)
    for b in range(B):
        n = -(-max(seq_lens[b], 0) // ps)
        for h in range(H):
            pick = rng.permutation(n)[:rng.integers(max(0, min(C, n) - 2), min(C, n) + 1)]
            cand[b, h, :len(pick)] = pick
            cand[b, h] = rng.permutation(cand[b, h])
    m = rng.normal(size=(B, H, Cs, Gs)).astype(np.float32) * 3
    l = (rng.random((B, H, Cs, Gs)) * 20 + 1).astype(np.float32)
    if ties:  # a few values only, shared across rows: many exact ties
        m = np.round(m).clip(-1, 1)
        l = np.round(l / 10) + 1
        m[..., :G] = m[:, :, :1, :G]
        l[..., :G] = np.where(rng.random((B, H, Cs, 1)) < 0.5, l[:, :, :1, :G], 2 * l[:, :, :1, :G])
    m[..., G:] = np.nan
    l[..., G:] = np.nan
    m[:, :, C:] = np.nan
    l[:, :, C:] = np.nan
    none = np.zeros((B, H, Cs), bool)
    none[:, :, :C] = cand < 0
    m[none] = np.nan
    l[none] = np.nan
    return m, l, cand, seq_lens


def _run(impl, m, l, cand, seq_lens, **kw):
    return np.asarray(cs.candidate_select(jnp.asarray(m), jnp.asarray(l), jnp.asarray(cand),
                                          jnp.asarray(seq_lens), implementation=impl, **kw))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["distinct", "ties", "fewer_than_k", "padded_rows", "k_not_pow2"])
def test_candidate_select_matches_numpy(impl, case):
    rng = _rng()
    shape = dict(distinct={}, ties=dict(ties=True), fewer_than_k=dict(C=4),
                 padded_rows=dict(C=10, Cs=16), k_not_pow2=dict(C=16))[case]
    m, l, cand, seq_lens = _case(rng, **shape)
    kw = dict(G=3, k={"fewer_than_k": 7, "k_not_pow2": 6}.get(case, 5), page_size=4,
              num_pages=40, num_sink_pages=1)
    want = select_numpy(np.nan_to_num(m, nan=-np.inf), np.nan_to_num(l, nan=0.0), cand, seq_lens,
                        **kw)
    np.testing.assert_array_equal(_run(impl, m, l, cand, seq_lens, **kw), want)


@pytest.mark.parametrize("impl", IMPLS)
def test_candidate_select_drops_candidates_past_the_end(impl):
    """Candidates at or past the request's page count (with finite, large statistics, as
    garbage would give) are never picked; a request with no token (seq_len 0) picks none."""
    rng = _rng()
    m, l, cand, seq_lens = _case(rng, B=4, C=12)
    n = -(-np.maximum(seq_lens, 0) // 4)
    for b in range(1, 4):  # request 0 fills all 40 pages
        for h in range(2):
            free = np.flatnonzero(cand[b, h] < 0)[:2]
            cand[b, h, free] = n[b] + np.arange(len(free))
            m[b, h, free, :3], l[b, h, free, :3] = 50.0, 20.0
    kw = dict(G=3, k=5, page_size=4, num_pages=40, num_sink_pages=1)
    got = _run(impl, m, l, cand, seq_lens, **kw)
    want = select_numpy(np.nan_to_num(m, nan=-np.inf), np.nan_to_num(l, nan=0.0), cand, seq_lens,
                        **kw)
    np.testing.assert_array_equal(got, want)
    assert np.all((got < n[:, None, None]) | (got == -1)) and np.all(got[3] == -1)


def test_candidate_select_ignores_candidate_order():
    """Distinct masses: the same pages whatever order the first stage left the candidates in."""
    rng = _rng()
    m, l, cand, seq_lens = _case(rng, C=16, sinks=2)
    kw = dict(G=3, k=6, page_size=4, num_pages=40, num_sink_pages=2)
    base = _run("pallas", m, l, cand, seq_lens, **kw)
    perm = rng.permutation(16)
    np.testing.assert_array_equal(
        _run("pallas", m[:, :, perm], l[:, :, perm], cand[:, :, perm], seq_lens, **kw), base)


def test_candidate_select_kernel_equals_the_reference_at_a_decode_shape():
    """At the Qwen-like 128k shape's sizes (B=2 of 8, 2 KV heads, 7 query heads padded to 16
    columns, 128 candidates of 2048 pages, k = 16): the kernel gives the reference's pages."""
    rng = _rng()
    B, H, C, G, Np, ps = 2, 2, 128, 7, 2048, 64
    seq_lens = rng.integers(Np * ps // 2, Np * ps, size=B).astype(np.int32)
    cand = np.stack([np.stack([rng.permutation(seq_lens[b] // ps + 1)[:C] for _ in range(H)])
                     for b in range(B)]).astype(np.int32)
    cand[:, :, :1] = 0  # the sink among the candidates
    cand[:, 1, -5:] = -1
    m = rng.normal(size=(B, H, C, 16)).astype(np.float32) * 4
    l = (rng.random((B, H, C, 16)) * 60 + 1).astype(np.float32)
    m[cand < 0], l[cand < 0] = -np.inf, 0.0
    kw = dict(G=G, k=16, page_size=ps, num_pages=Np, num_sink_pages=1)
    np.testing.assert_array_equal(_run("pallas", m, l, cand, seq_lens, **kw),
                                  _run("xla", m, l, cand, seq_lens, **kw))


def test_candidate_select_rejects_bad_shapes():
    m = jnp.zeros((2, 3, 8, 16))
    cand = jnp.zeros((2, 3, 8), jnp.int32)
    lens = jnp.zeros((2,), jnp.int32)
    kw = dict(k=4, page_size=16, num_pages=64, num_sink_pages=1)
    with pytest.raises(ValueError, match="cand must be"):
        cs.candidate_select(m, m, cand[:, :, None], lens, G=3, **kw)
    with pytest.raises(ValueError, match="G=17"):
        cs.candidate_select(m, m, cand, lens, G=17, **kw)
    with pytest.raises(ValueError, match="seq_lens must be"):
        cs.candidate_select(m, m, cand, lens[:1], G=3, **kw)


@pytest.mark.parametrize("B,H,C,k", [(8, 2, 128, 16), (8, 2, 256, 16), (1, 8, 1024, 64)])
def test_candidate_select_lowers_for_gpu(no_interpret, B, H, C, k):
    """One Triton call, no sort, top-k or scatter left in XLA (Qwen-like B=8 with 8x / 16x
    candidates, 8B-like B=1 at 1024 tokens of 16-token pages with 16x)."""
    fn = functools.partial(cs.candidate_select_pallas, G=7, k=k, page_size=64,
                           num_pages=2048, num_sink_pages=1)
    S = jax.ShapeDtypeStruct
    stat = S((B, H, C, 16), jnp.float32)
    txt = lower_for_h200(fn, stat, stat, S((B, H, C), jnp.int32), S((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.sort" not in txt and "top_k" not in txt and "scatter" not in txt


def test_candidate_select_warps_reach_the_kernel(no_interpret):
    """``num_warps`` (``Tuning.rescore_select_warps``) sets the kernel's warps per program;
    ``None`` takes 4 below 512 candidates and 8 from 512; the reference takes the argument and
    ignores it."""
    S = jax.ShapeDtypeStruct
    B, H = 8, 2
    for C, w, want in ((512, None, "num_warps = 8"), (256, None, "num_warps = 4"),
                       (512, 4, "num_warps = 4"), (256, 8, "num_warps = 8")):
        stat = S((B, H, C, 8), jnp.float32)
        fn = functools.partial(cs.candidate_select, G=7, k=64, page_size=16, num_pages=8212,
                               num_sink_pages=1, implementation="pallas", num_warps=w)
        txt = lower_for_h200(fn, stat, stat, S((B, H, C), jnp.int32), S((B,), jnp.int32))
        assert want in txt, (C, w)
    rng = _rng()
    m = rng.normal(size=(1, 1, 8, 2)).astype(np.float32)
    cand = np.arange(8, dtype=np.int32)[None, None]
    kw = dict(G=2, k=2, page_size=4, num_pages=8, num_sink_pages=1)
    lens = np.array([32], np.int32)
    np.testing.assert_array_equal(
        cs.candidate_select(m, np.ones_like(m), cand, lens, implementation="xla", num_warps=8, **kw),
        cs.candidate_select(m, np.ones_like(m), cand, lens, implementation="xla", **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,C,G,k", [(8, 2, 256, 7, 16), (8, 2, 512, 7, 64), (1, 8, 1024, 4, 64),
                                       (4, 3, 96, 3, 10)])
def test_gpu_candidate_select_kernel(B, H, C, G, k):
    """The kernel on the GPU against numpy at decode shapes, NaN padding included; 512
    candidates: ``CacheConfig()``'s at Qwen-like B=8 (8 warps by default)."""
    rng = _rng()
    Np, ps = 2048, 64
    seq_lens = rng.integers(Np * ps // 2, Np * ps, size=B).astype(np.int32)
    cand = np.stack([np.stack([rng.permutation(seq_lens[b] // ps + 1)[:C] for _ in range(H)])
                     for b in range(B)]).astype(np.int32)
    cand[:, :, -3:] = -1
    m = rng.normal(size=(B, H, C, 16)).astype(np.float32) * 4
    l = (rng.random((B, H, C, 16)) * 60 + 1).astype(np.float32)
    m[..., G:], l[..., G:] = np.nan, np.nan
    m[cand < 0], l[cand < 0] = np.nan, np.nan
    kw = dict(G=G, k=k, page_size=ps, num_pages=Np, num_sink_pages=1)
    want = select_numpy(np.nan_to_num(m, nan=-np.inf), np.nan_to_num(l, nan=0.0), cand, seq_lens,
                        **kw)
    np.testing.assert_array_equal(_run("pallas", m, l, cand, seq_lens, **kw), want)
