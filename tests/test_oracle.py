"""The oracle selector (exact per-page attention mass from a full copy of the keys):
its scores against a numpy reference, its selection against the selection rule, and the
engine with it (a budget that covers the context gives dense decoding's tokens)."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import CacheConfig, engine, selectors
from jaxkv.models import configs, llama
from jaxkv.selectors import oracle
from test_selectors import _rng, check_selection

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
PROMPTS = [list(np.random.default_rng(5).integers(3, CFG.vocab_size, n)) for n in (37, 21, 50)]


def mass_numpy(q, keys, positions, page_size):
    """attention_mass in float64: q [B, Hq, D], keys [B, Np, ps, H, D]."""
    B, Np, ps, H, D = keys.shape
    G = q.shape[1] // H
    out = np.zeros((B, H, Np))
    for b in range(B):
        n = positions[b] + 1
        if n <= 0:
            continue
        k = keys[b].reshape(Np * ps, H, D)[:n].astype(np.float64)
        for h in range(H):
            for g in range(G):
                s = k[:, h] @ q[b, h * G + g].astype(np.float64) / np.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, h] += np.bincount(np.arange(n) // ps, p, minlength=Np)[:Np]
    return out


def test_attention_mass_matches_numpy():
    rng = _rng()
    B, Np, ps, H, G, D = 3, 6, 4, 2, 3, 8
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    keys = rng.normal(size=(B, Np, ps, H, D)).astype(np.float32)
    positions = np.array([23, 9, -1], np.int32)
    keys_poisoned = keys.copy()
    for b, p in enumerate(positions):  # keys past the sequence never reach a score
        keys_poisoned[b].reshape(Np * ps, H, D)[p + 1:] = np.nan
    got = np.asarray(oracle.attention_mass(jnp.asarray(q), jnp.asarray(keys_poisoned),
                                           jnp.asarray(positions), ps))
    want = mass_numpy(q, keys, positions, ps)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:2].sum(-1), H * G / H, rtol=1e-5)  # G heads' mass each


def test_oracle_selection_follows_the_rule():
    """The selector's pages: sinks and the current page forced, then the pages of most mass."""
    rng = _rng()
    cfg = configs.tiny()
    L, B, ps, H, D = cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim
    cache = CacheConfig(mode="resident", selector="oracle", page_size=ps, selected_pages=3)
    plan = engine.Plan(model=cfg, cache=cache, batch=B, prompt_len=32, max_context=32,
                       num_stop=1)
    sel = plan.selector
    keys = rng.normal(size=(L, B, plan.pages_per_seq, ps, H, D)).astype(np.float32)
    q = rng.normal(size=(B, cfg.num_heads, D)).astype(np.float32)
    kv_new = rng.normal(size=(B, 2, H, D)).astype(np.float32)
    positions = np.array([26, 13], np.int32)
    (new_keys,), pages = sel.update_select(plan, (jnp.asarray(keys),), jnp.int32(1), None, None,
                                           jnp.asarray(q), jnp.asarray(kv_new),
                                           jnp.asarray(positions))
    want_keys = keys.copy()
    for b, p in enumerate(positions):
        want_keys[1, b, p // ps, p % ps] = kv_new[b, 0]
    np.testing.assert_array_equal(np.asarray(new_keys), want_keys)
    scores = mass_numpy(q, want_keys[1], positions, ps)
    check_selection(pages, positions + 1, k=plan.k, page_size=ps, num_sink_pages=1,
                    num_pages=plan.pages_per_seq, scores=scores, tol=1e-5)


def test_oracle_with_every_page_equals_dense():
    dense = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                           cache=CacheConfig(mode="resident", selector="dense", page_size=4))
    full = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                          cache=CacheConfig(mode="resident", selector="oracle", page_size=4,
                                            selected_pages=16))
    assert full.tokens == dense.tokens
    small = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                           cache=CacheConfig(mode="resident", selector="oracle", page_size=4,
                                             selected_pages=3, selection_lag=1))
    assert all(len(t) == 6 for t in small.tokens)


def test_oracle_is_resident_only():
    with pytest.raises(ValueError, match="resident only: set mode='resident'"):
        CacheConfig(mode="host", selector="oracle")


@pytest.mark.parametrize("selector", ["quest_rescore", "quest_rescore_exact"])
def test_rescore_host_equals_resident_and_full_budget_equals_dense(selector):
    """Two-stage selection: host tier == resident token for token; with a budget that covers
    the context it gives dense decoding's tokens (exact keys)."""
    kw = dict(selector=selector, page_size=4, selected_pages=3)
    res = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                         cache=CacheConfig(mode="resident", **kw))
    host = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                          cache=CacheConfig(mode="host", **kw))
    assert host.tokens == res.tokens
    if selector == "quest_rescore_exact":
        dense = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                               cache=CacheConfig(mode="resident", selector="dense", page_size=4))
        full = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                              cache=CacheConfig(mode="resident", selector=selector, page_size=4,
                                                selected_pages=16))
        assert full.tokens == dense.tokens


def test_rescore_with_the_pallas_second_stage_host_equals_resident():
    """The candidate-mass and final-choice kernels (interpret mode off the GPU) inside the
    decode loop: 16-token pages (the mass kernel's smallest), host tier == resident token for
    token, and they pick the pages the XLA forms pick here (same tokens)."""
    prompts = [list(np.random.default_rng(6).integers(3, CFG.vocab_size, n)) for n in (70, 41)]
    kw = dict(selector="quest_rescore8", page_size=16, selected_pages=2)
    t = jaxkv.Tuning(rescore_method="pallas", rescore_select_method="pallas")
    res = jaxkv.generate(CFG, PARAMS, prompts, max_new_tokens=5, stop_tokens=[],
                         cache=CacheConfig(mode="resident", tuning=t, **kw))
    host = jaxkv.generate(CFG, PARAMS, prompts, max_new_tokens=5, stop_tokens=[],
                          cache=CacheConfig(mode="host", tuning=t, **kw))
    xla = jaxkv.generate(CFG, PARAMS, prompts, max_new_tokens=5, stop_tokens=[],
                         cache=CacheConfig(mode="host", **kw))
    assert host.tokens == res.tokens == xla.tokens


def test_first_stage_kernel_rule():
    """The first stage's "auto" top-k: the full-row kernel up to 4096 pages (Pallas), and up
    to 16384 pages only with at least ``Tuning.first_stage_kernel_min_rows`` rows; XLA's sort
    otherwise, and always off the Pallas implementation; None turns the wide rule off."""
    from jaxkv.selectors.rescore import first_stage_takes_kernel as takes
    t = jaxkv.Tuning()
    assert takes(t, "pallas", 2048, 128, 2)                   # select_top_pages' own rule
    assert takes(t, "pallas", 8212, 512, 16)                  # Qwen-like B=8, 16-token pages
    assert takes(t, "pallas", 16384, 512, 16)                 # the same padded row
    assert not takes(t, "pallas", 8212, 512, 8)               # 8B-like B=1: a tie, XLA's
    assert not takes(t, "pallas", 16385, 512, 32)             # not measured past 16384
    assert not takes(t, "xla", 8192, 512, 16)
    assert not takes(jaxkv.Tuning(first_stage_kernel_min_rows=None), "pallas", 8192, 512, 64)
    assert takes(jaxkv.Tuning(first_stage_kernel_min_rows=8), "pallas", 8192, 512, 8)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="first_stage_kernel_min_rows"):
            jaxkv.Tuning(first_stage_kernel_min_rows=bad)


def test_rescore_final_choice_method():
    """After the Pallas second stage, "auto" takes the final-choice kernel for at most
    ``Tuning.rescore_select_kernel_max`` candidates and XLA above; a named method wins."""
    from jaxkv.selectors.rescore import final_choice_method
    t = jaxkv.Tuning()
    assert final_choice_method(t, "pallas", 512) == "pallas"
    assert final_choice_method(t, "pallas", 1024) == "xla"
    assert final_choice_method(t, None, 16) is None  # the implementation's own choice
    assert final_choice_method(jaxkv.Tuning(rescore_select_kernel_max=2048), "pallas",
                               1024) == "pallas"
    assert final_choice_method(jaxkv.Tuning(rescore_select_method="xla"), "pallas", 16) == "xla"
    with pytest.raises(ValueError, match="rescore_select_method"):
        jaxkv.Tuning(rescore_select_method="sort")
    with pytest.raises(ValueError, match="rescore_select_kernel_max"):
        jaxkv.Tuning(rescore_select_kernel_max=-1)
    assert jaxkv.Tuning(rescore_select_warps=np.int64(8)).rescore_select_warps == 8
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="rescore_select_warps"):
            jaxkv.Tuning(rescore_select_warps=bad)


def test_rescore_candidate_pages_sets_the_first_stage():
    """``candidate_pages`` replaces the selector's default (capped at the row's pages): 4x the
    budget for quest_rescore; 8x for quest_rescore8 and at least 8192 tokens' pages. With the
    same candidates the two are the same selector, token for token (host tier against
    resident)."""
    kw = dict(page_size=4, selected_pages=3)
    for sel, n, want in (("quest_rescore", None, 12), ("quest_rescore", 7, 7),
                         ("quest_rescore", 1000, 64), ("quest_rescore8", None, 64),
                         ("quest_rescore8", 24, 24)):
        cache = CacheConfig(mode="resident", selector=sel, candidate_pages=n, **kw)
        plan = engine.Plan(model=CFG, cache=cache, batch=1, prompt_len=200, max_context=256,
                           num_stop=1)
        assert plan.selector.candidate_count(plan) == want, (sel, n)
    wide8, wide4 = selectors.get("quest_rescore8"), selectors.get("quest_rescore")
    for k, ps, want in ((64, 16, 512), (32, 16, 512), (16, 16, 512), (128, 16, 1024),
                        (128, 8, 1024), (64, 8, 1024), (16, 64, 128), (8, 64, 128),
                        (3, 4, 2048)):
        assert wide8.default_candidates(k, ps) == want, (k, ps)
    assert wide4.default_candidates(32, 16) == 128 and wide4.default_candidates(1, 16) == 4
    wide = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                          cache=CacheConfig(mode="resident", selector="quest_rescore8",
                                            candidate_pages=24, **kw))
    set8 = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                          cache=CacheConfig(mode="host", selector="quest_rescore",
                                            candidate_pages=24, **kw))
    assert set8.tokens == wide.tokens


@pytest.mark.parametrize("case", ["distinct", "ties_any_order", "fewer_than_k"])
def test_rescore_top_candidates_follow_the_rule(case):
    """The final choice over the candidates against numpy: forced sinks and current page,
    then most mass, ties to the earlier candidate; ascending, -1 last. Candidates come in any
    order (the first stage's top-k order) with -1s anywhere; with distinct masses it also
    equals the shared selection rule applied to the masses scattered into a full row."""
    from jaxkv.selectors import rescore
    from jaxkv.kernels import dense_select
    rng = _rng()
    B, H, Np, C, k, ps, sinks = 3, 2, 40, 12, 5, 4, 1
    if case == "fewer_than_k":
        C, k = 4, 7
    seq_lens = np.array([150, 37, 9], np.int32)
    cand = np.full((B, H, C), -1, np.int32)
    for b in range(B):
        n = -(-seq_lens[b] // ps)
        for h in range(H):
            others = rng.permutation(np.arange(sinks, n - 1))[:max(0, C - 2 - h)]
            c = np.unique(np.concatenate([np.arange(sinks), [n - 1], others]))[:C]
            cand[b, h, :len(c)] = c
            if case != "distinct":
                cand[b, h] = rng.permutation(cand[b, h])
    mass = rng.random((B, H, C))
    if case == "ties_any_order":
        mass = np.round(mass * 3) / 3  # four values: many ties
    mass = np.where(cand >= 0, mass, -np.inf).astype(np.float32)
    got = np.asarray(rescore.top_candidates(jnp.asarray(mass), jnp.asarray(cand),
                                            jnp.asarray(seq_lens), k=k, page_size=ps,
                                            num_pages=Np, num_sink_pages=sinks))
    for b in range(B):
        n = -(-seq_lens[b] // ps)
        for h in range(H):
            c, m = cand[b, h], mass[b, h]
            score = [(np.inf if p < sinks or p == n - 1 else float(v), i)
                     for i, (p, v) in enumerate(zip(c, m)) if p >= 0]
            best = sorted(int(c[i]) for _, i in sorted(score, key=lambda t: (-t[0], t[1]))[:k])
            assert got[b, h].tolist() == best + [-1] * (k - len(best))
    if case == "distinct":
        full = np.full((B, H, Np), -np.inf, np.float32)
        for b in range(B):
            for h in range(H):
                ok = cand[b, h] >= 0
                full[b, h, cand[b, h][ok]] = mass[b, h][ok]
        want = np.asarray(dense_select.select_top_pages(
            jnp.asarray(full), jnp.asarray(seq_lens), num_pages=Np, k=k, page_size=ps,
            num_sink_pages=sinks, method="sort"))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stage2", ["xla", "pallas"])
def test_rescore_candidates_covering_the_row_skip_the_first_stage(stage2):
    """When the candidates cover every page (``covers_row``), the selector takes the valid
    pages in page order instead of Quest's top-k of all of them: the same pages, the same
    summaries, for the gather-free XLA second stage and the kernel (interpret mode here);
    NaN keys past the sequence are never read."""
    from jaxkv.kernels import candidate_mass as mass_kernels
    from jaxkv.kernels import quest as quest_kernels
    rng = _rng()
    cfg = configs.tiny()
    L, B, ps, H, D = cfg.num_layers, 3, 16, cfg.num_kv_heads, cfg.head_dim
    cache = CacheConfig(mode="resident", selector="quest_rescore8", page_size=ps,
                        selected_pages=2, candidate_block=1,   # per-page float bounds below
                        bounds_dtype="float", tuning=jaxkv.Tuning(rescore_method=stage2))
    plan = engine.Plan(model=cfg, cache=cache, batch=B, prompt_len=96, max_context=128,
                       num_stop=1)
    sel = plan.selector
    Np = plan.pages_per_seq
    assert sel.covers_row(plan) and Np == 8
    positions = np.array([100, 37, 16], np.int32)
    kmax = rng.normal(size=(L, B, Np, H, D)).astype(np.float32)
    kmin = kmax - rng.random(size=kmax.shape).astype(np.float32)
    keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
    scales = (0.01 + rng.random(size=keys.shape[:5])).astype(np.float32)
    scales_nan = scales.copy()
    for b, p in enumerate(positions):  # past the new token: never read
        scales_nan[:, b].reshape(L, H, Np * ps)[:, :, p + 1:] = np.nan
    summ = tuple(jnp.asarray(a) for a in (kmax, kmin, keys, scales_nan))
    q = jnp.asarray(rng.normal(size=(B, cfg.num_heads, D)).astype(np.float32))
    kv_new = jnp.asarray(rng.normal(size=(B, 2, H, D)).astype(np.float32))
    layer = jnp.int32(1)
    new, pages = sel.update_select(plan, summ, layer, None, None, q, kv_new,
                                   jnp.asarray(positions))
    # the first stage's path: Quest's top-k over all Np pages, then the same second stage
    seq_lens = jnp.asarray(positions + 1)
    kmax2, kmin2, cand = quest_kernels.quest_update_select(
        q, summ[0], summ[1], layer, seq_lens, kv_new, jnp.asarray(positions),
        **dict(sel._first_stage_kw(plan), k=Np))
    for got, want in zip(new[:2], (kmax2, kmin2)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want = sel._rescore(plan, new, layer, q, cand, jnp.asarray(positions), seq_lens)
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(want))
    assert (np.asarray(pages) >= 0).sum(-1).min() == 2
    # the gather-free XLA form equals the gathering one
    every = sel._every_page(plan, seq_lens, H)
    a = mass_kernels.candidate_mass_reference(q, new[2], new[3], layer, every,
                                              jnp.asarray(positions), in_order=True)
    b = mass_kernels.candidate_mass_reference(q, new[2], new[3], layer, every,
                                              jnp.asarray(positions))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(a)[every >= 0]).all()
    # a budget of every page selects every valid page, ascending, -1 last
    full = engine.Plan(model=cfg, cache=dataclasses.replace(cache, selected_pages=Np), batch=B,
                       prompt_len=96, max_context=128, num_stop=1)
    new_full, pages = sel.update_select(full, summ, layer, None, None, q, kv_new,
                                        jnp.asarray(positions))
    want = [list(range(-(-(p + 1) // ps))) for p in positions]
    assert np.asarray(pages).tolist() == [[w + [-1] * (Np - len(w))] * H for w in want]
    for got, ref in zip(new_full, new):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_rescore_key_copy_avoids_wrapped_32_bit_offsets():
    """The int8 key copy of 2-4 GiB gets unused layers up to just over 2**32 bytes (the
    Pallas second stage's offsets, ``spec.alloc_rows``), its scales the same leading shape;
    other sizes and the KV-dtype copy are as the model has layers."""
    cfg = configs.tiny(num_heads=8, num_kv_heads=8, head_dim=128, d_model=256,
                       max_position=2**19)
    for selector, ctx, padded in (("quest_rescore8", 2**19, True), ("quest_rescore8", 2**18, False),
                                  ("quest_rescore_exact", 2**19, False)):
        cache = CacheConfig(mode="resident", selector=selector, page_size=16, selected_pages=8,
                            max_context=ctx)
        plan = engine.Plan(model=cfg, cache=cache, batch=3, prompt_len=ctx, max_context=ctx,
                           num_stop=1)
        summ = jax.eval_shape(lambda plan=plan: engine.init_summaries(plan))
        keys, scales = summ[4], summ[5]   # after the int8 bounds (kmax, kmin, scale, shift)
        assert keys.shape[1:] == (3, 8, ctx // 16, 16, 128) and scales.shape == keys.shape[:5]
        nbytes = keys.size * keys.dtype.itemsize
        assert (keys.shape[0] > cfg.num_layers) == padded, (selector, ctx, keys.shape)
        if padded:
            assert 2**32 < nbytes <= 2**32 + nbytes // keys.shape[0]


@pytest.mark.gpu
def test_gpu_rescore_key_copy_of_3_gib():
    """The two-stage selector with the Pallas second stage over an int8 key copy of 3 GiB
    (2 layers, 8 KV heads of 128, 3 x 2**19 tokens; padded to 4.5 GiB): the last request's
    rows lie past 2**31 bytes. Three copies of one prompt give the tokens of one."""
    cfg = configs.tiny(num_heads=8, num_kv_heads=8, head_dim=128, d_model=256,
                       max_position=2**19, dtype="bfloat16")
    params = llama.init_params(cfg, seed=1)
    prompt = list(np.random.default_rng(7).integers(3, cfg.vocab_size, 300))
    cache = CacheConfig(mode="resident", selector="quest_rescore8", page_size=16,
                        selected_pages=4, max_context=2**19,
                        tuning=jaxkv.Tuning(rescore_method="pallas"))
    one = jaxkv.generate(cfg, params, [prompt], cache=cache, max_new_tokens=8, stop_tokens=[])
    three = jaxkv.generate(cfg, params, [prompt] * 3, cache=cache, max_new_tokens=8,
                           stop_tokens=[])
    assert three.tokens == one.tokens * 3


def _np_bounds(t, n, bs):
    """Quest's bounds in numpy: (kmax, kmin) of the first ``n`` tokens of ``t`` [..., T, H, D]
    in blocks of ``bs`` tokens, [..., ceil(n / bs), H, D]."""
    segs = [t[..., i * bs:min((i + 1) * bs, n), :, :] for i in range(-(-n // bs))]
    return (np.stack([g.max(-3) for g in segs], -3), np.stack([g.min(-3) for g in segs], -3))


@pytest.mark.parametrize("r,pieces", [(2, 1), (4, 1), (1, 4), (2, 2)])
def test_rescore_candidate_block_first_stage_numpy(r, pieces):
    """``candidate_block`` r: Quest's bounds per block of r pages (the new token folded in),
    the first stage picks whole blocks by the literal Quest score (sink blocks and the
    current one forced, ties to the lower block), their pages past the sequence dropped; the
    second stage re-ranks exactly those pages. ``candidate_pieces``: the blocks' top per
    strided piece (block i in piece i % pieces). Against numpy, NaN keys past the sequence."""
    from jaxkv.kernels import quest as quest_kernels
    rng = _rng()
    cfg = configs.tiny()
    L, B, ps, H, D = cfg.num_layers, 3, 4, cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // H
    cache = CacheConfig(mode="resident", selector="quest_rescore", page_size=ps,
                        selected_pages=3, candidate_pages=8, candidate_block=r,
                        candidate_pieces=pieces, bounds_dtype="float")   # float bounds below
    plan = engine.Plan(model=cfg, cache=cache, batch=B, prompt_len=120, max_context=128,
                       num_stop=1)
    sel = plan.selector
    Np = plan.pages_per_seq
    Nb, bs = sel.bound_blocks(plan)
    assert (Nb, bs) == (Np // r, ps * r) and not sel.covers_row(plan)
    positions = np.array([117, 50, 21], np.int32)
    tok = rng.normal(size=(L, B, Np * ps, H, D)).astype(np.float32)    # every key, in order
    kv_new = rng.normal(size=(B, 2, H, D)).astype(np.float32)
    for b, p in enumerate(positions):
        tok[:, b, p + 1:] = np.nan                                       # past the sequence
    kmax = np.full((L, B, Nb, H, D), -np.inf, np.float32)
    kmin = np.full((L, B, Nb, H, D), np.inf, np.float32)
    for b, p in enumerate(positions):  # the bounds before the new token (at position p)
        n = -(-p // bs)
        kmax[:, b, :n], kmin[:, b, :n] = _np_bounds(tok[:, b], p, bs)
    keys = np.zeros((L, B, H, Np, ps, D), np.int8)
    scales = np.ones((L, B, H, Np, ps), np.float32)
    summ = tuple(jnp.asarray(a) for a in (kmax, kmin, keys, scales))
    q = rng.normal(size=(B, cfg.num_heads, D)).astype(np.float32)
    layer = 1
    new, pages = sel.update_select(plan, summ, jnp.int32(layer), None, None, jnp.asarray(q),
                                   jnp.asarray(kv_new), jnp.asarray(positions))
    Cb = 8 // r
    cand = np.full((B, H, Cb * r), -1, np.int32)
    for b, p in enumerate(positions):
        t = tok[layer, b].copy()
        t[p] = kv_new[b, 0]
        nb, n_pages = -(-(p + 1) // bs), -(-(p + 1) // ps)
        mx, mn = _np_bounds(t, p + 1, bs)
        np.testing.assert_array_equal(np.asarray(new[0])[layer, b, :nb], mx)
        np.testing.assert_array_equal(np.asarray(new[1])[layer, b, :nb], mn)
        for h in range(H):
            qg = q[b, h * G:(h + 1) * G].astype(np.float64)              # [G, D]
            score = np.maximum(qg[:, None] * mx[None, :, h], qg[:, None] * mn[None, :, h])
            score = score.sum(axis=(0, 2))                                # [nb]
            score[0] = score[nb - 1] = np.inf                             # sink, current
            best = [i for p in range(pieces) for i in sorted(
                range(p, nb, pieces), key=lambda i: (-score[i], i))[:Cb // pieces]]
            pg = [i * r + j for i in best for j in range(r) if i * r + j < n_pages]
            cand[b, h, :len(pg)] = pg
    seq_lens = jnp.asarray(positions + 1)
    want = sel._rescore(plan, new, jnp.int32(layer), jnp.asarray(q), jnp.asarray(cand),
                        jnp.asarray(positions), seq_lens)
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(want))
    got = quest_kernels.quest_select(jnp.asarray(q), new[0], new[1], jnp.int32(layer), seq_lens,
                                     **sel._first_stage_kw(plan))
    got = np.asarray(sel._block_pages(plan, got, seq_lens))
    for b in range(B):
        for h in range(H):
            assert sorted(got[b, h][got[b, h] >= 0]) == sorted(cand[b, h][cand[b, h] >= 0])


def test_rescore_candidate_block_end_to_end():
    """Blocks of 2 and 4 pages: host tier == resident token for token (prompts of whole pages
    but not whole blocks); blocks of one page are the default. (A continued context with
    blocks: test_textapi's host-rescore-block2.)"""
    kw = dict(selector="quest_rescore", page_size=4, selected_pages=3, candidate_pages=6)
    host = {}
    for r in (2, 4):
        res = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                             cache=CacheConfig(mode="resident", candidate_block=r, **kw))
        host[r] = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                                 cache=CacheConfig(mode="host", candidate_block=r, **kw))
        assert host[r].tokens == res.tokens
    one = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                         cache=CacheConfig(mode="host", candidate_block=1, **kw))
    base = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                          cache=CacheConfig(mode="host", **kw))
    assert base.tokens == one.tokens


def test_rescore_candidate_pieces_end_to_end():
    """The first stage in 2 and 3 strided pieces: host tier == resident token for token."""
    kw = dict(selector="quest_rescore", page_size=4, selected_pages=3, candidate_pages=6)
    for pieces in (2, 3):
        res = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                             cache=CacheConfig(mode="resident", candidate_pieces=pieces, **kw))
        host = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                              cache=CacheConfig(mode="host", candidate_pieces=pieces, **kw))
        assert host.tokens == res.tokens


def test_pallas_selection_end_to_end():
    """The Pallas implementation's selection as it runs on the GPU, in interpret mode: the
    two-stage selector's first stage in pieces read by one top-k program each, its second
    stage splitting the query in the kernel, Quest's scores kernel forming the query's group
    sums: the host tier == resident token for token, and the same tokens as XLA's top-k over
    the pieces (the same candidates) and as Quest's XLA implementation."""
    kw = dict(page_size=4, selected_pages=3, implementation="pallas")
    gen = lambda **c: jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6,  # noqa: E731
                                     stop_tokens=[], cache=CacheConfig(**kw, **c))
    two = dict(selector="quest_rescore8", candidate_pages=6, candidate_pieces=2)
    res = gen(mode="resident", **two)
    assert gen(mode="host", **two).tokens == res.tokens
    assert gen(mode="resident", tuning=jaxkv.Tuning(topk_method="sort"), **two).tokens \
        == res.tokens
    quest = gen(mode="resident", selector="quest")
    assert gen(mode="host", selector="quest").tokens == quest.tokens
    assert jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6, stop_tokens=[],
                          cache=CacheConfig(mode="resident", selector="quest", page_size=4,
                                            selected_pages=3, implementation="xla")).tokens \
        == quest.tokens


def test_candidate_pieces_errors():
    """Pieces need a two-stage selector and must split the candidates: the error names the
    field and a count that works."""
    with pytest.raises(ValueError, match="leave candidate_pieces=1"):
        CacheConfig(selector="quest", candidate_pieces=2)
    with pytest.raises(ValueError, match=r"candidate_pieces \(4\).*candidate_pieces=3 works"):
        jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=2, stop_tokens=[],
                       cache=CacheConfig(mode="resident", selector="quest_rescore", page_size=4,
                                         selected_pages=3, candidate_pages=6,
                                         candidate_pieces=4))
    with pytest.raises(ValueError, match="pallas_cmax' ranks whole rows.*candidate_pieces=2"):
        jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=2, stop_tokens=[],
                       cache=CacheConfig(mode="resident", selector="quest_rescore", page_size=4,
                                         selected_pages=3, candidate_pages=6,
                                         candidate_pieces=2,
                                         tuning=jaxkv.Tuning(topk_method="pallas_cmax")))


@pytest.mark.parametrize("cands,block,want", [(512, 1, 8), (1024, 1, 16), (128, 1, 2),
                                               (96, 1, 1), (192, 1, 2), (512, 4, 2)])
def test_candidate_pieces_none_takes_shares_of_64(cands, block, want):
    """``candidate_pieces=None``: the most pieces (powers of two) that divide the first
    stage's picks (candidates / block) and leave each 64 of them."""
    cache = CacheConfig(mode="resident", selector="quest_rescore8", page_size=16,
                        selected_pages=8, candidate_pages=cands, candidate_block=block,
                        candidate_pieces=None)
    plan = engine.Plan(model=configs.tiny(), cache=cache, batch=1, prompt_len=100,
                       max_context=65536, num_stop=1)
    assert plan.selector.first_stage_pieces(plan) == want
    plan.selector.check_plan(plan)
    # the chunk-maxima top-k ranks whole rows: None leaves them whole
    cmax = dataclasses.replace(cache, tuning=jaxkv.Tuning(topk_method="pallas_cmax"))
    plan = dataclasses.replace(plan, cache=cmax)
    assert plan.selector.first_stage_pieces(plan) == 1
    plan.selector.check_plan(plan)


def test_candidate_block_of_a_kept_context_must_match():
    """A context's first-stage summaries are per block: continuing it with another block size
    is an early error naming the field."""
    kw = dict(mode="host", selector="quest_rescore", page_size=4, selected_pages=3,
              candidate_pages=6, max_context=128)
    r = jaxkv.generate(CFG, PARAMS, PROMPTS[:1], max_new_tokens=2, stop_tokens=[], keep=True,
                       cache=CacheConfig(candidate_block=2, **kw))
    with pytest.raises(ValueError, match="candidate_block=2"):
        jaxkv.generate(CFG, PARAMS, [[5, 6]], max_new_tokens=2, stop_tokens=[],
                       context=r.context, cache=CacheConfig(candidate_block=4, **kw))


def test_candidate_block_needs_a_two_stage_selector():
    with pytest.raises(ValueError, match="candidate_block groups the first stage"):
        CacheConfig(selector="quest", candidate_block=2)
    with pytest.raises(ValueError, match="candidate_block"):
        CacheConfig(candidate_block=0)
    with pytest.raises(ValueError, match="candidate_block must be an int"):
        CacheConfig(candidate_block=None)


@pytest.mark.parametrize("kw, want", [(dict(), 1), (dict(selector="quest"), 1),
                                      (dict(candidate_block=2), 2),
                                      (dict(candidate_block=np.int64(4)), 4)])
def test_candidate_block_defaults_to_per_page(kw, want):
    """``candidate_block`` is 1 (per page) unless given; numpy ints become Python ints."""
    from jaxkv.api import make_plan
    cache = CacheConfig(page_size=4, **kw)
    assert cache.candidate_block == want and type(cache.candidate_block) is int
    make_plan(CFG, cache, [300], 8, 4)


@pytest.mark.parametrize("kw, r, best", [(dict(candidate_pages=16), 16, 8),
                                         (dict(candidate_pages=16), 128, 8),
                                         (dict(candidate_pages=4, sink_pages=3), 2, 1)])
def test_candidate_block_too_large_names_the_largest_that_works(kw, r, best):
    """Blocks that leave the first stage fewer blocks than the sink blocks and the current
    one fail in make_plan naming the largest candidate_block that divides the candidates and
    works (a block size that does not divide them reads more pages; not the top-k's
    "k=1 must be >= num_sink_pages + 1" from inside the first stage), and that value plans;
    a row short enough that every page is a candidate has no first stage, so any block does."""
    from jaxkv.api import make_plan

    def cache(x, **more):
        return CacheConfig(selector="quest_rescore", page_size=4, candidate_block=x,
                           selected_pages=kw.get("sink_pages", 1) + 1, **kw, **more)

    with pytest.raises(ValueError, match=rf"candidate_block \({r}\) groups the \d+ candidate "
                                         rf"pages into \d+ block.*largest candidate_block that "
                                         rf"divides the candidates and works here is {best} "
                                         rf"\(or raise candidate_pages\)"):
        make_plan(CFG, cache(r), [100], 8, 4)
    make_plan(CFG, cache(best), [100], 8, 4)
    plan = make_plan(CFG, cache(r, max_context=kw["candidate_pages"] * 4), [3], 1, 4)
    assert plan.selector.covers_row(plan)
