"""Summarise a jax.profiler trace: where the device time of a decode step goes.

    PYTHONPATH=. python3 benchmarks/trace_summary.py TRACE_DIR [--steps N] [--top 40]

Reads the ``perfetto_trace.json.gz`` that ``jax.profiler.trace(dir, create_perfetto_trace=True)``
writes, keeps the events of the device processes (GPU streams), and prints per kernel name: count,
total and mean microseconds, the share of the kernels' summed time, and the exclusive time (the
part of each kernel's interval past every earlier-starting kernel's end: these add up to the busy
time, and leave out a kernel's wait for its predecessor under programmatic dependent launch); then
the span and the busy time (union of kernel intervals), divided by ``--steps`` when given.
``summarise`` returns the same as a dict (benchmarks put it in their JSON).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


def _load(trace_dir: str):
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def _short(name: str) -> str:
    """Kernel name without numeric suffixes, so repeated fusions group together."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))


def summarise(trace_dir: str, steps: int = 1, top: int = 40) -> dict:
    ev = _load(trace_dir)
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {p for p, n in pname.items() if "GPU" in n or "device" in n.lower() and "CPU" not in n}
    ks = [e for e in ev if e.get("ph") == "X" and e.get("pid") in dev and e.get("dur", 0) > 0]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_group = collections.defaultdict(lambda: [0, 0.0])
    sample = {}
    for e in ks:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
        g = _short(e["name"])
        sample.setdefault(g, {k: str(v)[:160] for k, v in (e.get("args") or {}).items()})
        by_group[g][0] += 1
        by_group[g][1] += e["dur"]
    # Busy time (the union of the kernels' intervals), shared out: each kernel in start order
    # is credited with the part of its interval past every earlier kernel's end. Under
    # programmatic dependent launch a kernel starts before its predecessor ends and waits for
    # it, so its own duration includes the wait; its exclusive time does not.
    busy, cur_e = 0.0, None
    excl = collections.defaultdict(float)
    for e in sorted(ks, key=lambda e: (e["ts"], e["ts"] + e["dur"])):
        s, t = e["ts"], e["ts"] + e["dur"]
        x = t - s if cur_e is None else max(0.0, t - max(s, cur_e))
        excl[_short(e["name"])] += x
        busy += x
        cur_e = t if cur_e is None else max(cur_e, t)
    span = (max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)) if ks else 0.0
    total = sum(v[1] for v in by_name.values())
    rows = sorted(by_group.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(
        processes=[pname[p] for p in sorted(dev)], all_processes=sorted(pname.values()),
        kernels=len(ks), steps=steps,
        span_us_per_step=span / steps, busy_us_per_step=busy / steps,
        kernels_per_step=len(ks) / steps, kernel_us_sum_per_step=total / steps,
        top=[dict(name=n, count_per_step=c / steps, us_per_step=t / steps, mean_us=t / max(c, 1),
                  share=t / max(total, 1e-9), exclusive_us_per_step=excl[n] / steps,
                  args=sample.get(n, {})) for n, (c, t) in rows])


def print_summary(s: dict) -> None:
    print(f"device processes: {s['processes']} (all: {s['all_processes']})")
    print(f"per step: span {s['span_us_per_step']:.0f} us, busy {s['busy_us_per_step']:.0f} us, "
          f"{s['kernels_per_step']:.0f} kernels (sum {s['kernel_us_sum_per_step']:.0f} us)")
    print(f"{'kernel (grouped)':60s} {'n/step':>7s} {'us/step':>9s} {'mean us':>8s} {'share':>6s} "
          f"{'excl us':>8s}")
    for r in s["top"]:
        print(f"{r['name'][:60]:60s} {r['count_per_step']:7.1f} {r['us_per_step']:9.1f} "
              f"{r['mean_us']:8.1f} {r['share']:6.1%} {r.get('exclusive_us_per_step', 0.0):8.1f}")
    for r in s["top"][:15]:
        print(f"  {r['name'][:50]}: {r['args']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    print_summary(summarise(a.trace_dir, a.steps, a.top))


if __name__ == "__main__":
    main()
