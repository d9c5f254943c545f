"""Tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Supports the byte-level BPE tokenizers (``tokenizer.ggml.model == "gpt2"``) that llama-family
GGUF files carry, rebuilt with the ``tokenizers`` package, plus a ChatML chat formatter.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Mapping, Sequence

import numpy as np

# llama.cpp token types (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user defined,
# 5 unused, 6 byte.
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer variants (``tokenizer.ggml.pre``) whose digits are split one by one before
# the byte-level regex (as llama.cpp and the original tokenizer.json of these models do).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}

# A template that inserts a default system message when the chat has none (SmolLM2's does).
_DEFAULT_SYSTEM_RE = re.compile(r"messages\[0\]\['role'\] != 'system'.*?"
                                r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Tokenizer:
    """Byte-level BPE tokenizer from GGUF metadata.

    Attributes: ``vocab_size``, ``bos_id``, ``eos_id``, ``stop_ids`` (ids that end a
    generation: eos plus ``<|im_end|>`` / ``<|endoftext|>`` when present), ``chat_template``
    (the template string from the file, or None).
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 *, bos_id: int | None, eos_id: int | None, pre: str = "default",
                 add_bos: bool = False, chat_template: str | None = None):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("tokenizer vocabulary has duplicate tokens")
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(token_types) if int(t) in (_CONTROL, _USER_DEFINED)]
        if special:
            tok.add_special_tokens(special)
        self._tok = tok
        self._tokens = list(tokens)
        self.vocab_size = len(tokens)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.add_bos_default = bool(add_bos)
        self.chat_template = chat_template
        m = _DEFAULT_SYSTEM_RE.search(chat_template or "")
        self.default_system = m.group(1) if m else None
        stops = [] if self.eos_id is None else [self.eos_id]
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            i = vocab.get(name)
            if i is not None and i not in stops:
                stops.append(i)
        self.stop_ids = tuple(stops)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None, *, reader=None) -> "Tokenizer":
        """Builds the tokenizer from a GGUF file (default: the packaged SmolLM2 model)."""
        if reader is None:
            from .gguf_loader import default_model_path, open_gguf
            reader = open_gguf(default_model_path() if path is None else path)
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        if model != "gpt2":
            raise ValueError(f"unsupported tokenizer model {model!r}: only byte-level BPE ('gpt2')")
        return cls(
            _field(reader, "tokenizer.ggml.tokens"),
            _field(reader, "tokenizer.ggml.merges", []),
            _field(reader, "tokenizer.ggml.token_type", []),
            bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
            pre=_field(reader, "tokenizer.ggml.pre", "default"),
            add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=_field(reader, "tokenizer.chat_template"),
        )

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Text -> token ids (list of int). Special tokens written in the text (e.g.
        ``<|im_start|>``) map to their ids. ``add_bos`` defaults to the file's
        ``tokenizer.ggml.add_bos_token`` (False for SmolLM2)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no bos token")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """Token ids -> text."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        """The vocabulary string of id ``i`` (byte-level form)."""
        return self._tokens[int(i)]

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False):
        """ChatML formatting of ``[{"role": ..., "content": ...}, ...]``.

        Matches ChatML templates such as SmolLM2's: when the file's template inserts a default
        system message (``default_system``) and the first message is not a system message, it
        is inserted. Returns the text, or its ids if ``tokenize``.
        """
        parts = []
        for k, m in enumerate(messages):
            if k == 0 and m["role"] != "system" and self.default_system is not None:
                parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text, add_bos=False) if tokenize else text
