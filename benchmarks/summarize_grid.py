"""Merge bench_decode JSONs into one decode grid: a markdown table, a JSON and a plot.

    PYTHONPATH=. python3 benchmarks/summarize_grid.py --out benchmarks/results/grid_SHA \\
        benchmarks/results/bench_decode_grid-*_SHA.json

One row per (shape, batch, context, configuration, selection lag): decode tokens/s and ms per
step, the ratio to the same point's resident sparse run (b) and the speed-up over its dense
run (a), hit rate, pages fetched and host->device MB per step, the timed fetch rate next to
the same run's bulk ``device_put`` rate, the pool as a share of the logical KV, device peak
memory and host RSS, compile time and the bucket check (compilations of a shorter context
with the same plan). A point measured in several files keeps the figures of the file named
last. A ``.log`` file (a run's printed output, for runs whose JSON was lost) gives the
printed tables' figures, without memory, pages or bytes per step. Writes ``OUT.md`` (one
row per point first, then the table above), ``OUT.json`` and ``OUT.png`` (tokens/s against
context, one panel per shape and batch).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re

CONFIG_ORDER = ("a", "b", "c1", "c2", "c4", "d")
STYLE = {"a": ("#8c8c8c", "s"), "b": ("#55a868", "o"), "c1": ("#c6dbef", "v"),
         "c2": ("#4c72b0", "^"), "c4": ("#08306b", "D"), "d": ("#c44e52", "x")}
GIB = 2.0 ** 30


def context_label(n: int) -> str:
    """1048576 -> '1M', 131072 -> '128k'."""
    if n >= 2 ** 20 and n % 2 ** 20 == 0:
        return f"{n // 2 ** 20}M"
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _get(d: dict, key: str, scale: float = 1.0):
    v = d.get(key)
    return None if v is None else v * scale


def rows_of(res: dict, path: str) -> list[dict]:
    """The rows of one bench_decode JSON (see the module docstring for the columns)."""
    lag = (res.get("settings") or {}).get("selection_lag", 0) or 0
    bulk = (res.get("bulk_h2d_gbps") or {}).get("mean")
    out = []
    for case in res.get("cases", []):
        by_config = {r["config"]: r for r in case.get("results", [])}
        base_b, base_a = by_config.get("b"), by_config.get("a")
        for cfg, r in by_config.items():
            if not r.get("tokens_per_s"):
                continue
            row = {
                "shape": case["shape"], "batch": case["batch"], "context": case["context"],
                "config": cfg, "selection_lag": 0 if cfg == "a" else lag,
                "tokens_per_s": r["tokens_per_s"], "step_ms": r["step_ms"],
                "vs_b": r["tokens_per_s"] / base_b["tokens_per_s"] if base_b else None,
                "vs_a": r["tokens_per_s"] / base_a["tokens_per_s"] if base_a else None,
                "hit_rate": r.get("hit_rate"),
                "pages_fetched_per_step": r.get("pages_fetched_per_step"),
                "h2d_mb_per_step": _get(r, "h2d_bytes_per_step", 1e-6),
                "fetch_gbps": r.get("fetch_gbps"), "bulk_gbps": bulk,
                "pool_fraction": r.get("pool_fraction_of_logical"),
                "device_peak_gib": _get(r, "device_peak_bytes_in_use", 1 / GIB),
                "host_rss_gib": _get(r, "host_rss_bytes", 1 / GIB),
                "compile_s": r.get("compile_s"),
                "bucket_compilations": (case.get("bucket_check") or {}).get("compilations"),
                "split_ms": r.get("split_ms"),
                "commit": res.get("commit"), "date": res.get("date"), "file": path,
            }
            out.append(row)
    return out


def _num(tok: str):
    return None if tok in ("-", "nan") else float(tok)


def _pct(tok: str):
    v = _num(tok)
    return None if v is None else v / 100


def rows_of_log(text: str, path: str) -> list[dict]:
    """Rows from the summary tables a bench_decode run prints (for runs whose JSON did not come
    back): tok/s, step, split, hit rate, fetch GB/s, pool %, compile s; no memory figures."""
    out, meta, bucket = [], {}, None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"bench_decode on (.+?) \(jax (\S+), commit (\w+)\); bulk H2D ([\d.]+) GB/s",
                     line)
        if m:
            meta = dict(device=m.group(1), jax=m.group(2), commit=m.group(3),
                        bulk=float(m.group(4)))
            continue
        if line.startswith("no recompilation within a bucket:"):
            bucket = 0 if line.split(":")[1].strip() == "True" else None
            for r in out:
                r.setdefault("bucket_compilations", bucket)
            continue
        t = line.split()
        # 15 columns, or 18 with the roofline's (floor ms, roof%, peak%) since bench_decode has them
        if not meta or len(t) not in (15, 18) or not t[1].isdigit() or not t[2].isdigit():
            continue
        roof = dict(floor_ms=_num(t[15]), fraction_of_roofline=_pct(t[16]),
                    fraction_of_peak_roofline=_pct(t[17])) if len(t) == 18 else {}
        shape, B, ctx, cfg = t[0], int(t[1]), int(t[2]), t[3]
        out.append(dict(shape=shape, batch=B, context=ctx, config=cfg, selection_lag=0,
                        tokens_per_s=float(t[4]), step_ms=float(t[5]),
                        split_ms=dict(zip(("selector", "ensure", "fetch", "attention", "rest"),
                                          map(_num, t[6:11]))),
                        hit_rate=_num(t[11]), fetch_gbps=_num(t[12]), bulk_gbps=meta["bulk"],
                        pool_fraction=None if cfg in ("a", "b") else _num(t[13]) / 100,
                        compile_s=_num(t[14]), pages_fetched_per_step=None,
                        h2d_mb_per_step=None, device_peak_gib=None, host_rss_gib=None,
                        commit=meta["commit"], date=None, file=path, source="log", **roof))
    by_point = {}
    for r in out:
        by_point.setdefault((r["shape"], r["batch"], r["context"]), {})[r["config"]] = r
    for point in by_point.values():
        a, b = point.get("a"), point.get("b")
        for r in point.values():
            r["vs_b"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
            r["vs_a"] = r["tokens_per_s"] / a["tokens_per_s"] if a else None
    return out


def merge(paths: list[str]) -> list[dict]:
    """Rows of every file, the last file winning per point, sorted by shape, batch, context and
    configuration."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            rows_in = (rows_of_log(f.read(), path) if path.endswith(".log")
                       else rows_of(json.load(f), path))
        for row in rows_in:
            key = (row["shape"], row["batch"], row["context"], row["config"],
                   row["selection_lag"])
            rows[key] = row
    order = {c: i for i, c in enumerate(CONFIG_ORDER)}
    return sorted(rows.values(), key=lambda r: (r["shape"], r["batch"], r["context"],
                                                order.get(r["config"], 99), r["selection_lag"]))


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(rows: list[dict]) -> str:
    """One markdown table of the merged rows."""
    head = ("| shape | B | context | config | tok/s | ms/step | / b | x a | hit rate | "
            "pages in / step | H2D MB / step | fetch / bulk GB/s | pool % of KV | "
            "device peak GiB | host RSS GiB | compile s | bucket recompiles | commit |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        name = r["config"] + (" (lag 1)" if r["selection_lag"] else "")
        rate = (f"{_fmt(r['fetch_gbps'], '.1f')} / {_fmt(r['bulk_gbps'], '.1f')}"
                if r["config"] not in ("a", "b") else "-")
        host = r["config"] not in ("a", "b")
        lines.append(
            f"| {r['shape']} | {r['batch']} | {context_label(r['context'])} | {name} | "
            f"{_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['step_ms'], '.3f')} | "
            f"{_fmt(r['vs_b'], '.3f')} | {_fmt(r['vs_a'], '.2f')} | "
            f"{_fmt(r['hit_rate'], '.4f') if host else '-'} | "
            f"{_fmt(r['pages_fetched_per_step'], '.1f') if host else '-'} | "
            f"{_fmt(r['h2d_mb_per_step'], '.2f') if host else '-'} | {rate} | "
            f"{_fmt(100 * r['pool_fraction'], '.2f') if host and r['pool_fraction'] else '-'} | "
            f"{_fmt(r['device_peak_gib'], '.1f')} | {_fmt(r['host_rss_gib'], '.1f')} | "
            f"{_fmt(r['compile_s'], '.1f')} | {_fmt(r['bucket_compilations'], 'd')} | "
            f"{r['commit'] or '-'}{' (log)' if r.get('source') == 'log' else ''} |")
    return "\n".join(lines) + "\n"


def wide_markdown(rows: list[dict]) -> str:
    """One row per point: tokens/s of each configuration, then c2 / b and c2 / a."""
    cfgs = [c for c in CONFIG_ORDER if any(r["config"] == c for r in rows)]
    head = ("| shape | B | context | " + " | ".join(f"{c} tok/s" for c in cfgs)
            + " | c2 / b | c2 / a |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    points: dict[tuple, dict] = {}
    for r in rows:
        if r["selection_lag"] == 0:
            points.setdefault((r["shape"], r["batch"], r["context"]), {})[r["config"]] = r
    for (shape, batch, ctx), by in points.items():
        c2 = by.get("c2")
        lines.append(f"| {shape} | {batch} | {context_label(ctx)} | "
                     + " | ".join(_fmt(by[c]["tokens_per_s"], ".1f") if c in by else "-"
                                  for c in cfgs)
                     + f" | {_fmt(c2 and c2['vs_b'], '.3f')} | {_fmt(c2 and c2['vs_a'], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str = ""):
    """Tokens/s against context (log-log), one panel per (shape, batch), one line per config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["shape"], r["batch"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (shape, batch) in zip(axes[0], panels):
        mine = [r for r in rows if (r["shape"], r["batch"]) == (shape, batch)]
        for cfg in CONFIG_ORDER:
            for lag in (0, 1):
                pts = sorted((r["context"], r["tokens_per_s"]) for r in mine
                             if r["config"] == cfg and r["selection_lag"] == lag)
                if not pts:
                    continue
                color, marker = STYLE[cfg]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                        linestyle="--" if lag else "-",
                        label=cfg + (" lag 1" if lag else ""))
        ctxs = sorted({r["context"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ctxs, [context_label(c) for c in ctxs])
        ax.set_title(f"{shape} B={batch}", fontsize=9)
        ax.set_xlabel("context tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench_decode JSONs or logs (the last one wins per "
                                             "point)")
    ap.add_argument("--out", required=True, help="output prefix: writes OUT.md, OUT.json, OUT.png")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    rows = merge(a.files)
    commits = sorted({r["commit"] for r in rows if r["commit"]})
    devices = set()
    for path in a.files:
        if path.endswith(".log"):
            continue
        with open(path) as f:
            res = json.load(f)
        devices.add((res.get("device"), res.get("jax_version")))
    meta = {"commits": commits, "devices": sorted(f"{d} (jax {v})" for d, v in devices),
            "files": list(a.files)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    table = markdown(rows)
    with open(a.out + ".md", "w") as f:
        f.write(f"Commits {', '.join(commits)}; {'; '.join(meta['devices'])}\n\n"
                + wide_markdown(rows) + "\n" + table)
    if not a.no_plot:
        plot(rows, a.out + ".png", title=f"decode grid, {', '.join(meta['devices'])}, "
                                         f"commit {', '.join(commits)}")
    print(table)
    return rows


if __name__ == "__main__":
    main()
