"""Makes the tiny Hugging Face checkpoints under tests/fixtures/hf_* and their reference
logits, with transformers (torch, float32) as the independent implementation.

Run it in a Python 3.11 venv with the CPU torch wheel (jax is not needed; about a minute on
2 cores):

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install torch==2.13.0 transformers safetensors jinja2 numpy
    cd <repo> && /tmp/tfvenv/bin/python scripts/make_hf_fixtures.py

Each fixture directory is what ``save_pretrained`` writes for a randomly initialised
model and a small byte-level BPE tokenizer trained here: ``config.json``,
``model.safetensors`` (or shards and ``model.safetensors.index.json``), ``tokenizer.json``,
``tokenizer_config.json`` (and ``chat_template.jinja``), plus ``reference.npz``:

  meta            JSON str: versions, the fixture's description, positions start
  ids             [T] int32 input ids (fixed, seeded)
  start           int: position of ids[0] (positions start .. start+T-1)
  logits          [T, V] float32 transformers' logits
  greedy          [N] int32 greedy continuation of ids (argmax, positions continue)
  greedy_margin   [N] float32 top-1 minus top-2 logit at each greedy step
  tok_text_j      str; tok_ids_j: transformers' ``tokenizer(text)["input_ids"]`` (its default
                  special tokens); tok_ids_plain_j: with ``add_special_tokens=False``
  chat_messages_k JSON str; chat_text_k: ``apply_chat_template(..., tokenize=False,
                  add_generation_prompt=True)``

The fixtures:
  hf_llama          LlamaForCausalLM, tied embeddings, head_dim 32 != d_model / heads,
                    llama3-style tokenizer (BOS added by the post-processor), header template
  hf_qwen2          Qwen2ForCausalLM (q/k/v biases), untied head, saved in 5 shards (index),
                    qwen2-style tokenizer (NFC, digits one by one), ChatML template
  hf_llama3_scaled  LlamaForCausalLM with llama3 RoPE scaling (factor 8 over a 64-token
                    pretraining context), evaluated at positions 700..
  hf_qwen2_yarn     Qwen2ForCausalLM with yarn RoPE scaling (factor 4 over 128), positions 400..
  hf_llama_linear   LlamaForCausalLM with linear RoPE scaling (factor 4), positions 300..
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys

import numpy as np

from reference_common import ROOT, greedy_with_margins

# Training text for the tiny tokenizers (written for this script).
CORPUS = """\
The host tier keeps every page of the key-value cache in pinned host memory and copies the
selected pages into a small device pool before each decode step. A page holds sixteen tokens.
Long prompts of 32768 tokens, 65536 tokens or 131072 tokens fit because only 2048 tokens per
layer are read at a time. def select(scores, k):\\n    return scores.argsort()[-k:]\\n
Le cache réside dans la mémoire de l'hôte; die Seiten werden nach Bedarf geladen. Numbers such
as 3.14159, 2024 and 1,000,000 appear in logs. Don't, won't, it's, we'll, they've, I'm.
<|im_start|>user\\nhello<|im_end|>\\n
"""

TOK_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces, trailing spaces   ",
    "Tabs\tand\nnewlines\n\n\nand  double  spaces",
    "Le café était délicieux, naïve façade, Straße.",
    "日本語のテキスト 🎉",
    "don't won't it's we'll they've I'm",
    "def f(x):\n    return x ** 2  # square\n",
]

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{%- set rest = messages %}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if loop.index0 == 0 and message['role'] != 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday is ' + date_string + '.<|eot_id|>' }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

CHATS = [
    [{"role": "user", "content": "Where is the cache kept?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "  How many tokens per page?  "},
     {"role": "assistant", "content": "Sixteen."},
     {"role": "user", "content": "And per layer?"}],
]

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SEQ_LEN = 40
N_GREEDY = 8


def make_tokenizer(style: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on CORPUS: "llama" (llama3 split, BOS added by a
    TemplateProcessing post-processor) or "qwen2" (NFC, qwen2 split, no BOS)."""
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    tok = Tokenizer(models.BPE())
    split = LLAMA3_SPLIT if style == "llama" else QWEN2_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(specials)
    if style == "llama":
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, specials


def init_weights(model, seed: int):
    """Scaled-normal weights, norm weights near 1 and nonzero biases, so that the logits are
    spread out (transformers' default std 0.02 gives nearly uniform logits)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


FIXTURES = {
    "hf_llama": dict(arch="llama", tok="llama", start=0, config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "hf_qwen2": dict(arch="qwen2", tok="qwen2", start=0, shard="100KB", config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "hf_llama3_scaled": dict(arch="llama", tok="llama", start=700, config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "hf_qwen2_yarn": dict(arch="qwen2", tok="qwen2", start=400, config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128})),
    "hf_llama_linear": dict(arch="llama", tok="llama", start=300, config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
}
VOCAB = 320


def make_fixture(name: str, spec: dict, out_root: str, seed: int) -> None:
    import torch
    import transformers
    from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                              LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)

    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    tok_obj, specials = make_tokenizer(spec["tok"], VOCAB)
    if spec["tok"] == "llama":
        bos, eos = "<|begin_of_text|>", "<|eot_id|>"
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok_obj, bos_token=bos, eos_token=eos,
                                         chat_template=LLAMA_TEMPLATE)
    else:
        bos, eos = None, "<|im_end|>"
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok_obj, eos_token=eos,
                                         pad_token="<|endoftext|>", chat_template=QWEN_TEMPLATE)
    cls_cfg, cls_model = ((LlamaConfig, LlamaForCausalLM) if spec["arch"] == "llama"
                          else (Qwen2Config, Qwen2ForCausalLM))
    cfg = cls_cfg(vocab_size=VOCAB, bos_token_id=None if bos is None else tok_obj.token_to_id(bos),
                  eos_token_id=tok_obj.token_to_id(eos), **spec["config"])
    torch.manual_seed(seed)
    model = cls_model(cfg).float().eval()
    init_weights(model, seed)
    model.save_pretrained(out, max_shard_size=spec.get("shard", "50GB"))
    hf_tok.save_pretrained(out)

    # reload from disk: the reference is what the saved files give
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=SEQ_LEN).astype(np.int64)
    start = spec["start"]

    @torch.no_grad()
    def logits_of(seq):
        pos = torch.arange(start, start + len(seq), dtype=torch.long)[None]
        return model(torch.tensor([seq], dtype=torch.long), position_ids=pos).logits[0].numpy()

    lg = logits_of(list(ids))
    greedy, margin = greedy_with_margins(logits_of, list(ids), lg[-1], N_GREEDY)

    res: dict[str, np.ndarray] = {
        "ids": ids.astype(np.int32), "start": np.array(start, np.int32),
        "logits": lg.astype(np.float32), "greedy": np.asarray(greedy, np.int32),
        "greedy_margin": np.asarray(margin, np.float32)}
    for j, text in enumerate(TOK_TEXTS):
        res[f"tok_text_{j}"] = np.array(text)
        res[f"tok_ids_{j}"] = np.asarray(hf_tok(text)["input_ids"], np.int32)
        res[f"tok_ids_plain_{j}"] = np.asarray(hf_tok(text, add_special_tokens=False)["input_ids"],
                                               np.int32)
    for k, msgs in enumerate(CHATS):
        res[f"chat_messages_{k}"] = np.array(json.dumps(msgs))
        res[f"chat_text_{k}"] = np.array(hf_tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, date_string="1 Dec 2026"))
    meta = {
        "made_by": "scripts/make_hf_fixtures.py", "fixture": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "numpy": np.__version__,
        "architecture": type(model).__name__, "dtype": "float32", "seed": seed,
        "n_tok_texts": len(TOK_TEXTS), "n_chats": len(CHATS), "n_greedy": N_GREEDY,
        "chat_kwargs": {"date_string": "1 Dec 2026"},
    }
    res["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(os.path.join(out, "reference.npz"), **res)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {sorted(os.listdir(out))} {size / 1e3:.0f} kB; greedy {greedy}, "
          f"min margin {min(margin):.3f}, logit range {lg.min():.2f}..{lg.max():.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    for i, (name, spec) in enumerate(FIXTURES.items()):
        if args.only and name not in args.only:
            continue
        make_fixture(name, spec, args.out, seed=1000 + i)


if __name__ == "__main__":
    main()
