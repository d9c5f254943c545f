"""Plot bench_select.py results: selector time per layer against context length.

Usage: PYTHONPATH=. python3 benchmarks/plot_select.py OUT.png RUN.json[:LABEL] [RUN.json[:LABEL] ...]
Every run adds its whole-selector rows (``select_*``) as lines (points where it measured one
size); the dotted line is the Quest metadata read at the HBM bandwidth given by ``--hbm``
(GB/s, read) or measured by the last run.
"""
from __future__ import annotations

import argparse
import json

SELECT_LABELS = {
    "select_pallas_topk": "Pallas scores + full-row top-k kernel",
    "select_pallas_chunked": "Pallas scores + XLA chunked top-k",
    "select_xla_auto": "XLA scores + default top-k",
    "select_pallas_cmax": "Pallas scores + chunk-max top-k (default >= 2048 pages)",
    "select_xla_cmax": "XLA scores + chunk-max top-k",
}


def plot(runs: list[tuple[dict, str]], path: str, hbm_gbps: float | None = None) -> str:
    """Write a PNG: Quest selection us/layer vs pages (log-log), one style per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = ["-o", "--s", ":^", "-.d"]
    meta = {}
    for i, (res, label) in enumerate(runs):
        rows = [r for r in res.get("results", []) if r.get("method") == "quest"]
        for j, (name, desc) in enumerate(SELECT_LABELS.items()):
            pts = sorted((r["n_pages"], r["us_per_layer"]) for r in rows if r["name"] == name)
            if pts:
                ax.plot(*zip(*pts), styles[i % len(styles)], color=f"C{j}", ms=5,
                        label=f"{desc} [{label}]")
        cfg = res.get("config", {})
        for r in rows:
            if r["name"] == "metadata_read_at_hbm_bw":  # kmax + kmin of one layer, bf16
                meta[r["n_pages"]] = r.get("metadata_bytes") or (
                    2 * r["n_pages"] * cfg.get("B", 1) * cfg.get("H", 8) * cfg.get("D", 128) * 2)
        hbm_gbps = hbm_gbps or res.get("hbm_copy_gbps")
    if meta and hbm_gbps:
        pts = sorted((n, b / (hbm_gbps * 1e9) * 1e6) for n, b in meta.items())
        ax.plot(*zip(*pts), "k:x", lw=1, ms=5, label=f"summaries read at {hbm_gbps:.0f} GB/s")
    ax.axhline(30, color="r", lw=0.8, ls="--", label="issue target at 16k pages (30 us)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pages per sequence (64 tokens each; 16384 = 1M tokens)")
    ax.set_ylabel("us per layer (scores + top-k, k = 32)")
    cfg = runs[-1][0].get("config", {}) if runs else {}
    ax.set_title(f"Quest selection, B={cfg.get('B')}, {cfg.get('H')} KV heads x {cfg.get('D')}, "
                 f"G={cfg.get('G')}, {runs[-1][0].get('device', '') if runs else ''}", fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="bench_select JSON files, optionally FILE:LABEL")
    ap.add_argument("--hbm", type=float, default=None, help="HBM read GB/s for the read line")
    a = ap.parse_args()
    runs = []
    for spec in a.runs:
        f, _, label = spec.partition(":")
        with open(f) as fh:
            res = json.load(fh)
        runs.append((res, label or res.get("commit", f)[:7]))
    print(plot(runs, a.out, a.hbm))


if __name__ == "__main__":
    main()
