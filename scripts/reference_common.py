"""Pieces shared by the scripts that make transformers reference fixtures
(make_reference_logits.py, make_qwen_reference.py, make_hf_fixtures.py). They run in a
Python 3.11 venv with torch and without jax."""
from __future__ import annotations

import importlib.util
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def our_tokenizer_module():
    """models/tokenizer.py loaded by file path: the models package __init__ imports jax, which
    the reference venv does not have."""
    spec = importlib.util.spec_from_file_location("_jaxkv_tokenizer",
                                                  os.path.join(ROOT, "models", "tokenizer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def greedy_with_margins(logits_of, ids, last_row, n: int):
    """``n`` greedy tokens after ``ids`` (``last_row``: the logits at its last position;
    ``logits_of(seq)`` -> [len(seq), V]) and the top-1 minus top-2 logit at each step."""
    seq, greedy, margin = list(ids), [], []
    row = last_row
    for _ in range(n):
        two = np.sort(row)[-2:]
        nxt = int(np.argmax(row))
        greedy.append(nxt)
        margin.append(float(two[1] - two[0]))
        seq.append(nxt)
        row = logits_of(seq)[-1]
    return greedy, margin
