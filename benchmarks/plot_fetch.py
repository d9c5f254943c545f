"""Plot bench_fetch.py results: fetch GB/s vs pages per step, one line per page size.

Usage: PYTHONPATH=. python3 benchmarks/plot_fetch.py DIR/bench_fetch.json [out.png]
"""
from __future__ import annotations

import argparse
import json


def plot(results: dict, path: str) -> str:
    """Write a PNG (matplotlib, Agg) of ``results["grid"]``; one panel per head shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = results.get("grid", [])
    heads = sorted({r["head"] for r in grid}) or ["(none)"]
    fig, axes = plt.subplots(1, len(heads), figsize=(6.5 * len(heads), 4.5), squeeze=False)
    bulk = results.get("bulk", {}).get("GBps")
    for ax, head in zip(axes[0], heads):
        rows = [r for r in grid if r["head"] == head and r.get("GBps")]
        sizes = sorted({r["page_size"] for r in rows})
        for i, ps in enumerate(sizes):
            color = f"C{i}"
            for variant, style in (("default", "-o"), ("naive", "--x")):
                pts = sorted((r["M"], r["GBps"]) for r in rows
                             if r["page_size"] == ps and r["variant"] == variant)
                if pts:
                    kib = next(r["page_bytes"] for r in rows if r["page_size"] == ps) / 1024
                    ax.plot(*zip(*pts), style, color=color, ms=4,
                            label=f"ps {ps} ({kib:g} KiB) {variant}")
        if bulk:
            ax.axhline(bulk, color="k", lw=1, ls=":", label=f"bulk device_put {bulk:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("missed pages per step (one launch)")
        ax.set_ylabel("GB/s (host -> device)")
        ax.set_title(f"fetch_pages, KV heads x dim {head}, {results.get('device', '')}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a bench_fetch JSON")
    ap.add_argument("out", nargs="?", help="the PNG (default: the JSON's name, .png)")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        results = json.load(f)
    if not any(r.get("GBps") for r in results.get("grid", [])):
        ap.error(f"{a.json} has no fetch grid to plot (a bench_fetch.py JSON has one)")
    print(plot(results, a.out or a.json.rsplit(".", 1)[0] + ".png"))


if __name__ == "__main__":
    main()
