"""Selector.fold: a continued context's appended tokens folded into the summaries at once
equal the tokens folded one by one by update_select (the base class's fold)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheConfig, engine
from jaxkv.kernels import quest
from jaxkv.models import configs, llama
from jaxkv.selectors.base import Selector, fold_pages

SELECTORS = ("quest", "quest_rescore", "quest_rescore8", "indexer", "oracle", "dense")


def _plan(selector, cfg, ps=4, max_context=64, B=3):
    mode = "resident" if selector == "oracle" else "host"
    cache = CacheConfig(mode=mode, selector=selector, page_size=ps, selected_pages=2)
    return engine.Plan(model=cfg, cache=cache, batch=B, prompt_len=max_context,
                       max_context=max_context, num_stop=1)


def _random_summaries(plan, rng):
    """The selector's empty summaries filled with random values of their dtypes (a cached
    context's state); int8 page bounds (the two-stage selectors' default) as a prefill
    leaves them: random float bounds quantized (each page's scale the power of two of its
    largest |bound|)."""
    init = plan.selector.init(plan)
    out = []
    if plan.cache.bounds_int8:
        mx = rng.normal(size=init[0].shape).astype(np.float32)
        mn = mx - rng.random(size=mx.shape).astype(np.float32)
        out += list(quest.quantize_bounds(jnp.asarray(mx), jnp.asarray(mn)))
    for a in init[len(out):]:
        if jnp.issubdtype(a.dtype, jnp.integer):
            out.append(jnp.asarray(rng.integers(-127, 128, a.shape), a.dtype))
        else:
            out.append(jnp.asarray(rng.normal(size=a.shape), a.dtype))
    return tuple(out)


@pytest.mark.parametrize("selector", SELECTORS)
def test_fold_equals_tokens_one_by_one(selector):
    cfg = configs.tiny()
    if selector == "indexer":
        cfg = configs.with_indexer(cfg, heads=2, dim=8)
    plan = _plan(selector, cfg)
    rng = np.random.default_rng(7)
    params = llama.init_params(cfg, seed=3)
    layer = jnp.int32(1)
    lp = params["layers"][1]
    B, T, H, D = plan.batch, 11, cfg.num_kv_heads, cfg.head_dim
    # request 0 starts mid-page, request 1 at a page's start, request 2 is padding past 5
    start = np.array([6, 8, 21], np.int32)
    count = np.array([T, T, 5], np.int32)
    t = np.arange(T)
    positions = np.where(t[None] < count[:, None], start[:, None] + t[None], -1).astype(np.int32)
    h = jnp.asarray(rng.normal(size=(B, T, cfg.d_model)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(B, T, cfg.num_heads, D)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, T, 2, H, D)), jnp.float32)
    summ = _random_summaries(plan, rng)
    got = plan.selector.fold(plan, summ, layer, lp, h, q, kv, jnp.asarray(positions))
    want = Selector.fold(plan.selector, plan, summ, layer, lp, h, q, kv,
                         jnp.asarray(positions))
    assert len(got) == len(want) == len(summ)
    for g, w in zip(got, want):
        if selector == "indexer":  # page sums: the order of the additions differs
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fold_pages_numpy():
    """fold_pages against a numpy loop: offset 0 restarts a page, -1 changes nothing."""
    rng = np.random.default_rng(0)
    L, B, Np, ps, D, T = 2, 2, 6, 4, 3, 9
    arr = rng.normal(size=(L, B, Np, D)).astype(np.float32)
    vals = rng.normal(size=(B, T, D)).astype(np.float32)
    positions = np.array([[3, 4, 5, 6, 7, 8, 9, 10, 11], [16, 17, -1, 18, 19, 20, 21, 22, 24]],
                         np.int32)  # 24: page 6 >= Np, dropped
    for combine, f in (("max", np.maximum), ("min", np.minimum), ("add", np.add)):
        want = arr.copy()
        for b in range(B):
            for i in range(T):
                p = positions[b, i]
                if p < 0 or p // ps >= Np:
                    continue
                cur = want[1, b, p // ps]
                want[1, b, p // ps] = vals[b, i] if p % ps == 0 else f(cur, vals[b, i])
        got = fold_pages(jnp.asarray(arr), jnp.int32(1), jnp.asarray(vals),
                         jnp.asarray(positions), ps, combine)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
