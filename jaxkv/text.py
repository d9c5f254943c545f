"""Text in, text out: the model bundle :func:`load` returns, prompts given as text or chat
messages, incremental detokenization for streaming, and stop strings.

Everything here runs in Python between compiled rounds; the compiled programs see token ids.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np

from jaxkv import validation
from jaxkv.models.configs import ModelConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded model: ``config`` (ModelConfig), ``params``, ``tokenizer`` (with the chat
    template of the model's files; None for a bare config) and the ``path`` it came from (the
    GGUF file or checkpoint directory read, also for a model name or the packaged default).

    ``model.generate(prompts, ...)`` is ``jaxkv.generate(model, prompts, ...)``. It unpacks
    as ``config, params, tokenizer = model``.
    """

    config: ModelConfig
    params: object
    tokenizer: object = None
    path: str | None = None

    @property
    def chat_template(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.chat_template

    def __iter__(self):
        return iter((self.config, self.params, self.tokenizer))

    def generate(self, prompts, **kw):
        from jaxkv.api import generate
        return generate(self, prompts, **kw)

    def __repr__(self):
        return f"Model({self.config.name!r}, path={self.path!r})"


def load(path: str | os.PathLike | None = None, *, dtype: str | None = None, device=None,
         compile_cache: bool | str | os.PathLike | None = None) -> Model:
    """Loads a model for :func:`jaxkv.generate`: a GGUF file, a Hugging Face checkpoint
    directory, a cached hub repo id or a model name ("smollm2-135m", or an installed asset's;
    ``jaxkv.models.load``); default: the packaged SmolLM2-135M-Instruct.

    ``compile_cache``: JAX's persistent compilation cache (``jaxkv.runtime``): None = on,
    in ``$JAXKV_COMPILATION_CACHE`` or ``~/.cache/jaxkv/xla`` (``JAXKV_COMPILATION_CACHE=0``
    turns it off); False = off; a path = that directory. Warns when JAX runs on the CPU while
    an NVIDIA GPU is visible (the CUDA plugin is not installed: README, "Install").
    """
    from jaxkv import models, runtime

    if not (compile_cache is None or isinstance(compile_cache, (bool, str, os.PathLike))):
        raise TypeError(f"compile_cache must be None (on), False (off) or a directory, got "
                        f"{type(compile_cache).__name__}")
    runtime.enable_compilation_cache(compile_cache)
    runtime.warn_if_gpu_unused()
    cfg, params, tok, read = models.loader.load_with_path(path, dtype=dtype, device=device)
    return Model(cfg, params, tok, str(read))


def is_chat(p) -> bool:
    return (isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) > 0
            and all(isinstance(m, Mapping) for m in p))


def _is_token_ids(p) -> bool:
    """One request's token ids: a non-empty 1-D array (numpy or jax), or a non-empty list /
    tuple of scalars (ints; a float, bool or None among them is then refused naming it, not
    taken as a batch of one-token requests)."""
    if isinstance(p, np.ndarray) or (hasattr(p, "__array__") and hasattr(p, "ndim")):
        return p.ndim == 1 and p.size > 0
    return (isinstance(p, (list, tuple)) and len(p) > 0
            and (all(type(t) is int for t in p) or all(validation.is_scalar(t) for t in p)))


def normalize(prompts) -> list:
    """One request (a str, a token-id list or 1-D array, or a chat as a list of message dicts)
    or a list of them (or a 2-D array of token ids) -> a list of requests."""
    if isinstance(prompts, str) or is_chat(prompts) or _is_token_ids(prompts):
        return [prompts]
    return prompts


def is_text(p) -> bool:
    return isinstance(p, str) or is_chat(p)


def check_chat(messages, i: int) -> None:
    """Prompt ``i``'s chat messages (``tokenizer.check_messages``: a str role and content)."""
    from jaxkv.models.tokenizer import check_messages
    check_messages(messages, f"prompt {i}, ")


def encode(tokenizer, p, i: int, *, continued: bool = False, history: str | None = None) -> list[int]:
    """Request ``i`` (text or chat messages) -> token ids. ``continued``: the text follows a
    kept context (no BOS); chat messages are then the new turns, rendered as the part of the
    whole conversation's template text after ``history`` (the context's text so far)."""
    if tokenizer is None:
        raise TypeError(f"prompt {i} is text: pass token ids (tokenizer.encode(text)), or the "
                        "model from jaxkv.load(...), whose tokenizer encodes it")
    if isinstance(p, str):
        if not p:
            raise ValueError(f"prompt {i} is an empty string: every request needs text")
        return tokenizer.encode(p, add_bos=False if continued else None)
    if not continued:
        check_chat(p, i)
        return tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
    raise AssertionError("continued chats go through encode_turns")


# stands for the reply when the template renders it, to find what follows an assistant turn
_REPLY_MARK = "JAXKV-REPLY-MARK-7f3a"


def _turn_end(tokenizer, history: list) -> str:
    """The text the chat template puts after an assistant turn's content (ChatML:
    ``<|im_end|>\n``): ``history`` (ending with that turn) rendered with a marker as the
    turn's content, after the marker. A marker, not the reply: a reply that is empty, only
    whitespace or changed by the template (trimmed) cannot be found in the rendered text."""
    marked = list(history[:-1]) + [dict(history[-1], content=_REPLY_MARK)]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=False)
    at = text.rfind(_REPLY_MARK)
    return text[at + len(_REPLY_MARK):] if at >= 0 else ""


def encode_turns(tokenizer, history: list, reply_ids: Sequence[int], new_messages: list,
                 i: int) -> list[int]:
    """New chat turns after a kept conversation whose last turn is the generated reply
    (``history`` ends with it as an assistant message; ``reply_ids`` its tokens). The template
    renders the whole conversation; appended are the end of the reply's turn that the
    generation did not produce (e.g. the newline after ``<|im_end|>``, or all of
    ``<|im_end|>\n`` after a reply cut by its length) and the new turns."""
    check_chat(new_messages, i)
    before = tokenizer.apply_chat_template(history, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(history + list(new_messages), add_generation_prompt=True)
    if not full.startswith(before):
        raise ValueError(
            f"prompt {i}: the chat template renders the kept conversation differently once "
            "new turns follow (it rewrites earlier turns), so they cannot be appended: pass the "
            "new turn as text with the template's markers, or start a new context")
    turn_end = _turn_end(tokenizer, history)
    last = list(reply_ids[-1:])
    if last and not tokenizer.decode(last, skip_special_tokens=True):
        produced = tokenizer.decode(last)   # a special token: the stop token the reply ended with
        if produced and turn_end.startswith(produced):
            turn_end = turn_end[len(produced):]
    text = turn_end + full[len(before):]
    if not text:
        raise ValueError(f"prompt {i}: the new messages add no text to the conversation")
    return tokenizer.encode(text, add_bos=False)


class Detokenizer:
    """Incremental text of one request's tokens. With a ``tokenizers`` backend: its
    ``DecodeStream``; otherwise whole-sequence decodes whose new suffix is released only when
    it does not end inside a UTF-8 character (no U+FFFD at the end)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._stream = None
        backend = getattr(tokenizer, "_tok", None)
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers.decoders import DecodeStream
            if isinstance(backend, HFTokenizer):
                self._stream, self._backend = DecodeStream(skip_special_tokens=True), backend
        except ImportError:
            pass

    def add(self, ids) -> str:
        """Appends ``ids``; returns the new text. Ids outside the tokenizer's vocabulary raise
        (as ``Tokenizer.decode`` does) instead of decoding to nothing."""
        ids = list(ids)
        vocab = getattr(self.tok, "vocab_size", None)
        for t in ids:
            if vocab is not None and not 0 <= int(t) < vocab:
                raise ValueError(f"Detokenizer.add: token id {int(t)} is outside the vocabulary "
                                 f"[0, {vocab}): pass ids of this tokenizer's model")
        new = []
        for t in ids:
            self.ids.append(int(t))
            if self._stream is not None:
                piece = self._stream.step(self._backend, int(t))
                if piece:
                    new.append(piece)
        if self._stream is None:
            full = self.tok.decode(self.ids, skip_special_tokens=True)
            if full.endswith("\ufffd"):
                return ""
            new, self.text = [full[len(self.text):]], full
            return new[0]
        piece = "".join(new)
        self.text += piece
        return piece


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string in ``text`` (-1: none)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def tokens_until(tokenizer, ids: list[int], stops: Sequence[str]) -> int:
    """The fewest leading tokens of ``ids`` whose text contains a stop string."""
    for m in range(1, len(ids) + 1):
        if find_stop(tokenizer.decode(ids[:m], skip_special_tokens=True), stops) >= 0:
            return m
    return len(ids)


def check_stop_strings(stop_strings, tokenizer) -> tuple[str, ...]:
    if stop_strings is None:
        return ()
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if not isinstance(stop_strings, Sequence) or not all(
            isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop_strings must be a list of non-empty strings, got {stop_strings!r}")
    if stop_strings and tokenizer is None:
        raise TypeError("stop_strings need a tokenizer: pass the model from jaxkv.load(...) "
                        "(or use stop_tokens)")
    return tuple(stop_strings)


def drop_special_stop_strings(stop_strings, tokenizer, stop_tokens) -> tuple[str, ...]:
    """The stop strings without those that are one special token's text: the generated text
    leaves special tokens out, so such a string never matches; one whose token is among
    ``stop_tokens`` (the stop ids in use) is left to the token. A string holding a special
    token that does not stop the request (or one with more text around it) is refused,
    naming the id to add to the stop tokens."""
    kept = []
    for j, s in enumerate(stop_strings):
        ids = tokenizer.encode(s, add_bos=False)
        special = [t for t in ids
                   if tokenizer.decode([t]) and not tokenizer.decode([t], skip_special_tokens=True)]
        if not special:
            kept.append(s)
        elif len(ids) == 1 and ids[0] in stop_tokens:
            continue
        else:
            t = special[0]
            raise ValueError(
                f"stop_strings[{j}] {s!r} holds the special token {tokenizer.decode([t])!r} "
                f"(id {t}), which the generated text leaves out, so it would never match: stop "
                f"on the token instead, stop_tokens={sorted(set(stop_tokens) | {t})} (the stop "
                f"ids in use and {t})")
    return tuple(kept)
