"""Tokenizers and chat templates from a model's own files.

- Hugging Face checkpoints: ``tokenizer.json`` through the ``tokenizers`` package, special
  tokens and settings from ``tokenizer_config.json``, the chat template from
  ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``.
- GGUF files: the byte-level BPE (``tokenizer.ggml.model == "gpt2"``) rebuilt from
  ``tokenizer.ggml.*``, with the pre-tokenizer that ``tokenizer.ggml.pre`` names (``smollm``,
  ``qwen2``, ``llama-bpe``, ...; an unknown name is an error, not a silent GPT-2 split), and
  the chat template from ``tokenizer.chat_template``.

Chat templates are rendered with jinja2 the way transformers renders them (a sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII text, and the special tokens as ``bos_token``/``eos_token``).
This module imports neither jax nor the rest of ``jaxkv`` at load time.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

# llama.cpp token types (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user defined,
# 5 unused, 6 byte.
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes of the byte-level BPE families (the patterns their tokenizer.json files use).
_GPT2_SPLIT = None  # ByteLevel's own regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split, digits one by one first, NFC normalisation)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    **{k: (_GPT2_SPLIT, False, False) for k in ("default", "gpt2", "gpt-2")},
    **{k: (_GPT2_SPLIT, True, False) for k in ("smollm", "starcoder", "refact", "codeshell",
                                               "command-r", "exaone", "minerva")},
    **{k: (_LLAMA3_SPLIT, False, False) for k in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe",
                                                  "falcon3", "dbrx")},
    **{k: (_QWEN2_SPLIT, False, True) for k in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{k: (_GPT4O_SPLIT, False, False) for k in ("gpt-4o", "llama4")},
}

_STOP_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _byte_level_pre_tokenizer(pre: str):
    """The ``tokenizers`` normalizer and pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"unknown GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}: its split rule is not known "
            f"here, and another rule would give token ids the model was not trained on. "
            f"Supported: {', '.join(sorted(PRE_TOKENIZERS))}; load the model's Hugging Face "
            "checkpoint (tokenizer.json) instead")
    split, digits, nfc = PRE_TOKENIZERS[pre]
    if split is None:
        seq = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        seq = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if digits:
        seq.insert(0, pre_tokenizers.Digits(individual_digits=True))
    pt = seq[0] if len(seq) == 1 else pre_tokenizers.Sequence(seq)
    return (normalizers.NFC() if nfc else None), pt


def _token_text(v) -> str | None:
    """A special token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """A tokenizer with its chat template.

    Build it with :meth:`from_gguf` or :meth:`from_pretrained` (a Hugging Face checkpoint
    directory), or :func:`jaxkv.models.load`. Attributes: ``vocab_size``, ``bos_id``,
    ``eos_id``, ``stop_ids`` (ids that end a generation: eos plus ``<|im_end|>`` /
    ``<|endoftext|>`` / ``<|eot_id|>`` ... when present), ``chat_template`` (the template
    string from the model's files, or None), ``add_bos_default``.
    """

    def __init__(self, backend, *, bos_id: int | None, eos_id: int | None, add_bos: bool = False,
                 chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None,
                 extra_stop_ids: Iterable[int] = ()):
        """``backend``: a ``tokenizers.Tokenizer``; ``special_tokens``: names the chat template
        sees (``bos_token``, ``eos_token``, ...)."""
        self._tok = backend
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.add_bos_default = bool(add_bos)
        self.chat_template = chat_template
        self.chat_template_names: tuple = ()   # named templates, when none is "default"
        self.special_tokens = dict(special_tokens or {})
        stops = [] if self.eos_id is None else [self.eos_id]
        for i in list(extra_stop_ids) + [backend.token_to_id(n) for n in _STOP_NAMES]:
            if i is not None and int(i) not in stops:
                stops.append(int(i))
        self.stop_ids = tuple(stops)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None, *, reader=None) -> "Tokenizer":
        """Builds the tokenizer from a GGUF file (default: the packaged SmolLM2 model).
        Raises ValueError for a tokenizer model other than byte-level BPE ("gpt2") and for an
        unknown ``tokenizer.ggml.pre``."""
        if reader is None:
            from .gguf_loader import default_model_path, open_gguf
            reader = open_gguf(default_model_path() if path is None else path)
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        if model != "gpt2":
            raise ValueError(f"unsupported tokenizer model {model!r}: only byte-level BPE ('gpt2': "
                             "Llama-3, Qwen2, SmolLM2 files) is read, not SentencePiece ('llama': "
                             "Llama-2, Mistral); load the model's Hugging Face checkpoint "
                             "directory instead (its tokenizer.json is read by the tokenizers "
                             "package)")
        pre = _field(reader, "tokenizer.ggml.pre")
        if pre is None:
            warnings.warn("GGUF file has no tokenizer.ggml.pre (converted before llama.cpp recorded "
                          "pre-tokenizers): using the GPT-2 split, which may not match the model's "
                          "training", UserWarning, stacklevel=2)
            pre = "default"
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        types = list(_field(reader, "tokenizer.ggml.token_type", []))
        backend = cls._gguf_backend(tokens, list(_field(reader, "tokenizer.ggml.merges", [])),
                                    types, pre)
        bos = _field(reader, "tokenizer.ggml.bos_token_id")
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        if eos is None:
            warnings.warn("GGUF file has no tokenizer.ggml.eos_token_id: no eos token, so a "
                          "generation ends at a stop token the vocabulary names (<|im_end|>, "
                          "<|eot_id|>, ...), at max_new_tokens, or at the stop_tokens / "
                          "stop_strings you pass", UserWarning, stacklevel=2)
        for key, i in (("bos", bos), ("eos", eos)):  # the rule load_gguf's ModelConfig applies
            if i is not None and not 0 <= int(i) < len(tokens):
                from .gguf_loader import GGUFError
                raise GGUFError(f"GGUF metadata tokenizer.ggml.{key}_token_id = {int(i)} is outside "
                                f"the vocabulary [0, {len(tokens)}): the file is corrupt; "
                                "re-download or re-convert it")
        names = {}
        for key, i in (("bos_token", bos), ("eos_token", eos),
                       ("unk_token", _field(reader, "tokenizer.ggml.unknown_token_id")),
                       ("pad_token", _field(reader, "tokenizer.ggml.padding_token_id"))):
            if i is not None and 0 <= int(i) < len(tokens):
                names[key] = tokens[int(i)]
        return cls(backend, bos_id=bos, eos_id=eos,
                   add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=_field(reader, "tokenizer.chat_template"), special_tokens=names)

    @staticmethod
    def _gguf_backend(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                      pre: str):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

        normalizer, pre_tok = _byte_level_pre_tokenizer(pre)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("tokenizer vocabulary has duplicate tokens")
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False,
                                     byte_fallback=False))
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        # control tokens are special (skip_special_tokens drops them); user-defined ones
        # (Qwen2.5's <tool_call>, FIM markers) are whole tokens in text but not special, as in
        # the model's tokenizer.json, so a decoded reply keeps them
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(token_types) if int(t) == _CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(token_types) if int(t) == _USER_DEFINED]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        return tok

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Builds the tokenizer of a Hugging Face checkpoint directory (or hub cache entry):
        ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
        ``add_bos_token``, chat template), ``special_tokens_map.json`` (special tokens the
        config does not name), ``chat_template.jinja`` / ``chat_template.json``.
        BOS is added by default when the file asks for it (``add_bos_token``, or a
        post-processor that prepends it, as Llama-3's does)."""
        from tokenizers import Tokenizer as HFTokenizer

        from .hf_loader import _read_json, eos_ids, resolve_checkpoint

        d = resolve_checkpoint(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            have = sorted(p.name for p in d.iterdir() if "token" in p.name or p.suffix == ".model")
            raise FileNotFoundError(
                f"{d} has no tokenizer.json" + (f" (found {have}: only tokenizer.json, the fast "
                                                "tokenizer format, is read)" if have else ""))
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{tj}: cannot be read by the tokenizers package ({e})") from None
        tc_path = d / "tokenizer_config.json"
        tc = _read_json(tc_path) if tc_path.is_file() else {}
        sm_path = d / "special_tokens_map.json"
        sm = _read_json(sm_path) if sm_path.is_file() else {}
        keys = ("bos_token", "eos_token", "unk_token", "pad_token")
        names = {k: _token_text(tc.get(k)) or _token_text(sm.get(k)) for k in keys}
        names = {k: v for k, v in names.items() if v is not None}
        bos = backend.token_to_id(names["bos_token"]) if "bos_token" in names else None
        eos = backend.token_to_id(names["eos_token"]) if "eos_token" in names else None
        # what the post-processor does to a plain word: a token it prepends is the BOS
        plain = backend.encode("a", add_special_tokens=False).ids
        probe = backend.encode("a", add_special_tokens=True).ids
        first = probe[0] if len(probe) > len(plain) and probe[1:1 + len(plain)] == plain else None
        if bos is None and first is not None:
            bos, names["bos_token"] = first, backend.id_to_token(first)
        if "add_bos_token" in tc:
            add_bos = bool(tc["add_bos_token"])
        else:
            add_bos = bos is not None and first == bos
        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template")
        else:
            template = tc.get("chat_template")
        named = ()
        if isinstance(template, list):  # named templates: take "default"
            named = tuple(str(t.get("name")) for t in template if isinstance(t, Mapping))
            template = next((t.get("template") for t in template if t.get("name") == "default"),
                            None)
        extra = eos_ids(d) if (d / "config.json").is_file() else ()
        tok = cls(backend, bos_id=bos, eos_id=eos, add_bos=add_bos, chat_template=template,
                  special_tokens=names, extra_stop_ids=extra)
        tok.chat_template_names = named
        return tok

    # ------------------------------------------------------------------ use

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Text -> token ids (list of int). Special tokens written in the text (e.g.
        ``<|im_start|>``) map to their ids. ``add_bos`` defaults to the model files' setting
        (``add_bos_default``: False for SmolLM2 and Qwen2.5, True for Llama-3)."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # the Rust side refuses text that is not valid Unicode, vaguely
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"encode: text has a lone surrogate {text[e.start]!r} at index {e.start}, "
                    "which is not valid Unicode (it comes from decoding bytes with "
                    "errors='surrogateescape'): remove it, or decode the source with "
                    "errors='replace'") from None
            raise
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no bos token: call encode(..., add_bos=False)")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """Token ids -> text (one request's ids; a batch of one is taken as its row). Raises
        TypeError / ValueError naming ``ids`` for text, a batch of several requests,
        non-integer ids or ids outside ``[0, vocab_size)`` (the backend would drop them
        silently)."""
        if isinstance(ids, (str, bytes)):
            raise TypeError("decode: ids is text: pass token ids (the output of encode)")
        if not hasattr(ids, "__array__"):  # a list, tuple or iterator (read once)
            ids = list(ids)
            rows = [t for t in ids if isinstance(t, (list, tuple)) or np.ndim(t)]
            if rows and len(ids) == 1:  # a batch of one request: its ids
                ids = list(ids[0])
            elif rows:
                raise TypeError("decode: ids must be one sequence of token ids, not a batch: "
                                "decode each request's ids ([tok.decode(x) for x in ids])")
        arr = np.asarray(ids)
        if arr.ndim > 1 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.ndim > 1:
            raise TypeError(f"decode: ids must be one sequence of token ids, got an array of "
                            f"shape {arr.shape}: decode each row")
        arr = arr.reshape(-1)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"decode: ids must be integer token ids in [0, {self.vocab_size}), got "
                            f"dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"decode: ids has token id {int(arr[j])} at index {j}, outside the "
                             f"vocabulary [0, {self.vocab_size}): pass ids of this tokenizer's model")
        return self._tok.decode(arr.tolist(), skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        """The vocabulary string of id ``i`` (byte-level form)."""
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"token: i must be an int token id, got {type(i).__name__} {i!r}")
        t = self._tok.id_to_token(int(i)) if 0 <= i < self.vocab_size else None
        if t is None:
            raise ValueError(f"token: id {i} is outside the vocabulary [0, {self.vocab_size})")
        return t

    def no_chat_template(self) -> str | None:
        """Why chat messages cannot be rendered (no template, or only named ones without a
        'default'), or None when they can."""
        if self.chat_template:
            return None
        if self.chat_template_names:
            return (f"the model files have named chat templates {list(self.chat_template_names)} "
                    "and none is 'default', the one used")
        return "the model files have no chat template"

    def apply_chat_template(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[Mapping] | None = None,
                            **kwargs):
        """Renders ``[{"role": ..., "content": ...}, ...]`` with the model's own chat template
        (jinja2, as transformers does). ``kwargs`` reach the template as variables (e.g.
        ``date_string``). Returns the text, or its ids if ``tokenize`` (no BOS added: templates
        that want one write ``bos_token`` themselves)."""
        why = self.no_chat_template()
        if why:
            raise ValueError(f"{why}: format the prompt yourself and call encode()"
                             + (", or set Tokenizer.chat_template to one"
                                if self.chat_template_names else ""))
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or \
                not all(isinstance(m, Mapping) for m in messages):
            raise TypeError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
        check_messages(messages)
        text = render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                    **{**self.special_tokens, **kwargs})
        return self.encode(text, add_bos=False) if tokenize else text


# --------------------------------------------------------------------------- chat templates

def check_messages(messages: Sequence[Mapping], where: str = "") -> None:
    """Chat messages: each with a non-empty str ``role`` and a str ``content`` (an assistant
    message with ``tool_calls`` may leave ``content`` out or None). A template would
    otherwise render a missing content as nothing, or None as the text "None". ``where``
    prefixes the message (e.g. "prompt 2, ")."""
    for j, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}message {j}: 'role' must be a non-empty str "
                             f"('system', 'user', 'assistant', ...), got {role!r}")
        if content is None and m.get("tool_calls"):
            continue
        if not isinstance(content, str):
            what = "is missing" if "content" not in m else f"must be a str, got {content!r}"
            raise ValueError(f"{where}message {j} ({role}): 'content' {what}: each message is "
                             "{'role': ..., 'content': text}")


_ENV_CACHE: dict = {}        # "env": the jinja2 environment, built on first use
_TEMPLATE_CACHE: dict = {}   # template source -> compiled template


def _environment():
    """The jinja2 sandbox that chat templates run in (built once)."""
    if "env" in _ENV_CACHE:
        return _ENV_CACHE["env"]
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'jaxkv[models]' "
                          "(or pip install jinja2)") from None
    import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    _ENV_CACHE["env"] = env
    return env


def render_chat_template(template: str, messages: Sequence[Mapping], *,
                         add_generation_prompt: bool = True, tools=None, documents=None,
                         **variables) -> str:
    """Renders a chat template string (jinja2) for ``messages``; ``variables`` (special tokens
    such as ``bos_token``, or template options) are visible to the template."""
    import jinja2

    env = _environment()
    try:
        compiled = _TEMPLATE_CACHE.get(template)
        if compiled is None:
            compiled = _TEMPLATE_CACHE[template] = env.from_string(template)
        msgs = [dict(m) for m in messages]
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               tools=None if tools is None else [dict(t) for t in tools],
                               documents=documents, **variables)
    except jinja2.TemplateError as e:  # syntax errors and the template's raise_exception(...)
        raise ValueError(f"chat template: {type(e).__name__}: {e}") from None


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face checkpoint directory."""
    p = Path(path)
    if p.is_file():
        return Tokenizer.from_gguf(p)
    return Tokenizer.from_pretrained(p)
