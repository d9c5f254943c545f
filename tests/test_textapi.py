"""Text in, text out (jaxkv.load, text and chat prompts, stop strings, finish reasons,
log-probabilities, streaming text) and kept contexts (continued chats, forks), on the tiny
Qwen2 checkpoint of tests/fixtures (random weights: its text is arbitrary bytes)."""
import re
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxkv
import jaxkv.text
from jaxkv import CacheConfig, Sampling
from dense_reference import reference_logits

FIXTURE = Path(__file__).parent / "fixtures" / "hf_qwen2"
NEW = 12
# one cache shape for most tests (compiled once): pages of 4 tokens, a budget that covers
# the contexts here (quest then selects every page: equal to one long prompt)
QUEST = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=32, round_steps=8,
                    max_context=128)


@pytest.fixture(scope="module")
def model():
    return jaxkv.load(FIXTURE, compile_cache=False)


def _gen(model, prompts, cache=QUEST, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return jaxkv.generate(model, prompts, cache=cache, **kw)


def test_load_returns_a_bundle(model):
    assert isinstance(model, jaxkv.Model)
    cfg, params, tok = model
    assert cfg is model.config and tok is model.tokenizer and model.chat_template
    assert model.path == str(FIXTURE) and repr(model).endswith(f"path={str(FIXTURE)!r})")


def test_load_names_the_file_of_a_model_name(monkeypatch):
    """A model name (or None, the packaged default) loads a file: ``path`` names it."""
    from jaxkv.models import gguf_loader
    from jaxkv.models.tokenizer import Tokenizer
    seen = []   # the files the weights are read from (stand-ins: nothing is read)
    tiny = jaxkv.models.tiny()
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda p, **kw: seen.append(p) or (tiny, None))
    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(
        lambda cls, p: type("Tok", (), {"vocab_size": tiny.vocab_size})()))
    for name in (None, "smollm2-135m"):
        m = jaxkv.load(name, compile_cache=False)
        assert m.path == str(gguf_loader.default_model_path())
    assert seen == [gguf_loader.default_model_path()] * 2


def test_text_round_trip(model):
    tok = model.tokenizer
    r = _gen(model, "The capital of France is")
    ids = tok.encode("The capital of France is")
    ref = jaxkv.generate(model.config, model.params, [ids], cache=QUEST, max_new_tokens=NEW,
                         stop_tokens=tok.stop_ids)
    assert r.tokens == ref.tokens and ref.text is None
    assert r.text == [tok.decode(r.tokens[0], skip_special_tokens=True)]
    assert r.finish_reasons[0] in ("length", "stop_token")
    assert len(r.finish_reasons) == 1


def test_chat_messages_use_the_template(model):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    r = _gen(model, [msgs, "plain text"])
    ids = model.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = jaxkv.generate(model.config, model.params, [ids], cache=QUEST, max_new_tokens=NEW,
                         stop_tokens=model.tokenizer.stop_ids)
    assert r.tokens[0] == ref.tokens[0] and len(r.text) == 2


@pytest.mark.parametrize("msg, match", [
    ({"role": "user", "content": None}, r"prompt 0, message 0 \(user\): 'content' must be a str"),
    ({"role": "user", "text": "hi"}, r"message 0 \(user\): 'content' is missing"),
    ({"content": "hi"}, r"message 0: 'role' must be a non-empty str"),
])
def test_bad_chat_messages(model, msg, match):
    """A chat message without a str content or role gets an early error naming the prompt
    and the message (a template would render None as "None" or a missing content as "")."""
    with pytest.raises(ValueError, match=match):
        _gen(model, [msg])
    tool = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}
    jaxkv.text.check_chat([{"role": "user", "content": "hi"}, tool], 0)  # tool calls: no content


def test_a_chat_message_is_not_a_request(model):
    """One message dict given as the prompts or as one request of a batch gets an error
    showing a chat's shape, not the token-id check's 'shape ()'."""
    msg = {"role": "user", "content": "hi"}
    with pytest.raises(ValueError, match=r"^prompts is one chat message \(a dict\): a chat is a list"):
        _gen(model, msg)
    with pytest.raises(ValueError, match=r"^prompt 1 is one chat message \(a dict\)"):
        _gen(model, [[msg], msg])


def test_load_arguments():
    """load's device by platform name, and early errors naming a bad path, device or
    compile_cache."""
    m = jaxkv.load(FIXTURE, compile_cache=False, device="cpu")
    assert {d.platform for leaf in jax.tree.leaves(m.params) for d in leaf.devices()} == {"cpu"}
    with pytest.raises(ValueError, match=r"device 'tpu': JAX has no such platform here"):
        jaxkv.load(FIXTURE, compile_cache=False, device="tpu")
    with pytest.raises(TypeError, match="device must be a jax.Device, a platform name"):
        jaxkv.load(FIXTURE, compile_cache=False, device=0)
    with pytest.raises(ValueError, match="device is an empty string"):  # not the default
        jaxkv.load(FIXTURE, compile_cache=False, device="")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        jaxkv.load(123, compile_cache=False)
    with pytest.raises(ValueError, match="path is empty"):
        jaxkv.load("", compile_cache=False)
    with pytest.raises(TypeError, match="compile_cache must be None"):
        jaxkv.load(FIXTURE, compile_cache=123)


def test_load_dtype_objects():
    """load's dtype: a dtype object of float32 / bfloat16 loads as that name (np.dtype compares
    equal to its name, so an unconverted one would reach ModelConfig); others name dtype."""
    import jax.numpy as jnp
    for dt, name in ((np.float32, "float32"), (np.dtype(jnp.bfloat16), "bfloat16"),
                     (jnp.bfloat16, "bfloat16")):
        m = jaxkv.load(FIXTURE, compile_cache=False, dtype=dt)
        assert m.config.dtype == name
        assert {leaf.dtype.name for leaf in jax.tree.leaves(m.params)} == {name}
    for dt in ("float16", jnp.float16, np.int8):
        with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\)"):
            jaxkv.load(FIXTURE, compile_cache=False, dtype=dt)
    with pytest.raises(TypeError, match="dtype must be one of"):
        jaxkv.load(FIXTURE, compile_cache=False, dtype=3)


def test_tokenizer_refuses_batches_and_foreign_ids(model):
    """decode takes one sequence (a batch is an error, not one joined string); the streaming
    detokenizer refuses ids outside the vocabulary as decode does; apply_chat_template checks
    its messages as generate does."""
    tok = model.tokenizer
    for batch in ([[71, 72], [73, 74]], [[71, 72], [73]], np.array([[71, 72], [73, 74]])):
        with pytest.raises(TypeError, match="one sequence of token ids"):
            tok.decode(batch)
    assert tok.decode(iter([71, 72])) == tok.decode(np.array([71, 72])) == tok.decode((71, 72))
    assert tok.decode([[71, 72]]) == tok.decode(np.array([[71, 72]])) == tok.decode([71, 72])
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        jaxkv.text.Detokenizer(tok).add([99999])
    with pytest.raises(ValueError, match=r"message 0 \(user\): 'content' must be a str"):
        tok.apply_chat_template([{"role": "user", "content": None}])
    with pytest.raises(TypeError, match="messages must be a list of dicts"):
        tok.apply_chat_template(m for m in [{"role": "user", "content": "hi"}])


def test_prompts_by_keyword(model):
    """generate(model, prompts=...) with a Model: its params, as with the prompts in place."""
    assert jaxkv.generate(model, prompts="Hi", cache=QUEST, max_new_tokens=2).tokens == \
        _gen(model, "Hi", max_new_tokens=2).tokens


def test_finish_reasons_stop_token_and_length(model):
    base = _gen(model, "Once upon a time", stop_tokens=[])
    assert base.finish_reasons == ["length"] and len(base.tokens[0]) == NEW
    stop = base.tokens[0][4]
    r = _gen(model, "Once upon a time", stop_tokens=[stop])
    first = base.tokens[0].index(stop)
    assert r.tokens[0] == base.tokens[0][:first + 1] and r.finish_reasons == ["stop_token"]
    # the text leaves the stop token out (a regular token here: skipping specials would not),
    # streamed alike
    want = model.tokenizer.decode(base.tokens[0][:first], skip_special_tokens=True)
    assert r.text == [want]
    for mode in (True, "step"):
        st = _gen(model, "Once upon a time", stop_tokens=[stop], stream=mode)
        assert "".join(c.text[0] for c in st) == want and st.result.text == [want]
    # a stop string that the stop token's text completes still ends the text before it
    dec = lambda ids: model.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    j = next(j for j in range(1, NEW) if base.tokens[0][j] not in base.tokens[0][:j]
             and len(dec(base.tokens[0][:j + 1])) > len(dec(base.tokens[0][:j])) > 0
             and "\ufffd" not in dec(base.tokens[0][:j + 1]))
    before, full = dec(base.tokens[0][:j]), dec(base.tokens[0][:j + 1])
    span = full[len(before) - 1:len(before) + 1]
    for mode in (False, True):
        r = _gen(model, "Once upon a time", stop_tokens=[base.tokens[0][j]], stop_strings=[span],
                 stream=mode)
        if mode:
            streamed = "".join(c.text[0] for c in r)
            r = r.result
            assert streamed == r.text[0]
        assert r.text == [full[:full.find(span)]] and r.finish_reasons == ["stop_string"]


def test_stop_strings_cut_text_and_tokens(model):
    tok = model.tokenizer
    base = _gen(model, ["Once upon a time", "Hello"], stop_tokens=[])
    text = base.text[0]
    cut = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    s = text[cut:cut + 2]
    want = text[:text.find(s)]
    r = _gen(model, ["Once upon a time", "Hello"], stop_tokens=[], stop_strings=[s])
    assert r.text[0] == want and r.finish_reasons[0] == "stop_string"
    m = len(r.tokens[0])
    assert r.tokens[0] == base.tokens[0][:m]
    assert s in tok.decode(r.tokens[0]) and s not in tok.decode(r.tokens[0][:-1])
    # the other request runs on, unless the string is in its text too
    if s not in base.text[1]:
        assert r.tokens[1] == base.tokens[1] and r.finish_reasons[1] == "length"
    # streamed text: the same, never past the stop string
    # and the streamed ids and logprobs are the result's, none past the cut
    for mode in (True, "step"):
        st = _gen(model, ["Once upon a time", "Hello"], stop_tokens=[], stop_strings=[s],
                  stream=mode, logprobs=True)
        chunks = list(st)
        assert "".join(c.text[0] for c in chunks) == want and st.result.text == r.text
        for b in range(2):
            assert [t for c in chunks for t in c[b]] == st.result.tokens[b] == r.tokens[b]
            assert [v for c in chunks for v in c.logprobs[b]] == st.result.logprobs[b]
            assert len(st.result.logprobs[b]) == len(r.tokens[b])
        if mode == "step":
            assert all(any(c) for c in chunks)   # no item without a token


def test_stop_strings_of_special_tokens(model):
    """The text leaves special tokens out, so a stop string holding one never matches: a
    string that is one stop token's text is left to that token (the same result as without
    it); one whose token does not stop the request, or with text around it, is refused before
    any work, naming the stop ids to pass."""
    tok = model.tokenizer
    im_end = tok.encode("<|im_end|>", add_bos=False)[-1]
    eot = tok.encode("done<|endoftext|>", add_bos=False)[-1]
    assert im_end in tok.stop_ids and eot in tok.stop_ids
    want = _gen(model, "Hi", stop_strings=["x"])
    got = _gen(model, "Hi", stop_strings=["x", "<|im_end|>"])
    assert got.tokens == want.tokens and got.text == want.text
    for stop, stop_tokens, tid, ids in (
            ("<|im_end|>", [eot], im_end, sorted({eot, im_end})),
            ("done<|endoftext|>", None, eot, sorted(set(tok.stop_ids)))):
        with pytest.raises(ValueError, match=(
                rf"stop_strings\[1\] '{re.escape(stop)}' holds the special token '.*' "
                rf"\(id {tid}\).*stop_tokens={re.escape(str(ids))}")):
            _gen(model, "Hi", stop_strings=["x", stop], stop_tokens=stop_tokens)


def test_sampled_tokens_do_not_depend_on_the_batch(model):
    """Each request draws with its own key: alone with seed s + b it gives what it gives as
    request b of a batch with seed s; prompts permuted with their seeds give permuted tokens."""
    S = Sampling(temperature=1.0)
    prompts = ["Hello there", "A much longer prompt than the first one is here", "Third"]
    kw = dict(stop_tokens=[], sampling=S)
    batch = _gen(model, prompts, seed=5, **kw)
    for b, p in enumerate(prompts):
        assert _gen(model, p, seed=5 + b, **kw).tokens[0] == batch.tokens[b]
    perm = [2, 0, 1]
    permuted = _gen(model, [prompts[i] for i in perm], seed=[5 + i for i in perm], **kw)
    assert permuted.tokens == [batch.tokens[i] for i in perm]
    # it samples: the requests' seeds differ, so the same prompt twice differs
    twice = _gen(model, ["Hello there"] * 2, seed=5, **kw)
    assert twice.tokens[0] == batch.tokens[0] and twice.tokens[1] != twice.tokens[0]
    with pytest.raises(ValueError, match=r"seed: a sequence needs one seed per request \(3\), got 2"):
        _gen(model, prompts, seed=[1, 2], **kw)
    with pytest.raises(ValueError, match=r"seed\[1\] must be an int >= 0"):
        _gen(model, prompts[:2], seed=[1, -2], **kw)


def test_logprobs_of_the_chosen_tokens(model):
    cfg, params, tok = model
    prompt = tok.encode("Logprobs of greedy tokens")
    r = jaxkv.generate(model, [prompt], cache=QUEST, max_new_tokens=NEW, stop_tokens=[],
                       logprobs=True)
    lp = np.asarray(r.logprobs[0])
    assert lp.shape == (NEW,) and np.all(lp <= 0)
    logits = reference_logits(params, cfg, prompt + r.tokens[0][:-1])[len(prompt) - 1:]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = ref[np.arange(NEW), r.tokens[0]]
    np.testing.assert_allclose(lp, want, atol=2e-3)


def test_streaming_text_per_round_and_per_step(model):
    r = _gen(model, "Stream me", stop_tokens=[])
    st = _gen(model, "Stream me", stop_tokens=[], stream=True)
    chunks = list(st)
    assert all(isinstance(c.text, list) for c in chunks)
    assert [t for c in chunks for t in c[0]] == r.tokens[0]
    assert "".join(c.text[0] for c in chunks) == r.text[0] == st.result.text[0]
    steps = list(_gen(model, "Stream me", stop_tokens=[], stream="step"))
    assert [len(c[0]) for c in steps if c[0]] == [1] * NEW   # one token per item
    assert "".join(c.text[0] for c in steps) == r.text[0]


def test_text_needs_a_tokenizer(model):
    with pytest.raises(TypeError, match="jaxkv.load"):
        jaxkv.generate(model.config, model.params, ["some text"], max_new_tokens=2)
    with pytest.raises(ValueError, match="stop_strings"):
        _gen(model, "x", stop_strings=[""])


def test_on_round_reports_per_round_stats(model):
    seen = []
    r = _gen(model, ["Observe the rounds"], stop_tokens=[], on_round=seen.append)
    assert seen == r.rounds and len(seen) == r.stats["decode_rounds"] >= 1
    for key in ("hits", "misses", "hit_rate", "bytes_host_to_device", "tokens_per_s",
                "context_tokens", "steps"):
        assert key in seen[0]
    assert sum(x["hits"] for x in seen) == r.stats["hits"]
    assert sum(x["new_tokens"] for x in seen) == NEW - 1  # the first token comes from prefill
    # the decode time is the rounds', not the caller's (a slow callback, a paused stream)
    slow = _gen(model, ["Observe the rounds"], stop_tokens=[], on_round=lambda d: time.sleep(0.3))
    st = _gen(model, ["Observe the rounds"], stop_tokens=[], stream=True)
    for _ in st:
        time.sleep(0.3)
    for res in (slow, st.result):
        assert len(res.rounds) >= 2
        assert res.stats["decode_time_s"] < sum(x["time_s"] for x in res.rounds) + 0.25
    # what the caller compiles is the caller's: not this call's compilations, nor subtracted
    # from its decode time
    compiling = _gen(model, ["Observe the rounds"], stop_tokens=[],
                     on_round=lambda d: jax.jit(lambda x: x + d["round"])(1.0))
    assert compiling.stats["num_compilations"] == st.result.stats["num_compilations"] == 0
    assert compiling.stats["decode_time_s"] > 0


# ----------------------------------------------------------------------------- contexts

@pytest.mark.parametrize("cache", [
    QUEST,
    CacheConfig(mode="resident", selector="quest", page_size=4, selected_pages=32, round_steps=8,
                    max_context=128),
    CacheConfig(mode="host", selector="dense", page_size=4, round_steps=8,
                max_context=128),
    CacheConfig(mode="resident", selector="dense", page_size=4, round_steps=8,
                max_context=128),
], ids=["host-quest", "resident-quest", "host-dense", "resident-dense"])
def test_continued_chat_equals_one_long_prompt(model, cache):
    cfg, params, tok = model
    p1 = tok.encode("A long shared document about cats.")
    p2 = tok.encode(" Question: what about dogs?", add_bos=False)
    r1 = jaxkv.generate(model, [p1], cache=cache, max_new_tokens=NEW, stop_tokens=[], keep=True)
    ctx = r1.context
    assert list(ctx.tokens[0]) == p1 + r1.tokens[0] and ctx.cached[0] == len(p1) + NEW - 1
    r2 = jaxkv.generate(model, [p2], cache=cache, max_new_tokens=NEW, stop_tokens=[],
                        context=ctx, keep=True)
    long = jaxkv.generate(model, [p1 + r1.tokens[0] + p2], cache=cache, max_new_tokens=NEW,
                          stop_tokens=[], keep=True)
    assert r2.tokens == long.tokens
    assert r2.stats["reused_context_tokens"] == len(p1) + NEW - 1
    # the appended turn is prefilled: the decode rounds run the generated tokens only
    assert sum(x["steps"] for x in r2.rounds) == NEW - 1
    # and it leaves the cache and the summaries one long prompt leaves
    for a, b in zip(_arrays(r2.context), _arrays(long.context)):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2,
                                   atol=2e-2)
    # a third turn continues the second
    p3 = tok.encode(" And birds?", add_bos=False)
    r3 = jaxkv.generate(model, [p3], cache=cache, max_new_tokens=NEW, stop_tokens=[],
                        context=r2.context)
    long3 = jaxkv.generate(model, [p1 + r1.tokens[0] + p2 + r2.tokens[0] + p3], cache=cache,
                           max_new_tokens=NEW, stop_tokens=[])
    assert r3.tokens == long3.tokens


def _arrays(ctx):
    return [np.array(jax.device_get(a)) for a in jax.tree.leaves((ctx.kv_pages, ctx.summaries))]


def test_forks_are_isolated(model):
    tok = model.tokenizer
    doc = tok.encode("The document: " + "lorem ipsum " * 6)
    questions = [" Q1: first?", " Q2: second one?", " Q3: third."]
    r = _gen(model, [doc], stop_tokens=[], keep=True)
    ctx = r.context
    before = _arrays(ctx)
    forks = _gen(model, questions, stop_tokens=[], context=ctx, keep=True)
    assert forks.stats["batch"] == 3
    # each fork equals that question asked alone of the same context
    for i, q in enumerate(questions):
        alone = _gen(model, [q], stop_tokens=[], context=ctx)
        assert alone.tokens[0] == forks.tokens[i]
    # the context is unchanged; poisoning a fork's pages changes no other call
    for a, b in zip(before, _arrays(ctx)):
        np.testing.assert_array_equal(a, b)
    poisoned = forks.context
    import dataclasses
    nan = jax.device_put(np.full(poisoned.kv_pages.shape, np.nan, poisoned.kv_pages.dtype),
                         poisoned.kv_pages.sharding)
    poisoned = dataclasses.replace(poisoned, kv_pages=nan)
    assert poisoned.kv_pages.unsafe_buffer_pointer() != ctx.kv_pages.unsafe_buffer_pointer()
    bad = _gen(model, [" Q4", " Q5"], stop_tokens=[], context=poisoned.select(0, 1))
    again = _gen(model, questions[1:2], stop_tokens=[], context=ctx)
    assert again.tokens[0] == forks.tokens[1] and bad.tokens[0] != again.tokens[0]
    sel = _gen(model, [" next", " other"], stop_tokens=[], context=forks.context.select(2, 0))
    assert len(sel.tokens) == 2


@pytest.mark.parametrize("block", [1, 2])
def test_continued_context_through_the_first_stage(model, block):
    """The two-stage selector with float bounds and a first stage that chooses (8 of 32 pages,
    in blocks of ``block`` pages): a context kept after its prompt alone continues like the
    conversation sent as one prompt, tokens and every cache and summary array. (A context with decoded
    tokens differs from one prompt when the selection is sparse: decode steps attend to the
    selected pages, a prompt to every token.)"""
    cache = CacheConfig(mode="host", selector="quest_rescore", page_size=4, selected_pages=3,
                        candidate_pages=8, candidate_block=block, round_steps=8,
                        max_context=128, bounds_dtype="float")   # int8: the next test
    cfg, params, tok = model
    p1 = tok.encode("A long shared document about cats and their habits.")
    p2 = tok.encode(" Question: what about dogs?", add_bos=False)
    r1 = jaxkv.generate(model, [p1], cache=cache, max_new_tokens=1, stop_tokens=[], keep=True)
    r2 = jaxkv.generate(model, [p2], cache=cache, max_new_tokens=NEW, stop_tokens=[],
                        context=r1.context, keep=True)
    long = jaxkv.generate(model, [p1 + r1.tokens[0] + p2], cache=cache, max_new_tokens=NEW,
                          stop_tokens=[], keep=True)
    assert r2.tokens == long.tokens
    for a, b in zip(_arrays(r2.context), _arrays(long.context)):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2,
                                   atol=2e-2)


def test_continued_context_int8_bounds(model):
    """Quest's bounds in int8 (the two-stage selectors' default) with a first stage that
    chooses: a continued context folds its turn into the bounds as decode steps do, where one
    long prompt quantizes each page once (and shifts the keys by its own mean). The host tier continues it as resident
    does, token for token, and its bounds (dequantized, the shift added back) lie within two
    quanta of the long prompt's."""
    cfg, params, tok = model
    p1 = tok.encode("A long shared document about cats and their habits.")
    p2 = tok.encode(" Question: what about dogs?", add_bos=False)
    runs = {}
    for mode in ("host", "resident"):
        cache = CacheConfig(mode=mode, selector="quest_rescore", page_size=4, selected_pages=3,
                            candidate_pages=8, round_steps=8, max_context=128,
                            bounds_dtype="int8")
        r1 = jaxkv.generate(model, [p1], cache=cache, max_new_tokens=1, stop_tokens=[],
                            keep=True)
        runs[mode] = jaxkv.generate(model, [p2], cache=cache, max_new_tokens=NEW,
                                    stop_tokens=[], context=r1.context, keep=True)
    assert runs["host"].tokens == runs["resident"].tokens
    long = jaxkv.generate(model, [p1 + r1.tokens[0] + p2], cache=cache, max_new_tokens=NEW,
                          stop_tokens=[], keep=True)
    n = (len(p1) + 1 + len(p2)) // 4  # whole pages of the conversation before decoding
    got, want = ([np.asarray(jax.device_get(a)) for a in c.summaries[:4]]
                 for c in (runs["resident"].context, long.context))
    assert got[0].dtype == np.int8 and got[2].dtype == np.float32
    deq = lambda s, i: (s[i][:, :, :n].astype(np.float32) * s[2][:, :, :n, :, None]  # noqa: E731
                        + s[3][:, :, None])
    quantum = np.maximum(got[2], want[2])[:, :, :n, :, None]
    assert np.all(np.abs(deq(got, 0) - deq(want, 0)) <= 2 * quantum)
    assert np.all(np.abs(deq(got, 1) - deq(want, 1)) <= 2 * quantum)


def test_continued_chat_messages(model):
    cache = CacheConfig(mode="host", selector="dense", page_size=4, round_steps=8,
                max_context=128)
    msgs = [{"role": "user", "content": "Hi"}]
    r1 = _gen(model, [msgs], cache=cache, keep=True)
    r2 = _gen(model, [[{"role": "user", "content": "Again"}]], cache=cache, context=r1.context,
              keep=True)
    tok = model.tokenizer
    conv = list(r2.context.tokens[0])
    assert conv[:len(r1.context.tokens[0])] == list(r1.context.tokens[0])
    assert "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n" in tok.decode(conv)
    assert r2.context.messages[0][-2] == {"role": "user", "content": "Again"}
    # a text turn ends the chat's history: a later chat turn is refused, saying why
    r3 = _gen(model, [" plain text"], cache=cache, context=r2.context, keep=True,
              max_new_tokens=2)
    with pytest.raises(ValueError, match="a text or token-id turn continued it, which ends"):
        _gen(model, [[{"role": "user", "content": "More"}]], cache=cache, context=r3.context)


def test_continued_chat_after_an_empty_reply_ends_its_turn(model):
    """A reply that is only the stop token (empty text), whitespace, or cut by its length:
    the next chat turn appends what the template puts after the reply (ChatML's
    ``<|im_end|>\n``, less a stop token generated), so the conversation's tokens are the
    template's for the whole conversation (with the reply as generated)."""
    tok = model.tokenizer
    user, new = [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Again"}]
    head = tok.apply_chat_template(user, add_generation_prompt=True)
    turn = "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    im_end = tok.encode("<|im_end|>", add_bos=False)
    for text, stop in (("", im_end), ("Hello there", im_end), ("Hello there", []),
                       ("  ", im_end)):
        reply = (tok.encode(text, add_bos=False) if text else []) + stop
        hist = user + [{"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)}]
        got = tok.encode(head, add_bos=False) + reply + jaxkv.text.encode_turns(
            tok, hist, reply, new, 0)
        assert tok.decode(got) == head + text + "<|im_end|>\n" + turn
        if text == text.strip():   # the template trims a reply's whitespace
            assert got == tok.apply_chat_template(hist + new, tokenize=True)


def test_context_errors(model):
    r = _gen(model, ["one", "two"], keep=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="select"):
        _gen(model, ["a", "b", "c"], context=r.context)
    with pytest.raises(ValueError, match="page_size"):
        _gen(model, ["a", "b"], context=r.context,
             cache=CacheConfig(mode="host", selector="quest", page_size=8, round_steps=8))
    with pytest.raises(TypeError, match="keep=True"):
        _gen(model, ["a"], context="not a context")
    with pytest.raises(ValueError, match=r"CacheConfig kv_dtype='float32', this call uses "
                                         r"'int8' \(None resolves to the model's dtype\)"):
        _gen(model, ["a", "b"], context=r.context,
             cache=CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=32,
                               round_steps=8, max_context=128, kv_dtype="int8"))


def test_context_reuse_stats(model):
    """prefill_time_saved_s: the reused tokens at the context's own prefill rate, less the
    copy (compilation is compile_time_s, not a negative saving)."""
    r = _gen(model, ["one two three"], keep=True, max_new_tokens=2)
    s = _gen(model, ["four"], context=r.context, max_new_tokens=2).stats
    reused = s["reused_context_tokens"]
    assert reused == len(r.context.tokens[0]) - 1 and s["appended_tokens"] >= 1
    want = reused / r.context.prefill_tokens_per_s - s["context_copy_time_s"]
    assert s["prefill_time_saved_s"] == pytest.approx(want)


def test_stop_string_then_continue(model):
    tok = model.tokenizer
    base = _gen(model, ["Once upon a time"], stop_tokens=[])
    text = base.text[0]
    cut = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    r = _gen(model, ["Once upon a time"], stop_tokens=[], stop_strings=[text[cut:cut + 2]],
             keep=True)
    ctx = r.context
    assert list(ctx.tokens[0]) == tok.encode("Once upon a time") + r.tokens[0]
    assert ctx.cached[0] <= len(ctx.tokens[0])
    more = _gen(model, [" The end."], stop_tokens=[], context=ctx)
    assert len(more.tokens[0]) == NEW
    if ctx.cached[0] == len(ctx.tokens[0]):
        with pytest.raises(ValueError, match="no token left to feed"):
            _gen(model, [[]], context=ctx)


@pytest.mark.parametrize("selector", ["quest", "quest_rescore8"])
def test_continued_context_grows_with_lagged_selection_and_dense_layers(model, selector):
    """The continuation outgrows the context's capacity (256 -> 512 tokens: the pages are
    laid out anew), with lagged selection (its ``ahead`` pages copied) and a dense layer
    (its device copy copied); the two-stage selector's key copy is laid out per KV head."""
    cfg, params, tok = model
    cache = CacheConfig(mode="host", selector=selector, page_size=4, selected_pages=128,
                        selection_lag=1, dense_layers=1, round_steps=8)
    p1 = tok.encode("Short start.")
    r1 = jaxkv.generate(model, [p1], cache=cache, max_new_tokens=4, stop_tokens=[], keep=True)
    assert r1.context.plan.max_context == 256
    rng = np.random.default_rng(0)
    p2 = [int(t) for t in rng.integers(3, 300, 250)]
    r2 = jaxkv.generate(model, [p2], cache=cache, max_new_tokens=4, stop_tokens=[],
                        context=r1.context)
    assert r2.stats["max_context"] == 512
    long = jaxkv.generate(model, [p1 + r1.tokens[0] + p2], cache=cache, max_new_tokens=4,
                          stop_tokens=[])
    assert r2.tokens == long.tokens


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_continued_context_host_equals_resident(model, kv_dtype):
    """With quantized KV (int8: keys shifted; fp8: keys rotated) a continued turn writes its
    tokens as decoding does and attends to the stored pages: the host tier and the resident
    pool give the same tokens, with the default two-stage selector."""
    tok = model.tokenizer
    p1 = tok.encode("A document about the sea, " * 8)
    p2 = tok.encode(" Now a question about fish?", add_bos=False)
    got = {}
    for mode in ("host", "resident"):
        cache = CacheConfig(mode=mode, page_size=4, selected_pages=8, round_steps=8,
                            kv_dtype=kv_dtype, max_context=256)
        r1 = jaxkv.generate(model, [p1], cache=cache, max_new_tokens=4, stop_tokens=[],
                            keep=True)
        r2 = jaxkv.generate(model, [p2], cache=cache, max_new_tokens=NEW, stop_tokens=[],
                            context=r1.context)
        got[mode] = (r1.tokens, r2.tokens)
    assert got["host"] == got["resident"]


def test_detokenizer_never_splits_a_character(model):
    from jaxkv.text import Detokenizer

    class Bytes:          # a tokenizer without a `tokenizers` backend: one token per byte
        def decode(self, ids, skip_special_tokens=False):
            return bytes(ids).decode("utf-8", errors="replace")

    d = Detokenizer(Bytes())
    pieces = [d.add([b]) for b in "né ✓".encode()]
    assert "".join(pieces) == "né ✓" and "\ufffd" not in "".join(pieces)
    assert pieces[:3] == ["n", "", "é"]  # the first byte of "é" waits for the second
    tok = model.tokenizer   # the `tokenizers` streaming decoder
    ids = tok.encode("héllo wörld ✓")
    d = Detokenizer(tok)
    assert "".join(d.add([i]) for i in ids) == tok.decode(ids)
