"""End-to-end tests of jaxkv.generate on the tiny model (CPU)."""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, Sampling, Tuning, engine
from jaxkv.models import configs, llama
from jaxkv.kernels import _common, dense_select, quest
from dense_reference import reference_greedy

CFG = configs.tiny()
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng(1234)
PROMPTS = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (37, 21, 50)]
NEW = 12


def _gen(cache, prompts=PROMPTS, **kw):
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("stop_tokens", [])
    return jaxkv.generate(CFG, PARAMS, prompts, cache=cache, **kw)


@pytest.fixture(scope="module")
def resident_quest():
    return _gen(CacheConfig(mode="resident", selector="quest", page_size=4, selected_pages=4))


@pytest.mark.parametrize("schedule", ["step", "scratch", "layer"])
def test_host_equals_resident_with_large_pool(resident_quest, schedule):
    host = _gen(CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4,
                            schedule=schedule))
    assert host.tokens == resident_quest.tokens
    s = host.stats
    assert s["dropped"] == 0 and s["misses"] > 0 and s["hits"] > 0
    page_bytes = 2 * CFG.num_kv_heads * 4 * CFG.head_dim * 4
    assert s["bytes_host_to_device"] == (s["pages_fetched"] * page_bytes
                                         + s["host_reads"] * page_bytes // CFG.num_kv_heads)
    # "step" reads misses in place (one head's part of a page each) and installs them later
    assert (s["host_reads"] == s["misses"]) if schedule == "step" else (s["host_reads"] == 0)
    assert all(len(t) == NEW for t in host.tokens)


@pytest.mark.parametrize("schedule,pool", [("layer", 3 * (2 * 4 + 2)), ("step", 3 * (2 * 4 + 2)),
                                           ("step", 6), ("scratch", 6)])
def test_host_equals_resident_with_churning_small_pool(resident_quest, schedule, pool):
    # a step needs at most H*k + pinned = 2*4 + 2 pages per request; the context has up to 16.
    # Per-step scheduling reads misses in place from the host ("step") or from scratch rows
    # ("scratch"), so even a tiny pool is exact.
    cache = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4,
                        pool_pages=pool, schedule=schedule, strict=(pool > 6))
    host = _gen(cache)
    assert host.tokens == resident_quest.tokens
    assert host.stats["evictions"] > 0
    if pool > 6:
        assert host.stats["dropped"] == 0


def test_no_cache_baseline_fetches_every_selected_page(resident_quest):
    host = _gen(CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4,
                            reuse=False))
    assert host.tokens == resident_quest.tokens
    assert host.stats["hits"] == 0 and host.stats["host_reads"] == host.stats["misses"] > 0


def test_dense_selector_equals_independent_reference():
    res = _gen(CacheConfig(mode="host", selector="dense", page_size=8), max_new_tokens=8)
    for p, toks in zip(PROMPTS, res.tokens):
        assert toks == reference_greedy(PARAMS, CFG, p, 8)


def test_too_small_pool_counts_drops_and_strict_raises():
    # Per-head selection: the 2 heads share the sink and the current page and pick 3 pages
    # each, so a step may need 8 distinct pages; the pool has 7 (= k + pinned, the minimum).
    cache = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=5, pool_pages=7,
                        schedule="layer")
    res = _gen(cache, prompts=PROMPTS[2:], max_new_tokens=8)
    assert res.stats["dropped"] > 0
    with pytest.raises(RuntimeError, match="strict mode"):
        _gen(dataclasses.replace(cache, strict=True), prompts=PROMPTS[2:], max_new_tokens=8)
    with pytest.raises(ValueError, match="pool_pages"):
        _gen(dataclasses.replace(cache, pool_pages=6), prompts=PROMPTS[2:], max_new_tokens=8)


@pytest.mark.parametrize("mode,max_context,new,piece", [("resident", None, NEW, 16),
                                                        ("host", 52, 2, 32)])
def test_prefill_in_token_pieces_equals_one_piece(mode, max_context, new, piece):
    """prefill_token_chunk below the prompt bucket: the per-token work runs in pieces. The
    bucket is 64 tokens (4 pieces of 16), or 52 with max_context=52 (2 pieces of 32, the
    second padded)."""
    kw = dict(mode=mode, selector="quest", page_size=4, selected_pages=4, max_context=max_context)
    one = _gen(CacheConfig(**kw), max_new_tokens=new)
    pieces = _gen(CacheConfig(**kw, prefill_token_chunk=piece), max_new_tokens=new)
    assert pieces.stats["prompt_bucket"] == (64 if max_context is None else 52)
    assert pieces.tokens == one.tokens


def test_in_token_chunks_pads_a_bucket_that_is_not_a_multiple():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 40, 3)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    fn = lambda x, p: (x * 2.0, x.sum(-1) + p)  # noqa: E731  (per-token work)
    whole = fn(x, pos)
    for chunk in (16, 32, 64):
        got = engine._in_token_chunks(fn, chunk, x, pos)
        assert [g.shape for g in got] == [w.shape for w in whole]
        for g, w in zip(got, whole):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@contextlib.contextmanager
def _compiled_programs():
    """The names of the programs XLA compiles inside the block (a ``jax.monitoring`` listener
    on the backend-compile event)."""
    names = []

    def listen(event, _, **kw):
        if event.endswith("backend_compile_duration"):
            names.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_no_recompilation_for_new_prompts_temperature_and_length():
    cache = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4,
                        round_steps=8)  # a plan no other test compiles
    with _compiled_programs() as names:
        first = _gen(cache, sampling=Sampling.make(temperature=0.7, top_k=20, top_p=0.9), seed=1)
    assert first.stats["num_compilations"] > 0
    # one program per layer loop: the first layer's input is committed as the others' are
    assert names.count("jit(prefill_layer)") == 1 and names.count("jit(_decode_round)") == 1, names
    prompts2 = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (40, 33, 45)]  # same bucket
    again = _gen(cache, prompts=prompts2, max_new_tokens=NEW - 3,
                 sampling=Sampling.make(temperature=1.3, top_k=5, top_p=0.5), seed=2)
    assert again.stats["num_compilations"] == 0, again.stats
    greedy = _gen(cache, prompts=prompts2, max_new_tokens=NEW + 2)
    assert greedy.stats["num_compilations"] == 0, greedy.stats
    # another cache configuration of the same model and prompts: the embedding and the first
    # token's programs are the model's, not the plan's
    with _compiled_programs() as names:
        _gen(dataclasses.replace(cache, selected_pages=3, round_steps=4), prompts=prompts2,
             max_new_tokens=NEW + 2)
    assert "jit(_first_token)" not in names and "jit(_embed)" not in names, names
    assert names.count("jit(prefill_layer)") == 1 and names.count("jit(_decode_round)") == 1, names


def test_stop_tokens_end_requests_early():
    res = _gen(CacheConfig(mode="resident", selector="dense", page_size=8), max_new_tokens=10)
    stop = res.tokens[0][3]
    res2 = _gen(CacheConfig(mode="resident", selector="dense", page_size=8), max_new_tokens=10,
                stop_tokens=[stop])
    assert res2.tokens[0][-1] == stop and len(res2.tokens[0]) <= 4


def test_streaming_yields_rounds_and_matches():
    cache = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4, round_steps=4)
    stream = _gen(cache, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 3
    joined = [sum((c[i] for c in chunks), []) for i in range(len(PROMPTS))]
    assert joined == stream.result.tokens


def test_sampling_is_seeded_and_valid():
    cache = CacheConfig(mode="resident", selector="dense", page_size=8)
    s = Sampling.make(temperature=1.0, top_k=10)
    a = _gen(cache, sampling=s, seed=5)
    b = _gen(cache, sampling=s, seed=5)
    assert a.tokens == b.tokens
    assert all(0 <= t < CFG.vocab_size for row in a.tokens for t in row)


@pytest.mark.parametrize("cmax_min_pages", [None, 1])
def test_pallas_kernels_end_to_end_interpret(resident_quest, monkeypatch, cmax_min_pages):
    """The decode loop with every op on its Pallas kernel (interpret mode on CPU); with
    ``Tuning(topk_cmax_min_pages=1)`` Quest takes the chunk-maxima top-k at this size, so the
    summary update runs inside the scores kernel (``quest_update_select``)."""
    if cmax_min_pages is not None:
        fused = []
        monkeypatch.setitem(_common._REGISTRY[quest.OP_UPDATE_CMAX], "pallas", _spy(
            quest.quest_update_scores_cmax_pallas, fused))
    tuning = Tuning(topk_cmax_min_pages=cmax_min_pages)
    host = _gen(CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4,
                            implementation="pallas", tuning=tuning), max_new_tokens=4)
    assert [t[:4] for t in resident_quest.tokens] == host.tokens
    if cmax_min_pages is not None:
        assert fused, "the fused update + scores kernel was not traced"


def _spy(fn, calls):
    def wrapped(*a, **kw):
        calls.append(1)
        return fn(*a, **kw)
    return wrapped


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["quest", "dense"])
def test_gpu_host_equals_resident(selector):
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2, num_layers=3)
    params = llama.init_params(cfg, seed=0)
    prompts = [list(RNG.integers(3, cfg.vocab_size, n)) for n in (300, 170, 513)]
    kw = dict(max_new_tokens=24, stop_tokens=[])
    base = CacheConfig(selector=selector, page_size=16, selected_pages=6)
    res = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(base, mode="resident"), **kw)
    small = None if selector == "dense" else 3 * (2 * 6 + 2)
    host = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
        base, mode="host", pool_pages=small, strict=True), **kw)
    assert host.tokens == res.tokens
    if selector == "dense":
        xla = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
            base, mode="resident", implementation="xla"), **kw)
        agree = np.mean([a == b for x, y in zip(xla.tokens, res.tokens) for a, b in zip(x, y)])
        assert agree > 0.9  # bf16: kernels and references may differ in rounding


def test_materialize_qk_gives_the_same_tokens():
    """``Tuning.materialize_qk`` only changes how XLA fuses the projections: the same tokens
    with the two-stage selector's first stage at work (blocks of two), host tier and resident."""
    prompts = [list(RNG.integers(3, CFG.vocab_size, n)) for n in (120, 70)]
    base = CacheConfig(mode="host", page_size=4, selected_pages=3, candidate_block=2,
                       max_context=256)
    plain = _gen(dataclasses.replace(base, tuning=Tuning(materialize_qk=False)), prompts)
    barrier = _gen(base, prompts)   # None: on for the two-stage selectors
    resident = _gen(dataclasses.replace(base, mode="resident"), prompts)
    assert barrier.tokens == plain.tokens == resident.tokens
    quest = dataclasses.replace(base, selector="quest", candidate_block=1)
    assert (_gen(dataclasses.replace(quest, tuning=Tuning(materialize_qk=True)), prompts).tokens
            == _gen(quest, prompts).tokens)
    with pytest.raises(ValueError, match="materialize_qk must be None"):
        Tuning(materialize_qk="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("changes", [{}, dict(candidate_block=4),
                                     dict(tuning=jaxkv.Tuning(topk_method="radix"))],
                         ids=["per-page", "block4", "radix"])
def test_gpu_two_stage_host_equals_resident(changes):
    """The default two-stage selector with its first stage at work (contexts past its 48
    candidate pages): per page, per block of 4 pages, and with the radix top-k. The host tier
    with a small pool gives the resident cache's tokens on the GPU's kernels."""
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2, num_layers=3,
                       max_position=4096)
    params = llama.init_params(cfg, seed=0)
    prompts = [list(RNG.integers(3, cfg.vocab_size, n)) for n in (1500, 900, 2100)]
    kw = dict(max_new_tokens=24, stop_tokens=[])
    base = CacheConfig(page_size=16, selected_pages=6, max_context=4096, **changes)
    res = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(base, mode="resident"),
                         **kw)
    host = jaxkv.generate(cfg, params, prompts, cache=dataclasses.replace(
        base, mode="host", pool_pages=3 * (2 * 6 + 2)), **kw)
    assert host.tokens == res.tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_gpu_continued_context_host_equals_resident(kv_dtype):
    """A kept context continued by a second turn (its tokens prefilled against the pinned
    host tier or the resident pool, the default two-stage selector, a small pool): the same
    tokens in both modes; three requests continue with turns of different lengths."""
    cfg = configs.tiny(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=2, num_layers=3)
    params = llama.init_params(cfg, seed=0)
    prompts = [list(RNG.integers(3, cfg.vocab_size, n)) for n in (300, 170, 513)]
    turns = [list(RNG.integers(3, cfg.vocab_size, n)) for n in (40, 1, 130)]
    kw = dict(max_new_tokens=16, stop_tokens=[])
    base = CacheConfig(page_size=16, selected_pages=6, kv_dtype=kv_dtype)
    got = {}
    for mode, pool in (("resident", None), ("host", 3 * (2 * 6 + 2))):
        cache = dataclasses.replace(base, mode=mode, pool_pages=pool)
        r1 = jaxkv.generate(cfg, params, prompts, cache=cache, keep=True, **kw)
        r2 = jaxkv.generate(cfg, params, turns, cache=cache, context=r1.context, **kw)
        assert sum(x["steps"] for x in r2.rounds) == kw["max_new_tokens"] - 1
        got[mode] = (r1.tokens, r2.tokens)
    assert got["host"] == got["resident"]


@pytest.mark.parametrize("mode", ["host", "resident"])
def test_dense_first_layers(mode):
    """dense_layers=1: layer 0 attends to every page, layer 1 uses Quest. Host == resident;
    dense_layers=L equals the dense selector."""
    cache = CacheConfig(mode=mode, selector="quest", page_size=4, selected_pages=4, dense_layers=1,
                        pool_pages=12 if mode == "host" else None)
    res = _gen(cache, max_new_tokens=8)
    if mode == "host":
        ref = _gen(dataclasses.replace(cache, mode="resident", pool_pages=None), max_new_tokens=8)
        assert res.tokens == ref.tokens
    all_dense = _gen(dataclasses.replace(cache, dense_layers=CFG.num_layers), max_new_tokens=8)
    dense = _gen(CacheConfig(mode="resident", selector="dense", page_size=4), max_new_tokens=8)
    assert all_dense.tokens == dense.tokens
    with pytest.raises(ValueError, match="dense_layers"):
        _gen(dataclasses.replace(cache, dense_layers=CFG.num_layers + 1), max_new_tokens=8)


CFG3 = configs.tiny(num_layers=3)
PARAMS3 = llama.init_params(CFG3, seed=3)


@pytest.mark.parametrize("lag, layers", [(0, (1,)), (1, (-1,))])
def test_dense_layer_set(lag, layers):
    """dense_layers as a set of layers that is not a prefix ((1,) and (-1,) of 3 layers): the
    host tier with a churning pool equals resident, exact and lagged, and the set changes the
    tokens; every layer, named out of order, is the dense selector."""
    def gen(**kw):
        c = dict(mode="resident", selector="quest", page_size=4, selected_pages=3,
                 selection_lag=lag, round_steps=8)
        c.update(kw)
        return jaxkv.generate(CFG3, PARAMS3, PROMPTS, cache=CacheConfig(**c), max_new_tokens=10,
                              stop_tokens=[]).tokens

    res = gen(dense_layers=layers)
    assert gen(mode="host", dense_layers=layers, pool_pages=10) == res
    assert gen() != res
    if lag == 0:
        dense = jaxkv.generate(CFG3, PARAMS3, PROMPTS, max_new_tokens=10, stop_tokens=[],
                               cache=CacheConfig(mode="resident", selector="dense",
                                                 page_size=4)).tokens
        assert gen(mode="host", dense_layers=(2, 0, 1), pool_pages=10) == dense


@pytest.mark.parametrize("layers, match", [((3,), r"names layer\(s\) \[3\]"),
                                           ((0, -3), "names a layer twice"),
                                           ((1, 1), "names a layer twice"),
                                           ((1.0,), "not a layer index"),
                                           ("01", "an int or a tuple of ints"),
                                           (np.array(1.0), r"an int or a tuple of ints, got 1.0"),
                                           (np.array(True), r"an int or a tuple of ints, got True")])
def test_dense_layer_set_bad_input(layers, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(CFG3, PARAMS3, PROMPTS[:1], max_new_tokens=2,
                       cache=CacheConfig(mode="resident", page_size=4, dense_layers=layers))


def test_dense_layers_from_arrays():
    """0-d arrays (numpy or jax) are their int, as np.int64 is; 1-D jax arrays are a tuple of
    layers, as numpy ones are."""
    for v in (np.array(2), jnp.array(2), np.int64(2)):
        assert CacheConfig(dense_layers=v).dense_layers == 2
    for v in (np.array([0, -1]), jnp.array([0, -1]), [np.array(0), jnp.array(-1)]):
        assert CacheConfig(dense_layers=v) == CacheConfig(dense_layers=(0, -1))


def test_indexer_selector_host_equals_resident():
    """The learned-indexer selector end to end: host tier (churning pool) == resident."""
    cfg = configs.with_indexer(CFG, heads=4, dim=16)
    params = llama.init_params(cfg, seed=3)
    base = dict(selector="indexer", page_size=4, selected_pages=3)
    runs = [jaxkv.generate(cfg, params, PROMPTS, max_new_tokens=8, stop_tokens=[], cache=c)
            for c in (CacheConfig(mode="resident", **base),
                      CacheConfig(mode="host", pool_pages=3 * 6, **base))]
    assert runs[0].tokens == runs[1].tokens
    assert all(len(t) == 8 for t in runs[1].tokens)
    assert runs[1].stats["misses"] > 0 and runs[1].stats["dropped"] == 0
