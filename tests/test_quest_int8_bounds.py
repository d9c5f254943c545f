"""Quest's page bounds in int8 with a scale per page and KV head (``CacheConfig.bounds_dtype``):
the quantization rules against numpy, the bounds staying bounds, the scores kernel (interpret
mode) against its XLA form and reference, and the selectors end to end."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig
from jaxkv.kernels import quest
from tests.test_oracle import CFG, PARAMS, PROMPTS


def _rng():
    return np.random.default_rng(np.random.SeedSequence().entropy)


# numpy references of the two rules (float32; the scale a power of two, so every product exact)
def _np_scale(amax):
    amax = np.asarray(amax, np.float32)
    p = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-38) / 127.0)))
    p = np.where(amax / p > 127, p * 2, np.where(amax / (p / 2) <= 127, p / 2, p))  # log2 rounding
    return np.maximum(p, np.float32(2.0 ** -100)).astype(np.float32)


def _np_quantize(mx, mn):
    mx, mn = np.float32(mx), np.float32(mn)
    s = _np_scale(np.maximum(np.abs(mx), np.abs(mn)).max(-1))
    lim = lambda x: np.clip(x, -127, 127).astype(np.int8)  # noqa: E731
    return lim(np.ceil(mx / s[..., None])), lim(np.floor(mn / s[..., None])), s


def _np_requantize(mq, nq, s, kn, first):
    mq, nq, kn = np.float32(mq), np.float32(nq), np.float32(kn)
    first = np.broadcast_to(first, s.shape)
    kabs = np.abs(kn).max(-1)
    s2 = np.where(first | (kabs > 127 * s), _np_scale(kabs), s).astype(np.float32)
    mx = np.where(first[..., None], kn, np.maximum(mq * s[..., None], kn))
    mn = np.where(first[..., None], kn, np.minimum(nq * s[..., None], kn))
    return (np.clip(np.ceil(mx / s2[..., None]), -127, 127),
            np.clip(np.floor(mn / s2[..., None]), -127, 127), s2)


def test_quantize_and_requantize_match_numpy():
    rng = _rng()
    mx = rng.normal(size=(5, 3, 16)).astype(np.float32) * 4
    mn = mx - np.abs(rng.normal(size=mx.shape)).astype(np.float32)
    mx[0, 0] = 0.0  # an all-zero row: scale 2**-100, bounds 0
    mn[0, 0] = 0.0
    for got, want in zip(quest.quantize_bounds(jnp.asarray(mx), jnp.asarray(mn)),
                         _np_quantize(mx, mn)):
        np.testing.assert_array_equal(np.asarray(got), want)
    mq, nq, s = _np_quantize(mx, mn)
    kn = rng.normal(size=mx.shape).astype(np.float32) * rng.choice([0.5, 4, 20], size=(5, 3, 1))
    first = rng.random(size=(5, 3)) < 0.3
    got = quest.requantize_row(jnp.asarray(mq), jnp.asarray(nq), jnp.asarray(s),
                               jnp.asarray(kn), jnp.asarray(first))
    for g, w in zip(got, _np_requantize(mq, nq, s, kn, first)):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_decoded_bounds_stay_bounds_and_fold_twice_is_a_no_op():
    """Tokens folded one by one (as decode steps do, from stale pages): the dequantized bounds
    hold every token of their page (max above, min below, exactly), sit within a few quanta
    of the exact ones, and folding a token again changes nothing (what lets every
    program of the scores kernel recompute the row)."""
    rng = _rng()
    L, B, Np, H, D, ps, layer = 2, 2, 6, 2, 16, 4, 1
    T = Np * ps
    keys = rng.normal(size=(B, T, H, D)).astype(np.float32) * 3
    keys[:, 5] *= 8  # a token that widens its page's range mid-page
    kq = jnp.asarray(rng.integers(-127, 128, size=(L, B, Np, H, D)), jnp.int8)  # stale
    sc = jnp.asarray(np.abs(rng.normal(size=(L, B, Np, H))), jnp.float32)
    bounds = (kq, kq, sc)
    for t in range(T):
        pos = jnp.full((B,), t, jnp.int32)
        bounds = quest.quest_update(*bounds[:2], layer, jnp.asarray(keys[:, t]), pos,
                                    page_size=ps, scale=bounds[2])
        again = quest.quest_update(*bounds[:2], layer, jnp.asarray(keys[:, t]), pos,
                                   page_size=ps, scale=bounds[2])
        for a, b in zip(again, bounds):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mx, mn = quest.dequantize_bounds(*(a[layer] for a in bounds))
    kp = keys.reshape(B, Np, ps, H, D)
    tmax, tmin = kp.max(2), kp.min(2)
    assert np.all(np.asarray(mx) >= tmax) and np.all(np.asarray(mn) <= tmin)
    quantum = np.asarray(bounds[2][layer])[..., None]
    assert np.all(np.asarray(mx) - tmax <= 3 * quantum)
    assert np.all(tmin - np.asarray(mn) <= 3 * quantum)
    np.testing.assert_array_equal(np.asarray(bounds[0][0]), np.asarray(kq[0]))  # other layer


@pytest.mark.parametrize("G,H,D,Np,chunk,bp,unmasked", [(2, 2, 16, 40, 4, None, False),
                                                        (3, 3, 32, 37, 8, 2, True),
                                                        (7, 2, 16, 64, 4, 4, True)])
def test_update_scores_kernel_int8_matches_xla(G, H, D, Np, chunk, bp, unmasked):
    """The update-and-scores kernel on int8 bounds (interpret mode) == quest_update then the
    XLA scores: the bounds and scale bit for bit, the scores to float32 rounding and equal to
    the literal reference's (dequantized bounds). The scale past each sequence and in the
    other layer is NaN: never read, never written. Positions: a page's first token,
    mid-page, inactive and one past the last page. With and without the keys' shift."""
    _check_kernel(G, H, D, Np, chunk, bp, unmasked, ps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("G,H,Np", [(6, 2, 8192), (4, 8, 8192)])
def test_gpu_update_scores_kernel_int8_matches_xla(G, H, Np):
    """The same on the GPU's Triton kernel at the 128k shapes (Qwen-like: 2 KV heads of 6
    query heads; 8B-like: 8 of 4), 16-token pages."""
    _check_kernel(G, H, 128, Np, 64, None, True, ps=16)


def _check_kernel(G, H, D, Np, chunk, bp, unmasked, *, ps):
    for shifted in (False, True):
        _check_kernel_once(G, H, D, Np, chunk, bp, unmasked, ps=ps, shifted=shifted)


def _check_kernel_once(G, H, D, Np, chunk, bp, unmasked, *, ps, shifted):
    rng = _rng()
    L, layer = 2, 1
    positions = np.array([rng.integers(1, Np) * ps, rng.integers(0, Np * ps - 1) | 1, -1,
                          Np * ps], np.int32)
    seq_lens = np.maximum(positions + 1, 1)
    B = len(positions)
    mx = rng.normal(size=(L, B, Np, H, D)).astype(np.float32)
    mn = mx - np.abs(rng.normal(size=mx.shape)).astype(np.float32)
    kmax, kmin, scale = (np.asarray(a) for a in quest.quantize_bounds(mx, mn))
    scale = scale.copy()
    scale[1 - layer] = np.nan
    for b in range(B):
        scale[layer, b, -(-seq_lens[b] // ps):] = np.nan
    q = jnp.asarray(rng.normal(size=(B, H * G, D)), jnp.bfloat16)
    k_new = jnp.asarray(rng.normal(size=(B, H, D)) * rng.choice([1, 30]), jnp.bfloat16)
    args = (q, jnp.asarray(kmax), jnp.asarray(kmin), jnp.int32(layer), jnp.asarray(seq_lens),
            k_new, jnp.asarray(positions))
    kw = dict(scale=jnp.asarray(scale))
    if shifted:  # the keys' shift: a large common component, as a K bias gives
        kw["shift"] = jnp.asarray(rng.normal(size=(L, B, H, D)) * 10, jnp.float32)
    got = quest.quest_update_scores_cmax_pallas(*args, page_size=ps, chunk=chunk, block_pages=bp,
                                                unmasked=unmasked, **kw)
    want = quest.quest_update_scores_cmax_xla(*args, page_size=ps, chunk=chunk, **kw)
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    ref = quest.quest_scores_reference(q, *want[2:4], jnp.int32(layer), jnp.asarray(seq_lens),
                                       page_size=ps, scale=want[4])
    for s in (got[0][..., :Np], want[0][..., :Np]):
        np.testing.assert_allclose(np.asarray(s), np.asarray(ref), rtol=1e-5, atol=1e-4)
    n = want[1].shape[-1]  # the kernel pads its chunks further
    np.testing.assert_allclose(np.asarray(got[1])[..., :n], np.asarray(want[1]), rtol=1e-5,
                               atol=1e-4)
    assert np.all(np.isnan(np.asarray(got[4][1 - layer])))


def test_int8_bounds_scores_bound_the_dot_products():
    """Quest's scores from int8 bounds are upper bounds of every token's summed group dot
    product, like the float bounds' (to float32 rounding)."""
    rng = _rng()
    B, T, H, G, D, ps = 2, 64, 2, 3, 32, 8
    keys = rng.normal(size=(B, T, H, D)).astype(np.float32) * 2
    mx, mn = quest.quest_summarize(jnp.asarray(keys), ps, jnp.array([T, T]))
    kmax, kmin, scale = quest.quantize_bounds(mx, mn)
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    s = np.asarray(quest.quest_scores_xla(jnp.asarray(q), kmax[None], kmin[None], 0,
                                          jnp.array([T, T]), page_size=ps, scale=scale[None]))
    qk = np.einsum("bhgd,bthd->bht", q.reshape(B, H, G, D), keys).reshape(B, H, T // ps, ps)
    assert np.all(s >= qk.max(-1) - 1e-4 * (1 + np.abs(qk).max()))


def test_bounds_dtype_end_to_end():
    """``CacheConfig(bounds_dtype="int8")`` with Quest and the two-stage selector: host tier ==
    resident token for token (Pallas kernels in interpret mode, and XLA), the Pallas and XLA
    implementations the same tokens, lagged selection (all layers at once) running."""
    _check_end_to_end()


@pytest.mark.gpu
def test_gpu_bounds_dtype_end_to_end():
    """The same with the GPU's kernels."""
    _check_end_to_end()


def _check_end_to_end():
    kw = dict(page_size=4, selected_pages=3, bounds_dtype="int8")
    gen = lambda **c: jaxkv.generate(CFG, PARAMS, PROMPTS, max_new_tokens=6,  # noqa: E731
                                     stop_tokens=[], cache=CacheConfig(**kw, **c))
    for sel in (dict(selector="quest"),
                dict(selector="quest_rescore8", candidate_pages=6, candidate_pieces=2)):
        res = gen(mode="resident", implementation="pallas", **sel)
        assert gen(mode="host", implementation="pallas", **sel).tokens == res.tokens, sel
        assert gen(mode="resident", implementation="xla", **sel).tokens == res.tokens, sel
    lag = gen(mode="resident", selector="quest", selection_lag=1)
    assert gen(mode="host", selector="quest", selection_lag=1).tokens == lag.tokens


def test_bounds_dtype_fold_equals_decode():
    """A continued context's turn folds its tokens into the int8 bounds at once, bit for bit
    what decode steps folding them one by one (quest_update) give: turns that continue a
    page and start new ones, keys that grow a page's scale mid-turn (and ones that do not),
    tiny keys, padding, a layer other than 0 (the others untouched)."""
    from jaxkv import selectors
    from jaxkv.api import make_plan
    plan = make_plan(CFG, CacheConfig(mode="resident", selector="quest", page_size=4,
                                      selected_pages=3, bounds_dtype="int8"), [16, 10], 12, 2)
    sel = selectors.get("quest")
    rng = _rng()
    H, D = CFG.num_kv_heads, CFG.head_dim
    layer = CFG.num_layers - 1
    k = jnp.asarray(rng.normal(size=(2, 16, H, D)), jnp.float32)
    k = k + 5.0  # a common component: the shift (the prompt's mean key) takes it
    summ = sel.fill(plan, sel.init(plan), layer, None, None, k, None, jnp.array([14, 10]))
    assert len(summ) == 4 and summ[0].dtype == jnp.int8
    np.testing.assert_allclose(np.asarray(summ[3][layer, 1]), np.asarray(k[1, :10].mean(0)),
                               rtol=1e-5, atol=1e-5)
    T = 9
    pos = jnp.array([[14 + t for t in range(T)], [10, 11, 12, 13, 14, 15, 16, -1, -1]],
                    jnp.int32)
    for trial in range(4):
        kv = rng.normal(size=(2, T, 2, H, D)).astype(np.float32) + 5.0
        mag = rng.choice([1e-30, 0.5, 1.0, 3.0, 40.0], size=(2, T, 1, H, 1))
        kv = jnp.asarray(kv * mag if trial else kv, jnp.float32)
        folded = sel.fold(plan, summ, layer, None, None, None, kv, pos)
        one = summ
        for t in range(T):
            one = quest.quest_update(*one[:2], layer, kv[:, t, 0], pos[:, t], page_size=4,
                                     scale=one[2], shift=summ[3]) + (summ[3],)
        for a, b in zip(folded, one):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if trial:
            assert (np.asarray(folded[2]) != np.asarray(summ[2])).any()   # scales grew


def test_bounds_dtype_errors():
    with pytest.raises(ValueError, match="bounds_dtype must be one of"):
        CacheConfig(bounds_dtype="int4")
    for v in ("int8", "float"):
        with pytest.raises(ValueError, match="leave bounds_dtype=None"):
            CacheConfig(selector="oracle", mode="resident", bounds_dtype=v)


def test_bounds_dtype_default():
    """``None`` is int8 for the two-stage selectors (``CacheConfig()``'s), float for Quest;
    the other selectors keep no bounds; a given value wins."""
    assert CacheConfig().bounds_int8
    for sel in ("quest_rescore", "quest_rescore_exact"):
        assert CacheConfig(selector=sel).bounds_int8
    assert not CacheConfig(selector="quest").bounds_int8
    assert not CacheConfig(bounds_dtype="float").bounds_int8
    assert CacheConfig(selector="quest", bounds_dtype="int8").bounds_int8
    for sel in ("dense", "oracle"):
        assert not CacheConfig(selector=sel, mode="resident").bounds_int8
    from jaxkv.api import make_plan
    plan = make_plan(CFG, CacheConfig(page_size=4, selected_pages=3), [20], 4, 1)
    assert len(plan.selector.init(plan)) == 6       # (kmax, kmin, scale, shift) + the key copy


@pytest.mark.parametrize("L,B,Np,H,G,D", [(4, 8, 8212, 2, 6, 128), (4, 1, 8212, 8, 4, 128)])
def test_int8_bounds_update_select_lowers_for_gpu(no_interpret, L, B, Np, H, G, D):
    """Quest's decode step for one layer on int8 bounds with the keys' shift (Qwen-like B=8 and
    8B-like B=1 at 128k in 16-token pages) lowers to Triton: the update-and-scores kernel and
    the top-k kernel, no scatter or sort left in XLA."""
    import functools

    from lowering import lower_for_h200
    S = jax.ShapeDtypeStruct
    fn = functools.partial(quest.quest_update_select, k=64, page_size=16, num_sink_pages=1,
                           implementation="pallas")
    b8 = S((L, B, Np, H, D), jnp.int8)
    txt = lower_for_h200(
        lambda q, mx, mn, layer, lens, kn, pos, sc, sh: fn(q, mx, mn, layer, lens, kn, pos,
                                                           scale=sc, shift=sh),
        S((B, H * G, D), jnp.bfloat16), b8, b8, S((), jnp.int32), S((B,), jnp.int32),
        S((B, H, D), jnp.bfloat16), S((B,), jnp.int32), S((L, B, Np, H), jnp.float32),
        S((L, B, H, D), jnp.float32))
    assert txt.count("__gpu$xla.gpu.triton") == 2
    assert "stablehlo.sort" not in txt and "scatter" not in txt


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_int8_quest_selection_matches_numpy(impl):
    """Quest's selection on int8 bounds (the Pallas kernel in interpret mode, and XLA) == a
    numpy reference: the keys less their mean (a large common component, as a K bias gives),
    each page's max / min, :func:`_np_quantize`, the literal Quest bound in float64 from the
    dequantized values, then the selection rule in numpy."""
    from tests.test_selectors import select_rule_numpy
    rng = _rng()
    B, Np, H, G, D, ps, k = 2, 32, 2, 3, 16, 4, 6
    T = Np * ps
    lens = np.array([T - 3, 70], np.int32)
    keys = rng.normal(size=(B, T, H, D)).astype(np.float32) + 8 * rng.normal(size=(1, 1, H, D))
    valid = np.arange(T)[None, :, None, None] < lens[:, None, None, None]
    mu = (keys * valid).sum(1) / valid.sum(1)                                 # [B, H, D]
    kp = (keys - mu[:, None]).reshape(B, Np, ps, H, D)
    vp = valid.reshape(B, Np, ps, 1, 1)
    mx = np.where(vp, kp, -np.inf).max(2)
    mn = np.where(vp, kp, np.inf).min(2)
    empty = ~np.isfinite(mx)
    kq, nq, s = _np_quantize(np.where(empty, 0, mx), np.where(empty, 0, mn))
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    qg = q.reshape(B, H, G, D).astype(np.float64)
    M = (kq * s[..., None]).astype(np.float64)                                # [B, Np, H, D]
    m = (nq * s[..., None]).astype(np.float64)
    scores = np.maximum(qg[:, None] * M[:, :, :, None], qg[:, None] * m[:, :, :, None])
    scores = scores.sum(axis=(3, 4)).transpose(0, 2, 1)                       # [B, H, Np]
    kw = dict(k=k, page_size=ps, num_sink_pages=1)
    want = select_rule_numpy(scores, lens + 1, num_pages=Np, **kw)
    got = quest.quest_select(jnp.asarray(q), jnp.asarray(kq)[None], jnp.asarray(nq)[None], 0,
                             jnp.asarray(lens + 1), implementation=impl,
                             scale=jnp.asarray(s)[None], **kw)
    np.testing.assert_array_equal(np.asarray(got), want)
