"""Plot bench_decode.json: decode tokens/s per configuration, and the step-time split.

    PYTHONPATH=. python3 benchmarks/plot_decode.py DIR/bench_decode.json [out.png]
"""
from __future__ import annotations

import argparse
import json

PARTS = ("selector", "ensure", "fetch", "attention", "rest")
COLORS = {"selector": "#4c72b0", "ensure": "#dd8452", "fetch": "#c44e52", "attention": "#55a868",
          "rest": "#8c8c8c"}


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 and n % 2**20 == 0 else (
        f"{n // 1024}k" if n >= 1024 else str(n))


def plot(res: dict, path: str):
    """Two panels: tokens/s (log scale) per case and configuration; the split of each step (ms)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in res["cases"] if c.get("results")]
    if not cases:
        return
    labels, rows = [], []
    for c in cases:
        for r in c["results"]:
            labels.append(f"{c['shape']} B{c['batch']} {_tokens(c['context'])} {r['config']}")
            rows.append(r)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.45 * len(rows) + 2), 9))
    x = range(len(rows))
    ax1.bar(x, [r["tokens_per_s"] for r in rows],
            color=["#55a868" if r["mode"] == "resident" else "#4c72b0" for r in rows])
    ax1.set_yscale("log")
    ax1.set_ylabel("decode tokens/s")
    ax1.set_xticks(list(x), labels, rotation=70, fontsize=7)
    ax1.set_title(f"bench_decode on {res['device']} (jax {res['jax_version']}, "
                  f"{res['commit'][:10]}); green resident, blue host tier")
    bottom = [0.0] * len(rows)
    for p in PARTS:
        vals = [max(0.0, (r.get("split_ms") or {}).get(p) or 0.0) for r in rows]
        ax2.bar(x, vals, bottom=bottom, color=COLORS[p], label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.plot(list(x), [r["step_ms"] for r in rows], "k_", markersize=14, label="measured step")
    ax2.set_ylabel("ms per decode step")
    ax2.set_xticks(list(x), labels, rotation=70, fontsize=7)
    ax2.legend(fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a bench_decode JSON")
    ap.add_argument("out", nargs="?", help="the PNG (default: the JSON's name, .png; give one "
                                           "outside benchmarks/results for a committed JSON)")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        res = json.load(f)
    if not any(c.get("results") for c in res.get("cases", [])):
        ap.error(f"{a.json} has no decode results to plot")
    out = a.out or a.json.rsplit(".", 1)[0] + ".png"
    plot(res, out)
    print(out)


if __name__ == "__main__":
    main()
