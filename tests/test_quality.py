"""The RULER retrieval harness (benchmarks/bench_quality.py, benchmarks/ruler.py) on CPU:
the prepared cases (benchmarks/quality_data) are well-formed and are what RULER's generators
give; the scorer is RULER's metric; a tiny end-to-end run with SmolLM2-135M (dense retrieves;
offloaded Quest equals resident Quest token for token)."""
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_quality  # noqa: E402
import ruler  # noqa: E402

DATA = bench_quality.DEFAULT_DATA


@pytest.fixture(scope="module")
def gguf_path():
    from jaxkv.models import gguf_loader

    try:
        return gguf_loader.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def decoder(gguf_path):
    return bench_quality.VocabDecoder.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    pytest.importorskip("tokenizers")
    from jaxkv.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def full():
    return bench_quality.load_cases(DATA, "full")


def _need_ruler():
    pytest.importorskip("long_context_eval", reason=ruler.INSTALL_HINT)
    pytest.importorskip("yaml")


# ---------------------------------------------------------------------------------------
# (a) the prepared cases
# ---------------------------------------------------------------------------------------
def test_prepared_cases_cover_the_table(full):
    cases, meta = full
    assert meta["generator"].endswith(f"{ruler.PACKAGE}=={ruler.PACKAGE_VERSION}")
    assert meta["seed"] == ruler.SEED and meta["template"] == "chat"
    for task in ruler.TASKS:
        for length in (2048, 4096, 8192):
            got = sorted(c["index"] for c in cases if c["task"] == task and c["length"] == length)
            assert got == list(range(50)), (task, length)
    for c in cases:
        assert c["n_tokens"] == len(c["ids"])
        # RULER's budget: prompt + tokens_to_generate within the target length (SmolLM2's
        # trained context is 8192); its coarse haystack steps leave the prompt below it
        assert c["n_tokens"] + c["max_new_tokens"] <= c["length"], c
        assert c["n_tokens"] >= 0.5 * c["length"], (c["task"], c["length"], c["n_tokens"])
        assert c["max_new_tokens"] == (30 if c["task"] == "vt" else 128)
        assert c["metric"] == "string_match_all"
        assert all(p >= 0 for p in c["answer_tokens"]), c
    n_answers = {t: {len(c["outputs"]) for c in cases if c["task"] == t} for t in ruler.TASKS}
    assert n_answers["niah_single_1"] == n_answers["niah_multikey_3"] == {1}
    assert n_answers["niah_multivalue"] == n_answers["niah_multiquery"] == {4}
    assert n_answers["vt"] == {5}   # one chain of 4 hops: 5 variables


def test_prepared_cases_text(full, decoder):
    """Chat turns intact (the single-needle rewrite 'are' -> 'is' must not reach the system
    prompt), the answers inside the prompt where recorded, RULER's answer prefix last."""
    cases, meta = full
    assert meta["vocab_sha256"] == decoder.vocab_sha256
    for c in cases:
        if c["index"] >= 2:
            continue
        text = decoder.decode(c["ids"], skip_special_tokens=False)
        assert text.startswith(meta["chat_head"]), text[:200]
        tail = text[text.rindex(meta["chat_tail"]) + len(meta["chat_tail"]):]
        if c["task"] == "vt":
            assert tail.startswith(" Answer: According to the chain(s) of variable assignment")
        else:
            assert tail.startswith(" The special magic"), tail
            assert tail.endswith(" mentioned in the provided text " +
                                 ("is" if len(c["outputs"]) == 1 else "are"))
        for ref, pos in zip(c["outputs"], c["answer_tokens"]):
            assert ref in text
            assert ref in decoder.decode(c["ids"][max(0, pos - 2):pos + 48])


def _regenerate(tokenizer, task, length, n):
    return bench_quality.build_cases(tokenizer, tasks=(task,), lengths=(length,), samples=n,
                                     log=lambda *_: None)


def test_cases_are_rulers_deterministic_output_vt(full, tokenizer):
    """Re-running RULER's variable-tracking generator with the recorded seed gives the stored
    cases (the first n cases do not depend on how many are drawn), and the run leaves the
    process as it found it (argv, path, modules, random states)."""
    _need_ruler()
    argv, path = list(sys.argv), list(sys.path)
    py_state, np_state = random.getstate(), np.random.get_state()
    new = _regenerate(tokenizer, "vt", 2048, 2)
    stored = [c for c in full[0] if c["task"] == "vt" and c["length"] == 2048][:2]
    for a, b in zip(new, sorted(stored, key=lambda c: c["index"])):
        assert a["ids"] == b["ids"] and a["outputs"] == b["outputs"]
    assert sys.argv == argv and sys.path == path
    assert "tokenizer" not in sys.modules and "constants" not in sys.modules
    assert random.getstate() == py_state
    assert all(np.array_equal(x, y) for x, y in zip(np.random.get_state()[1:], np_state[1:]))


@pytest.mark.slow
def test_cases_are_rulers_deterministic_output_essay(full, tokenizer):
    """The essay haystack path (NLTK's punkt sentence splitting, wonderwords keys)."""
    _need_ruler()
    pytest.importorskip("nltk")
    new = _regenerate(tokenizer, "niah_single_2", 2048, 1)
    stored = next(c for c in full[0] if c["task"] == "niah_single_2" and c["length"] == 2048
                  and c["index"] == 0)
    assert new[0]["ids"] == stored["ids"] and new[0]["outputs"] == stored["outputs"]


def test_punkt_model_without_download():
    pytest.importorskip("nltk")
    tok = ruler._punkt_tokenizer()
    got = tok.tokenize("Mr. Smith went to Washington D.C. yesterday. He met Dr. Jones. Fine.")
    assert got == ["Mr. Smith went to Washington D.C. yesterday.", "He met Dr. Jones.", "Fine."]


def test_chat_format_markers():
    chat = ruler.ChatFormat("<s>sys: You are kind\n<u>", "</u>\n<a>", "chat")
    t = chat.model_template.format(task_template="Q: {query}?")
    # what RULER's single-needle rewrite does to the whole template
    t = t.replace("Some", "A").replace("are all", "is").replace("are", "is")
    assert chat.expand(t + " A:") == "<s>sys: You are kind\n<u>Q: {query}?</u>\n<a> A:"
    assert ruler.ChatFormat.base().expand("x") == "x"


# ---------------------------------------------------------------------------------------
# (b) scoring = RULER's metric
# ---------------------------------------------------------------------------------------
HAND = [
    (" 1234567.", ["1234567"]),
    ("\n The number is 1234567\x00 and 7654321", ["7654321", "1234567"]),
    ("  the numbers: 111, 222 and 333. ", ["111", "222", "333", "444"]),
    ("AGGRESSIVE-ENVY", ["aggressive-envy"]),
    ("", ["1"]),
    (None, ["1"]),
    ("VAR ABCDE VAR FGHIJ", ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]),
    ("12345", ["123456"]),
]


def test_scorer_matches_ruler_metric():
    _need_ruler()
    from long_context_eval.eval.synthetic import constants as ev

    ours = [ruler.score("string_match_all", p, r) for p, r in HAND]
    assert ours == [1.0, 1.0, 0.75, 1.0, 0.0, 0.0, 0.4, 0.0]
    preds = [ruler.postprocess_pred(p) for p, _ in HAND]
    refs = [r for _, r in HAND]
    assert [100 * x for x in ours] == ev.string_match_all_per_sample(preds, refs)
    assert round(100 * sum(ours) / len(ours), 2) == ev.string_match_all(preds, refs)
    part = [100 * ruler.score("string_match_part", p, r) for p, r in HAND]
    assert part == ev.string_match_part_per_sample(preds, refs)
    assert ruler.postprocess_pred("\t a\x01b \n") == "a\nb"
    for task in ruler.TASKS:   # the tasks' metrics are the ones reimplemented
        assert ruler.task_config(task)["metric"] in ruler.METRICS


def test_vocab_decoder_matches_tokenizer(tokenizer, decoder):
    text = "Passkey 68142 — naïve café “quoted” 日本語\n\ttabs  and  spaces<|im_end|>"
    ids = tokenizer.encode(text)
    assert decoder.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert decoder.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids)
    rnd = np.random.default_rng().integers(0, tokenizer.vocab_size, 3000)
    assert decoder.decode(rnd, skip_special_tokens=False) == tokenizer.decode(rnd)
    assert decoder.stop_ids(tokenizer.eos_id) == list(tokenizer.stop_ids)


# ---------------------------------------------------------------------------------------
# run specs, tables
# ---------------------------------------------------------------------------------------
def test_run_specs_and_cache_configs():
    specs = bench_quality.run_specs((256, 1024), page_size=16, resident=True,
                                    extra=dict([bench_quality.parse_spec(
                                        "small=selector=quest,selected_pages=8,pool_pages=12")]))
    assert list(specs) == ["dense", "quest256", "quest256-lag", "quest256-resident", "quest1024",
                           "quest1024-lag", "quest1024-resident", "small"]
    assert specs["quest256-lag"] == dict(mode="host", selector="quest", selected_pages=16,
                                         selection_lag=1)
    assert specs["small"] == dict(selector="quest", selected_pages=8, pool_pages=12)
    assert bench_quality.parse_spec("d=selector=oracle,dense_layers=(3, 5),selected_pages=64") \
        == ("d", dict(selector="oracle", dense_layers=(3, 5), selected_pages=64))
    kw = dict(batch=6, num_kv_heads=3, page_size=16, pool_cap=0.75)
    d = bench_quality.cache_config(specs["dense"], length=2048, **kw)
    assert (d.mode, d.selector, d.max_context) == ("resident", "dense", 2048)
    q = bench_quality.cache_config(specs["quest1024"], length=2048, **kw)
    assert q.mode == "host" and q.selected_pages == 64 and q.selection_lag == 0
    assert q.pool_pages == 6 * min(3 * 64 + 2, int(0.75 * 128))   # pool smaller than the context
    assert bench_quality.cache_config(specs["quest1024"], length=1024, **kw) is None  # = dense
    assert bench_quality.cache_config(specs["quest1024"], length=2048, context_tokens=1000,
                                      **kw) is None
    q = bench_quality.cache_config(specs["quest256"], length=2048, context_tokens=1000, **kw)
    assert q.pool_pages == 6 * int(0.75 * 63)   # capped by the pages the requests use
    assert bench_quality.cache_config(specs["small"], length=2048, **kw).pool_pages == 12


def _req(task, index, score):
    return dict(task=task, index=index, n_tokens=100, score=score, generated=5)


def test_paired_with_dense_and_sign_test():
    """Lost / gained / net against dense case by case; the exact sign test against a
    binomial(n, 1/2) tail written out by hand; controls are dense twins differing in numerics."""
    dense = dict(requests=[_req("vt", i, s) for i, s in enumerate([1, 1, 1, 1, 0, 0, 0.5])])
    run = dict(requests=[_req("vt", i, s) for i, s in enumerate([1, 0, 0, 1, 1, 0, 1])])
    s = bench_quality.paired_with_dense(run, dense)
    assert (s["kept"], s["of"], s["lost"], s["gained"], s["net"]) == (2, 4, 2, 2, 0)
    assert s["p"] == 1.0
    assert bench_quality.paired_with_dense(run, dense, task="niah_single_1")["of"] == 0
    # 9 lost, 1 gained: 2 * (C(10,0) + C(10,1)) / 2**10
    assert bench_quality.sign_test_p(9, 1) == pytest.approx(2 * 11 / 1024)
    assert bench_quality.sign_test_p(1, 9) == bench_quality.sign_test_p(9, 1)
    assert bench_quality.sign_test_p(0, 0) == 1.0 and bench_quality.sign_test_p(5, 5) == 1.0
    specs = bench_quality.run_specs((), page_size=16, controls=True)
    assert specs == {"dense": dict(mode="resident", selector="dense"),
                     "control-kvf32": dict(mode="resident", selector="dense", kv_dtype="float32"),
                     "control-page64": dict(mode="resident", selector="dense", page_size=64)}
    c = bench_quality.cache_config(specs["control-page64"], length=2048, batch=2,
                                   num_kv_heads=3, page_size=16, pool_cap=0.75)
    assert (c.page_size, c.selector, c.mode) == (64, "dense", "resident")


def test_stored_dense_checks_settings_and_cases():
    """--dense-from: the stored dense runs by length, only for the same settings and cases."""
    meta = dict(model="m", dtype="bfloat16", page_size=16, generator="g", seed=42,
                template="chat", max_new_tokens=None)
    dense = dict(length=2048, name="dense", requests=[_req("vt", i, 1.0) for i in range(3)])
    prev = dict(meta, runs=[dense, dict(dense, name="quest256"), dict(dense, length=4096)])
    cases = [dict(length=2048, task="vt", index=i) for i in range(3)]
    got = bench_quality.stored_dense(prev, dict(meta), cases, source="x/prev.json")
    assert list(got) == [2048] and got[2048]["name"] == "dense"
    assert got[2048]["stored_from"] == "prev.json"
    with pytest.raises(SystemExit, match="page_size 16 there, 64 here"):
        bench_quality.stored_dense(prev, dict(meta, page_size=64), cases, source="p")
    with pytest.raises(SystemExit, match="1 cases at 2048 tokens"):
        bench_quality.stored_dense(prev, dict(meta), cases + [dict(length=2048, task="vt",
                                                                  index=7)], source="p")
    with pytest.raises(SystemExit, match="no dense run at 8192"):
        bench_quality.stored_dense(prev, dict(meta), [dict(length=8192, task="vt", index=0)],
                                   source="p")
    # the same (task, index) with another prompt length: another draw of the data
    drawn = [dict(c, n_tokens=100 + c["index"]) for c in cases]
    same = dict(prev, runs=[dict(dense, requests=[dict(q, n_tokens=100 + q["index"])
                                                  for q in dense["requests"]])])
    assert list(bench_quality.stored_dense(same, dict(meta), drawn, source="p")) == [2048]
    other = [dict(c, n_tokens=100 + c["index"] + (c["index"] == 2)) for c in cases]
    with pytest.raises(SystemExit, match=r"1 cases at 2048 tokens differ .*vt #2: 103"):
        bench_quality.stored_dense(same, dict(meta), other, source="p")


def test_resume_keeps_only_runs_of_the_same_settings():
    """--resume: an earlier file's runs are kept only under the same settings, pool cap and
    specs, and over the same cases at the lengths this command runs."""
    meta = dict(model="m", dtype="bfloat16", page_size=16, generator="g", seed=42,
                template="chat", max_new_tokens=None, pool_cap=0.75)
    specs = {"dense": dict(mode="resident", selector="dense"),
             "q": dict(mode="host", selector="quest", selected_pages=8)}
    run = dict(length=2048, name="q", requests=[_req("vt", i, 1.0) for i in range(3)])
    prev = dict(meta, specs=json.loads(json.dumps(specs)),
                runs=[run, dict(run, length=4096, requests=[])])
    cases = [dict(length=2048, task="vt", index=i, n_tokens=100) for i in range(3)]
    bench_quality.check_resume(prev, dict(meta), specs, "o/r.json", cases)
    bench_quality.check_resume(prev, dict(meta), {"new": dict(selector="quest")}, "o/r.json",
                               cases)
    with pytest.raises(SystemExit, match="dtype 'bfloat16' there, 'float32' here"):
        bench_quality.check_resume(prev, dict(meta, dtype="float32"), specs, "o/r.json", cases)
    with pytest.raises(SystemExit, match="run 'q' is"):
        bench_quality.check_resume(prev, dict(meta), dict(specs, q=dict(specs["q"], selected_pages=4)),
                                   "o/r.json", cases)
    with pytest.raises(SystemExit, match="pool_cap 0.75 there, 0.5 here"):
        bench_quality.check_resume(prev, dict(meta, pool_cap=0.5), specs, "o/r.json", cases)
    # other cases at a length both run (--cases, --tasks or another draw of the data)
    more = cases + [dict(length=2048, task="vt", index=3, n_tokens=100)]
    with pytest.raises(SystemExit, match=r"run 'q' at 2048 tokens lacks 1 of the cases here "
                                         r"\(e.g. \('vt', 3\)\)"):
        bench_quality.check_resume(prev, dict(meta), specs, "o/r.json", more)
    with pytest.raises(SystemExit, match=r"run 'q' at 2048 tokens has 2 cases not here"):
        bench_quality.check_resume(prev, dict(meta), specs, "o/r.json", cases[:1])
    drawn = [dict(c, n_tokens=101) for c in cases]
    with pytest.raises(SystemExit, match=r"another draw \(e.g. vt #0: 101 prompt tokens here, "
                                         r"100 there\)"):
        bench_quality.check_resume(prev, dict(meta), specs, "o/r.json", drawn)


def test_default_batch_size_bounds_prompt_tokens_per_call():
    """On a GPU at most 160 requests and 1.3M prompt tokens per generate call (Qwen ran out of
    the H200's memory at 150 x 16k); 8 on the CPU."""
    assert [bench_quality.default_batch_size("gpu", n) for n in (2048, 8192, 16384, 32768)] == \
        [160, 160, 80, 40]
    assert bench_quality.default_batch_size("gpu", 2 ** 21) == 1
    assert bench_quality.default_batch_size("cpu", 32768) == 8


def test_markdown_and_summarize(tmp_path):
    stats = dict(pool_pages=10, hit_rate=0.5, evictions=1, dropped=0, bytes_host_to_device=2**20,
                 generated_tokens=10, pool_fraction_of_context=0.4)
    base = dict(model="m", device="cpu:cpu", commit="c", jax_version="0", date="d", dtype="f32",
                page_size=16, score="s", generator="g", seed=42, template="chat")

    def run(name, mode, scores, budget=None, length=2048):
        return dict(length=length, name=name, mode=mode, budget_tokens=budget, wall_s=1.0,
                    stats=stats, requests=[_req("vt", i, s) for i, s in enumerate(scores)])

    a = dict(base, runs=[run("dense", "resident", [1.0, 1.0, 0.4]),
                         run("quest256", "host", [1.0, 0.0, 1.0], 256)])
    md = bench_quality.markdown(a)
    assert "| vt | 2048 | 80.0 | 66.7 |" in md
    assert "| vt | 2048 | - | 50% (1/2) |" in md
    assert "| 2048 | quest256 | 3 | 66.7 | 50% (1/2) | - | - | 10 | 0.40 | 0.500 | 1 | 0 | 1.0 |" in md
    assert "| 2048 | quest256 | 50.0% (1/2) | 1 | 1 | +0 | 1 |" in md   # paired with dense
    assert "Named runs" not in md
    # a named run's settings are listed: its page size can differ from the header's
    named = bench_quality.markdown(dict(a, specs={"p64": dict(page_size=64, selected_pages=16)}))
    assert "Named runs: `p64` = page_size=64, selected_pages=16." in named
    (tmp_path / "a.json").write_text(json.dumps(a))
    b = dict(base, commit="c2", runs=[run("dense", "resident", [1.0], length=4096),
                                      run("quest256", "host", [0.0], 256, length=4096)])
    (tmp_path / "b.json").write_text(json.dumps(b))
    bench_quality.main(["--summarize", str(tmp_path / "all.json"), str(tmp_path / "a.json"),
                        str(tmp_path / "b.json")])
    merged = json.loads((tmp_path / "all.json").read_text())
    assert [(r["length"], r["name"]) for r in merged["runs"]] == [
        (2048, "dense"), (2048, "quest256"), (4096, "dense"), (4096, "quest256")]
    md = (tmp_path / "all.md").read_text()
    assert "| vt | 4096 | 100.0 |" in md
    assert "| **all** | quest256 | 33.3% (1/3) | 2 | 1 | -1 | 1 |" in md   # both lengths
    # files of other settings are not merged into one labelled table; a new folder is made
    (tmp_path / "c.json").write_text(json.dumps(dict(b, dtype="bf16")))
    with pytest.raises(SystemExit, match="dtype 'f32' in .*a.json, 'bf16' in .*c.json"):
        bench_quality.main(["--summarize", str(tmp_path / "x.json"), str(tmp_path / "a.json"),
                            str(tmp_path / "c.json")])
    bench_quality.main(["--summarize", str(tmp_path / "new" / "all.json"), str(tmp_path / "a.json")])
    assert (tmp_path / "new" / "all.md").is_file()


# ---------------------------------------------------------------------------------------
# (c) end to end with SmolLM2-135M
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_end_to_end_dense_and_quest_host_equals_resident(gguf_path, decoder, tmp_path):
    """One RULER case (niah_single_1, 512 tokens, the quick set): dense retrieves the number;
    Quest on the host tier, with a pool smaller than one step's working set (evictions),
    gives the tokens of resident Quest."""
    from jaxkv.models import gguf_loader

    cases, _ = bench_quality.load_cases(DATA, "quick")
    cases = [c for c in cases if c["task"] == "niah_single_1" and c["index"] == 0]
    model, params = gguf_loader.load_gguf(gguf_path, dtype="float32")
    specs = {"dense": dict(mode="resident", selector="dense"),
             "quest-host": dict(mode="host", selector="quest", selected_pages=8, pool_pages=12,
                                strict=True),
             "quest-resident": dict(mode="resident", selector="quest", selected_pages=8)}
    recs = []
    toks = bench_quality.run_length(model, params, cases, specs, length=512, batch_size=1,
                                    page_size=16, pool_cap=0.75, max_new_tokens=12, dec=decoder,
                                    stops=decoder.stop_ids(model.eos_id), texts="all",
                                    on_run=recs.append)
    by = {r["name"]: r for r in recs}
    assert by["dense"]["requests"][0]["score"] == 1.0, by["dense"]["requests"][0]
    assert toks["quest-host"] == toks["quest-resident"]
    s = by["quest-host"]["stats"]
    assert s["pool_pages"] == 12 and s["dropped"] == 0 and s["evictions"] > 0
    assert 0 < s["hit_rate"] < 1 and s["bytes_host_to_device"] > 0
    assert "paired_with_dense" not in by["dense"]
    assert by["quest-host"]["paired_with_dense"] == bench_quality.paired_with_dense(
        by["quest-host"], by["dense"])
    out = dict(model="m", device="cpu:cpu", commit="c", jax_version="0", date="d", dtype="f32",
               page_size=16, score="s", runs=recs)
    bench_quality.write(out, tmp_path, "q")
    assert "| niah_single_1 | 512 | 100.0 |" in (tmp_path / "q.md").read_text()
    # paired with the stored dense run instead of running dense: the same record
    again = []
    bench_quality.run_length(model, params, cases, {"quest-host": specs["quest-host"]},
                             length=512, batch_size=1, page_size=16, pool_cap=0.75,
                             max_new_tokens=12, dec=decoder, stops=decoder.stop_ids(model.eos_id),
                             texts="all", on_run=again.append, dense_record=by["dense"])
    assert again[0]["paired_with_dense"] == by["quest-host"]["paired_with_dense"]
    assert "same_as_dense" not in again[0]["requests"][0]
    # texts="diff" leaves out a text equal to the stored dense text, keeps one that differs
    for stored_text, kept in ((by["dense"]["requests"][0]["text"], False), (" other", True)):
        diff = []
        stored = dict(by["dense"], requests=[dict(by["dense"]["requests"][0], text=stored_text)])
        bench_quality.run_length(model, params, cases, {"dense-f32": dict(mode="resident",
                                                                          selector="dense")},
                                 length=512, batch_size=1, page_size=16, pool_cap=0.75,
                                 max_new_tokens=12, dec=decoder,
                                 stops=decoder.stop_ids(model.eos_id), texts="diff",
                                 on_run=diff.append, dense_record=stored)
        assert ("text" in diff[0]["requests"][0]) == kept


def test_compare_pairs_two_runs_case_by_case(tmp_path, capsys):
    """``--compare A.json:RUN B.json:RUN``: of the cases both files' dense runs get fully right,
    what each run keeps, B's losses and gains against A with their tasks and the sign test;
    per length and over all; a run or file that is not there, or files of other settings, are
    errors naming them."""
    base = dict(model="m", device="gpu", commit="c", jax_version="0", date="d", dtype="bf16",
                page_size=16, score="s", generator="g", seed=42, template="chat")

    def run(name, scores, length=2048, tasks=("vt", "vt", "niah_single_1", "niah_single_1")):
        return dict(length=length, name=name, requests=[_req(t, i, s) for i, (t, s) in
                                                        enumerate(zip(tasks, scores))])

    a = dict(base, runs=[run("dense", [1, 1, 1, 0]), run("x", [1, 0, 1, 1]),
                         run("dense", [1, 1], 4096, ("vt", "vt")), run("x", [1, 1], 4096, ("vt", "vt"))])
    # B's own dense misses case 2: it does not count; B's file is in 8-token pages (a run
    # may set its own page size, so compare does not hold the files to one)
    b = dict(base, page_size=8, runs=[run("dense", [1, 1, 0, 1]), run("y", [0, 1, 1, 1]),
                                       run("dense", [1, 1], 4096, ("vt", "vt")),
                                       run("y", [0, 1], 4096, ("vt", "vt"))])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    A, B = f"{tmp_path / 'a.json'}:x", f"{tmp_path / 'b.json'}:y"
    rows = bench_quality.compare(A, B)
    assert [(r["length"], r["of"], r["kept_a"], r["kept_b"], r["lost"], r["gained"])
            for r in rows] == [(2048, 2, 1, 1, 1, 1), (4096, 2, 2, 1, 1, 0), ("all", 4, 3, 2, 2, 1)]
    assert rows[0]["lost_tasks"] == {"vt": 1} and rows[0]["gained_tasks"] == {"vt": 1}
    assert rows[-1]["lost_tasks"] == {"vt": 2} and rows[-1]["p"] == pytest.approx(1.0)
    bench_quality.main(["--compare", A, B])
    out = capsys.readouterr().out
    assert "| **all** | 75.0% (3/4) | 50.0% (2/4) | 2 | 1 | 1 | vt 2 | vt 1 |" in out
    with pytest.raises(SystemExit, match=r"b.json has no run 'z' \(its runs: dense, y\)"):
        bench_quality.compare(A, f"{tmp_path / 'b.json'}:z")
    (tmp_path / "d.json").write_text(json.dumps(dict(b, runs=b["runs"][1:])))  # no dense at 2k
    with pytest.raises(SystemExit, match="has no run 'dense' at 2048 tokens .*its runs there: y"):
        bench_quality.compare(A, f"{tmp_path / 'd.json'}:y")
    with pytest.raises(SystemExit, match="takes FILE.json:RUN"):
        bench_quality.compare(A, str(tmp_path / "b.json"))
    with pytest.raises(SystemExit, match="no file"):
        bench_quality.compare(A, f"{tmp_path / 'c.json'}:y")
    (tmp_path / "c.json").write_text(json.dumps(dict(b, dtype="float32")))
    with pytest.raises(SystemExit, match="dtype 'bf16' in .*a.json, 'float32' in .*c.json"):
        bench_quality.compare(A, f"{tmp_path / 'c.json'}:y")
