"""Decode benchmark: tokens/s and step-time split, dense / sparse / host tier, long contexts.

Run on the H200 (whole default grid, about 9 minutes with the time budget):
    PYTHONPATH=. python3 benchmarks/bench_decode.py --out benchmarks/results
Subsets, e.g.:  --shape 8b --contexts 128k --batches 1,8 --configs a,b,c --prefill none
CPU smoke test (seconds):  PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --out /tmp/bd
Real-text selection overlap (SmolLM2-135M at 8k, CPU ok, a few minutes; writes
selection_overlap.json, which later runs read from benchmarks/results/):
    PYTHONPATH=. python3 benchmarks/bench_decode.py --measure-overlap --out benchmarks/results

The configurations (a dense resident, b sparse resident, c1/c2/c4 host tier with a 1x/2x/4x
pool, d host tier without cache) and what is measured: decode_lib.py, which does the work;
this file is its command line. Writes bench_decode.json (+ bench_decode.png) to --out and
prints a short table last.

Several GPUs: ``--devices N`` runs every case tensor-parallel over KV heads on N devices and
writes bench_decode_tpN.json; compare with the one-device run of the same grid. CPU smoke
test (2 virtual devices):
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --devices 2 --out /tmp/bd
"""
from __future__ import annotations

import os
import sys


def _devices_arg(argv) -> int:
    """--devices read before JAX starts (it sets the CPU device count); a bad value is left to
    argparse, which names it."""
    for i, a in enumerate(argv):
        v = argv[i + 1] if a == "--devices" and i + 1 < len(argv) else \
            a.split("=", 1)[1] if a.startswith("--devices=") else None
        if v is not None:
            return int(v) if v.isdigit() else 1
    return 1


if __name__ == "__main__" and _devices_arg(sys.argv) > 1 and \
        "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # CPU smoke tests: N virtual CPU devices (the CPU platform only; GPUs are unaffected)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_devices_arg(sys.argv)}").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _numa  # noqa: E402  (benchmarks/_numa.py)
import decode_lib as lib  # noqa: E402



def _configs(text: str) -> list:
    """--configs: the names, each of decode_lib.CONFIG_ORDER or c."""
    cfgs = [c.strip() for c in text.split(",") if c.strip()]
    known = set(lib.CONFIG_ORDER) | {"c"}
    if not cfgs or set(cfgs) - known:
        raise argparse.ArgumentTypeError(
            f"{text!r} names {sorted(set(cfgs) - known) or 'nothing'}; choose from "
            f"{', '.join(lib.CONFIG_ORDER)} (c = c1, c2 and c4 by --pools)")
    return cfgs


def _tuning(items) -> tuple:
    """--tuning NAME=VALUE ...: sorted (name, value) pairs of ``jaxkv.Tuning`` fields, checked
    by building the Tuning (a ValueError names what is wrong)."""
    import dataclasses

    from jaxkv import Tuning
    fields = {f.name for f in dataclasses.fields(Tuning)}
    kw = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ValueError(f"{item!r} is not NAME=VALUE with NAME a Tuning field "
                             f"({', '.join(sorted(fields))})")
        low = text.strip().lower()
        value = {"true": True, "false": False, "none": None}.get(low, text.strip())
        if isinstance(value, str):
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
        kw[name] = value
    Tuning(**kw)
    return tuple(sorted(kw.items()))


def _pools(text: str) -> tuple:
    """--pools: the host tier's pool sizes, each one of a c<N> configuration."""
    try:
        pools = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of ints") from None
    if not pools:  # every case's memory plan sizes the largest pool
        raise argparse.ArgumentTypeError(f"{text!r} names no pool size; give some of 1,2,4 "
                                         "(the default)")
    host_pools = {int(c[1:]) for c in lib.CONFIG_ORDER if c[0] == "c"}
    if set(pools) - host_pools:
        raise argparse.ArgumentTypeError(
            f"{sorted(set(pools) - host_pools)} have no configuration; the host tier's pools "
            f"are {sorted(host_pools)} (x the working set)")
    return pools


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (bench_decode.json, .png)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke test (also runs on CPU)")
    ap.add_argument("--shape", default="all", choices=("8b", "qwen1.5b", "all"))
    ap.add_argument("--contexts", default="", help="e.g. 128k,1M (default: the priority grid)")
    ap.add_argument("--batches", default="", help="e.g. 1,8")
    ap.add_argument("--configs", default="a,b,c,d", type=_configs, help="subset of a,b,c,d (c = every --pools)")
    ap.add_argument("--pools", default="1,2,4", type=_pools, help="pool sizes of (c), in selections")
    ap.add_argument("--prefill", default="", help="prompt lengths for prefill (default 32k,128k; "
                                                   "'none' to skip)")
    ap.add_argument("--selector", default="quest", choices=lib.SELECTORS,
                    help="the sparse configurations' selector (quest_rescore8: the library's "
                         "default, CacheConfig(); run it with --selected-tokens 1024)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--selected-tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later points are skipped")
    ap.add_argument("--overlap", type=float, default=None, help="target overlap (default: "
                                                                 "results/selection_overlap.json)")
    ap.add_argument("--probe-steps", type=int, default=16)
    ap.add_argument("--host-mem-gb", type=float, default=96.0)
    ap.add_argument("--devices", type=int, default=1,
                    help="tensor parallelism over KV heads on N devices (writes "
                         "bench_decode_tpN.json unless --tag)")
    ap.add_argument("--selection-lag", type=int, default=0, choices=(0, 1),
                    help="CacheConfig.selection_lag of the sparse configs: 1 = pages chosen with "
                         "the previous token's queries")
    ap.add_argument("--kv-dtype", default=None,
                    choices=("bfloat16", "float32", "float16", "float8_e4m3fn", "float8_e5m2", "int8"),
                    help="CacheConfig.kv_dtype of every config (default: the model's dtype)")
    ap.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE",
                    help="a jaxkv.Tuning field of every configuration (repeatable), e.g. "
                         "--tuning materialize_qk=false --tuning rescore_select_warps=4; "
                         "values: true / false / none, an int, a float or a string")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="prefill section only")
    ap.add_argument("--tag", default="", help="write bench_decode_<tag>.json / .png")
    ap.add_argument("--trace", default="", help="profile one more round per config into this "
                    "dir; the per-kernel table goes into the JSON ('kernels')")
    ap.add_argument("--timed-rounds", type=int, default=2,
                    help="timed decode rounds per configuration (round_steps steps each)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="re-measure b and c2 alternately N times; the 128k target uses the "
                         "median per-pair ratio")
    ap.add_argument("--bind-numa", action="store_true",
                    help="run on the GPU's local CPUs (its NUMA node; before JAX allocates)")
    ap.add_argument("--measure-overlap", action="store_true",
                    help="measure the real-text overlap (SmolLM2) into --out and exit")
    a = ap.parse_args(argv)
    if a.devices < 1:
        ap.error(f"--devices must be >= 1, got {a.devices}")
    try:
        tuning = _tuning(a.tuning)
    except ValueError as e:
        ap.error(f"--tuning: {e}")
    if a.pairs < 0:
        ap.error(f"--pairs must be >= 0 (0: no pairs), got {a.pairs}")
    numa = _numa.bind_to_gpu() if a.bind_numa else _numa.gpu_numa()
    if a.measure_overlap:
        r = lib.measure_overlap(page_size=a.page_size, selected_tokens=a.selected_tokens,
                                selector=a.selector)
        r.update(device=lib._device_str(),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 commit=lib._commit(), jax_version=jax.__version__)
        os.makedirs(a.out, exist_ok=True)
        # each selector's overlap in its own file (Quest's: OVERLAP_FILE), the calibration
        # target of that selector's runs
        with open(os.path.join(a.out, lib.overlap_file(a.selector)), "w") as f:
            json.dump(r, f, indent=1)
        print(f"real-text overlap {r['mean']:.3f} (union over heads {r['union_mean']:.3f}, "
              f"excluding forced pages {r['excl_forced_mean']:.3f}, chance {r['chance_overlap']:.3f}); "
              f"next-token accuracy {r['next_token_accuracy']:.3f}; {r['seconds']:.0f} s")
        return
    cfgs, pools = a.configs, a.pools
    try:
        contexts = [lib.parse_tokens(x) for x in a.contexts.split(",") if x.strip()] or None
        prefill_arg = [] if a.prefill.strip().lower() == "none" else \
            [lib.parse_tokens(x) for x in a.prefill.split(",") if x.strip()]
        batches = [int(x) for x in a.batches.split(",") if x.strip()] or None
    except ValueError as e:
        ap.error(f"--contexts / --prefill / --batches: {e}")
    expanded = tuple(c for c in lib.CONFIG_ORDER
                     if c in cfgs or (c[0] == "c" and ("c" in cfgs or c in cfgs)))
    if a.pairs > 0:  # the paired run needs b, c2 (a pool of 2) and the decode section
        why = [w for w, missing in (("--configs leaves out b", "b" not in expanded),
                                    ("--configs leaves out c2", "c2" not in expanded),
                                    ("--pools leaves out 2 (c2)", 2 not in pools),
                                    ("--no-decode skips decoding", a.no_decode)) if missing]
        if why:
            print(f"bench_decode: --pairs {a.pairs} has no effect: it pairs b with c2, and "
                  f"{'; '.join(why)}", file=sys.stderr)
    st = lib.Settings(page_size=a.page_size, selected_tokens=a.selected_tokens,
                      selector=a.selector, budget_s=a.budget, probe_steps=a.probe_steps,
                      host_mem_gb=a.host_mem_gb, pools=pools, configs=expanded,
                      devices=a.devices, trace=a.trace, timed_rounds=a.timed_rounds,
                      pairs=a.pairs, selection_lag=a.selection_lag, kv_dtype=a.kv_dtype,
                      tuning=tuning)
    shapes = ("8b", "qwen1.5b") if a.shape == "all" else (a.shape,)
    prefill = () if a.prefill.strip().lower() == "none" else (prefill_arg or None)
    lib.run(a.out, quick=a.quick, shapes=shapes, contexts=contexts, batches=batches,
            settings=st, prefill=prefill, overlap_target=a.overlap, plot=not a.no_plot,
            decode=not a.no_decode, tag=a.tag, numa=numa)


if __name__ == "__main__":
    main()
