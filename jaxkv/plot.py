"""Figures of a generation's per-round stats (``result.rounds`` or what ``on_round`` saw):
the pool's hit rate over decode steps, and decode tokens/s against the context length.

Needs matplotlib (``pip install 'jaxkv[plot]'``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def _runs(results) -> list[tuple[str, list[dict]]]:
    """[(label, rounds)] from a GenerateResult, a list of round dicts, or a mapping
    label -> either."""
    if isinstance(results, Mapping):
        return [(str(k), _rounds(v)) for k, v in results.items()]
    return [("", _rounds(results))]


def _rounds(r) -> list[dict]:
    rounds = getattr(r, "rounds", r)
    if not isinstance(rounds, Sequence) or not all(isinstance(x, Mapping) for x in rounds):
        raise TypeError("plot_rounds takes a GenerateResult, its .rounds (a list of dicts), or a "
                        f"dict of label -> those, got {type(r).__name__}")
    return list(rounds)


def plot_rounds(results, *, title: str | None = None, figsize=(10, 3.8)):
    """Two panels: hit rate per decode round against the decode step, and tokens/s per
    round against the context length (tokens in the cache). ``results``: a GenerateResult,
    its ``.rounds``, or ``{label: result}`` to compare runs. The first round, which
    includes the decode program's compilation, is left out of the tokens/s panel when later
    rounds exist, and so are the rounds of a continued context that only feed its appended
    tokens (no new token). Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    runs = _runs(results)
    if not any(rounds for _, rounds in runs):
        raise ValueError("plot_rounds: no decode rounds to plot (a result of max_new_tokens=1 "
                         "decodes none, and an empty dict holds no runs): pass a result that "
                         "decoded tokens")
    fig, (ax_hit, ax_tps) = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    for label, rounds in runs:
        if not rounds:
            continue
        steps, total = [], 0
        for r in rounds:
            total += r["steps"]
            steps.append(total)
        hit = [r["hit_rate"] for r in rounds]
        ax_hit.plot(steps, hit, marker="o", ms=3, label=label or None)
        timed = rounds[1:] if len(rounds) > 1 else rounds
        timed = [r for r in timed if r.get("new_tokens", 1)]  # not the rounds of appended tokens
        ax_tps.plot([r["context_tokens"] for r in timed], [r["tokens_per_s"] for r in timed],
                    marker="o", ms=3, label=label or None)
    ax_hit.set(xlabel="decode step", ylabel="pool hit rate (hits / selected pages)",
               title="Device pool hit rate", ylim=(0, 1.02))
    ax_tps.set(xlabel="context length (tokens in the cache)", ylabel="decode tokens / s",
               title="Decode throughput per round")
    for ax in (ax_hit, ax_tps):
        ax.grid(alpha=0.3)
        if any(label for label, _ in runs):
            ax.legend(fontsize=9)
    if title:
        fig.suptitle(title)
    return fig
