"""A selection interval (CacheConfig.selection_interval): requests select anew at multiples of
the interval, at page boundaries and at their first step, and hold their pages in between;
the selectors' kernels skip the held requests (row masks), and what they still compute equals
the plain call (CPU: interpret mode and the XLA references; NaN in every input a skipped
request's program must not read)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, Sampling, engine
from jaxkv.api import make_plan
from jaxkv.kernels import candidate_mass as cm
from jaxkv.kernels import candidate_select as cs
from jaxkv.kernels import quest, topk
from jaxkv.models import configs, llama
from tests.lowering import lower_for_h200

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng(4321)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (37, 21, 50)]
NEW = 10


def _rng():
    return np.random.default_rng(np.random.SeedSequence().entropy)


def _gen(cache, prompts=PROMPTS, cfg=CFG, params=PARAMS, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return jaxkv.generate(cfg, params, prompts, cache=cache, stop_tokens=[], **kw)


def test_config_checks():
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="selection_interval"):
            CacheConfig(selection_interval=bad)
    with pytest.raises(ValueError, match="needs a scored selector"):
        CacheConfig(selector="dense", selection_interval=4)
    with pytest.raises(ValueError, match="does not combine with selection_lag"):
        CacheConfig(selection_interval=4, selection_lag=1)
    assert CacheConfig(selection_interval=np.int64(8)).selection_interval == 8


@pytest.mark.parametrize("selector", ["quest", "quest_rescore_exact"])
@pytest.mark.parametrize("mode", ["resident", "host"])
def test_interval_changes_nothing_when_every_page_is_selected(selector, mode):
    """k >= the context's pages: a held selection holds every page up to the current one (a
    page boundary selects anew), so the tokens are the exact selection's."""
    every = dict(selector=selector, page_size=4, selected_pages=64)
    exact = _gen(CacheConfig(mode="resident", **every))
    held = _gen(CacheConfig(mode=mode, selection_interval=3, **every))
    assert held.tokens == exact.tokens


@pytest.mark.parametrize("cache", [
    dict(selector="quest"),
    dict(selector="quest", schedule="step", pool_pages=6),
    dict(selector="quest", schedule="layer", dense_layers=1),
    dict(selector="quest_rescore"),
], ids=["quest", "quest-small-pool", "quest-layer-dense-first", "rescore"])
def test_interval_host_equals_resident(cache):
    base = dict(page_size=4, selected_pages=3, selection_interval=2)
    dense = {"dense_layers": cache["dense_layers"]} if "dense_layers" in cache else {}
    res = _gen(CacheConfig(mode="resident", selector=cache["selector"], **base, **dense))
    host = _gen(CacheConfig(mode="host", **base, **cache))
    assert host.tokens == res.tokens and host.stats["misses"] > 0


def test_interval_kernels_equal_the_xla_path_in_the_loop():
    """The two-stage selector's kernels (interpret mode) with held requests: the first-stage
    top-k, second stage and final choice skip them; host tier == resident == the XLA path,
    token for token, and the held pages are the same arrays."""
    prompts = [list(np.random.default_rng(6).integers(3, CFG.vocab_size, n)) for n in (70, 41)]
    kw = dict(selector="quest_rescore8", page_size=16, selected_pages=2, selection_interval=4)
    t = jaxkv.Tuning(rescore_method="pallas", rescore_select_method="pallas",
                     topk_method="pallas")
    res = _gen(CacheConfig(mode="resident", tuning=t, **kw), prompts, max_new_tokens=6)
    host = _gen(CacheConfig(mode="host", tuning=t, **kw), prompts, max_new_tokens=6)
    xla = _gen(CacheConfig(mode="host", implementation="xla", **kw), prompts, max_new_tokens=6)
    assert host.tokens == res.tokens == xla.tokens


def _prefill(plan, tokens, lengths):
    kv, summ = engine.init_kv(plan), engine.init_summaries(plan)
    x = engine.embed_prompt(plan, PARAMS, tokens)
    for layer in range(CFG.num_layers):
        x, kv, summ, _ = engine.prefill_layer(plan, PARAMS["layers"][layer], jnp.int32(layer),
                                              x, lengths, kv, summ)
    return kv, summ


def _layer0_query(tokens, positions):
    """Layer 0's queries [B, T, Hq, D] (they depend on the tokens only, not on attention)."""
    x = llama.embed(PARAMS, CFG, tokens)
    return llama.attention_inputs(PARAMS["layers"][0], CFG, x, positions)[1]


@pytest.mark.parametrize("interval", [2, 3])
def test_pages_are_held_between_selections(interval):
    """Layer 0, one step per round: a request selects what the exact rule selects (the step's
    query on the updated summaries) at its first step, at multiples of the interval and at
    page boundaries, and keeps its held pages otherwise."""
    ps = 4
    cache = CacheConfig(mode="resident", page_size=ps, selected_pages=3, round_steps=1,
                        selection_interval=interval)
    lens = [len(p) for p in PROMPTS]
    plan = make_plan(CFG, cache, lens, NEW, num_stop=1)
    tokens = np.zeros((len(lens), plan.prompt_len), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    lengths = jnp.asarray(lens, jnp.int32)
    kv, summ = _prefill(plan, jnp.asarray(tokens), lengths)
    assert (np.asarray(summ[2]) == -1).all()
    sel = dict(k=plan.k, page_size=ps, num_sink_pages=cache.sink_pages)
    last = jnp.asarray([5, 6, 7], jnp.int32)
    st = engine.start_state(plan, kv, summ, np.asarray(lengths), np.asarray(last),
                            jax.random.key(0))
    held = np.full((len(lens), CFG.num_kv_heads, plan.k), -1)
    pos = np.asarray(lengths)
    refreshed = held_steps = 0
    for step in range(7):
        q = _layer0_query(st.last_token[:, None], jnp.asarray(pos)[:, None])[:, 0]
        st, toks, steps = engine.decode_round(plan, PARAMS, st, Sampling.make(),
                                              jnp.full((1,), -1, jnp.int32), jnp.int32(NEW))
        kmax, kmin, got = st.summaries
        exact = np.asarray(quest.quest_select(q, kmax, kmin, 0, jnp.asarray(pos) + 1, **sel))
        for b in range(len(lens)):
            if step == 0 or pos[b] % interval == 0 or pos[b] % ps == 0:
                held[b] = exact[b]
                refreshed += 1
            else:
                held_steps += 1
        np.testing.assert_array_equal(np.asarray(got[0]), held)
        pos = pos + 1
    assert refreshed and held_steps


def test_a_context_continued_with_another_interval():
    """A context kept from a call with one interval continues with another (or none): its
    held pages are not carried over (the first step selects anew)."""
    base = dict(mode="host", page_size=4, selected_pages=3)
    r = jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=4, stop_tokens=[], keep=True,
                       cache=CacheConfig(selection_interval=4, **base))
    more = [list(RNG.integers(3, CFG.vocab_size, 5)) for _ in PROMPTS]
    for interval in (1, 2, 4):
        r2 = jaxkv.generate(CFG, PARAMS, more, max_new_tokens=3, stop_tokens=[], keep=True,
                            context=r.context, cache=CacheConfig(selection_interval=interval,
                                                                 **base))
        assert [len(t) for t in r2.tokens] == [3] * len(PROMPTS)
        assert len(r2.context.summaries) == 2 + (interval > 1)


# --- the kernels' row masks ----------------------------------------------------------------

def test_topk_row_mask_skips_only_masked_requests():
    rng = _rng()
    B, H, N, k = 3, 2, 200, 12
    scores = rng.normal(size=(B, H, N)).astype(np.float32)
    lens = np.array([N * 4, 333, 57], np.int32)
    mask = np.array([True, False, True])
    scores[1] = np.nan  # a skipped request's scores are never read
    kw = dict(num_pages=N, k=k, page_size=4, num_sink_pages=1, interpret=True)
    want = np.asarray(topk.select_top_pages_pallas(jnp.asarray(np.nan_to_num(scores)), lens, **kw))
    got = np.asarray(topk.select_top_pages_pallas(jnp.asarray(scores), lens, row_mask=mask, **kw))
    np.testing.assert_array_equal(got[mask], want[mask])
    with pytest.raises(ValueError, match="row_mask must be"):
        topk.select_top_pages_pallas(jnp.asarray(scores), lens, row_mask=mask[:2], **kw)


def _mass_case(rng, B=3, H=2, G=3, Np=12, ps=16, D=16, C=5, L=2):
    keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
    scales = (rng.random((L, B, H, Np, ps)) * 0.1).astype(np.float32)
    q = rng.normal(size=(B, G * H, D)).astype(np.float32)
    positions = np.array([Np * ps - 1, 77, 30][:B], np.int32)
    cand = np.full((B, H, C), -1, np.int32)
    for b, p in enumerate(positions):
        for h in range(H):
            pick = rng.permutation(p // ps + 1)[:C]
            cand[b, h, :len(pick)] = pick
    return q, keys, scales, cand, positions


def test_candidate_mass_row_mask_skips_only_masked_requests():
    rng = _rng()
    q, keys, scales, cand, positions = _mass_case(rng)
    mask = np.array([False, True, True])
    poisoned = scales.copy()
    poisoned[:, 0] = np.nan  # a skipped request's keys are never read
    kw = dict(interpret=True)
    m0, l0 = cm.page_stats_pallas(q, keys, scales, 1, cand, positions, **kw)
    m1, l1 = cm.page_stats_pallas(q, keys, poisoned, 1, cand, positions, row_mask=mask, **kw)
    for a, b in ((m0, m1), (l0, l1)):
        np.testing.assert_array_equal(np.asarray(a)[mask], np.asarray(b)[mask])


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_candidate_select_keeps_held_pages(impl):
    rng = _rng()
    B, H, C, G, k, ps, Np = 3, 2, 10, 3, 4, 4, 40
    seq_lens = np.array([150, 37, 90], np.int32)
    cand = np.stack([np.stack([rng.permutation(-(-s // ps))[:C] for _ in range(H)])
                     for s in seq_lens]).astype(np.int32)
    m = rng.normal(size=(B, H, C, 16)).astype(np.float32)
    l = (rng.random((B, H, C, 16)) * 9 + 1).astype(np.float32)
    m[..., G:], l[..., G:] = np.nan, np.nan
    held = rng.integers(0, 9, size=(B, H, k)).astype(np.int32)
    mask = np.array([True, False, True])
    kw = dict(G=G, k=k, page_size=ps, num_pages=Np, num_sink_pages=1, implementation=impl)
    want = np.asarray(cs.candidate_select(m, l, cand, seq_lens, **kw))
    mp, lp = m.copy(), l.copy()
    mp[1], lp[1] = np.nan, np.nan  # a held request's statistics are never read
    got = np.asarray(cs.candidate_select(mp, lp, cand, seq_lens, held=held, row_mask=mask, **kw))
    np.testing.assert_array_equal(got[mask], want[mask])
    np.testing.assert_array_equal(got[1], held[1])
    with pytest.raises(ValueError, match="go together"):
        cs.candidate_select(m, l, cand, seq_lens, held=held, **kw)
    with pytest.raises(ValueError, match="held must be"):
        cs.candidate_select(m, l, cand, seq_lens, held=held[..., :2], row_mask=mask, **kw)


@pytest.mark.parametrize("impl,method", [("pallas", "pallas"), ("pallas", "pallas_cmax"),
                                         ("pallas", "sort"), ("xla", "sort")])
def test_quest_row_mask_updates_every_request(impl, method):
    """Every request's summaries are updated; an unmasked request's pages are the plain
    call's (a masked one's are unspecified)."""
    rng = _rng()
    L, B, Np, H, D, G, ps, k = 2, 3, 64, 2, 16, 2, 4, 5
    kmax = rng.normal(size=(L, B, Np, H, D)).astype(np.float32)
    kmin = kmax - rng.random((L, B, Np, H, D)).astype(np.float32)
    q = rng.normal(size=(B, G * H, D)).astype(np.float32)
    positions = np.array([200, 101, 36], np.int32)
    k_new = rng.normal(size=(B, H, D)).astype(np.float32)
    mask = np.array([True, False, True])
    kw = dict(k=k, page_size=ps, num_sink_pages=1, implementation=impl, topk_method=method,
              cmax_min_pages=1)
    call = functools.partial(quest.quest_update_select, q, layer=1, seq_lens=positions + 1,
                             k_new=k_new, positions=positions, **kw)
    a = call(kmax=jnp.asarray(kmax), kmin=jnp.asarray(kmin))
    b = call(kmax=jnp.asarray(kmax), kmin=jnp.asarray(kmin), row_mask=mask)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    np.testing.assert_array_equal(np.asarray(a[2])[mask], np.asarray(b[2])[mask])


def test_row_masked_kernels_lower_for_gpu(no_interpret):
    """Each kernel with its row mask is still one Triton call (Qwen-like B=8 at 128k)."""
    S = jax.ShapeDtypeStruct
    B, H, Np, C, k = 8, 2, 2048, 128, 16
    mask = S((B,), jnp.bool_)
    txt = lower_for_h200(lambda s, n, r: topk.select_top_pages_pallas(
        s, n, num_pages=Np, k=C, page_size=64, num_sink_pages=1, row_mask=r),
        S((B, H, Np), jnp.float32), S((B,), jnp.int32), mask)
    assert txt.count("__gpu$xla.gpu.triton") == 1
    txt = lower_for_h200(lambda q, kk, sc, c, p, r: cm.page_stats_pallas(
        q, kk, sc, 1, c, p, row_mask=r),
        S((B, 14, 64), jnp.float32), S((2, B, H, Np, 64, 64), jnp.int8),
        S((2, B, H, Np, 64), jnp.float32), S((B, H, C), jnp.int32), S((B,), jnp.int32), mask)
    assert txt.count("__gpu$xla.gpu.triton") == 1
    fn = functools.partial(cs.candidate_select_pallas, G=7, k=k, page_size=64, num_pages=Np,
                           num_sink_pages=1)
    stat = S((B, H, C, 16), jnp.float32)
    txt = lower_for_h200(lambda m, l, c, s, h, r: fn(m, l, c, s, held=h, row_mask=r), stat, stat,
                         S((B, H, C), jnp.int32), S((B,), jnp.int32), S((B, H, k), jnp.int32),
                         mask)
    assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gpu_interval_host_equals_resident_and_kernels_equal_xla():
    """On the GPU: the two-stage selector with a selection interval, kernels and XLA forms,
    host tier (churning pool) == resident, token for token."""
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2, num_layers=3)
    params = llama.init_params(cfg, seed=0)
    rng = np.random.default_rng(8)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (700, 333, 1025)]
    kw = dict(max_new_tokens=40, stop_tokens=[])
    base = CacheConfig(selector="quest_rescore8", page_size=64, selected_pages=4,
                       selection_interval=8)
    res = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(base, mode="resident"),
                         **kw)
    host = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
        base, mode="host", pool_pages=3 * (2 * 4 + 2), strict=True), **kw)
    xla = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
        base, mode="resident", implementation="xla"), **kw)
    assert host.tokens == res.tokens == xla.tokens and host.stats["misses"] > 0
