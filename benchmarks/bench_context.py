"""What a continued turn costs: ``generate(turn, context=ctx)`` against sending the whole
conversation again as one prompt.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/bench_context.py --out DIR \\
        [--contexts 2048 8000] [--turns 16 128 512] [--new 16] [--reps 2] [--gguf FILE]
    # smoke test with the tiny checkpoint of tests/fixtures (random weights), seconds:
    PYTHONPATH=. python benchmarks/bench_context.py --out DIR --quick

Per cache (``--modes``: ``default`` is ``CacheConfig()``, the two-stage selector on the host
tier; ``dense`` the dense selector, resident; ``quest`` Quest on the host tier) and context
length: one request's prompt of random token ids is prefilled once with ``keep=True``; then
per turn length, a turn of random ids continues it (``context=``) and, for comparison, the same conversation (context tokens,
the first call's reply, the turn) runs as one fresh prompt; each with ``--new`` greedy new
tokens. One untimed call of each compiles, then ``--reps`` timed calls; the figures are the
medians of the wall time of ``generate`` and of its stats: ``context_copy_time_s`` (the kept
pages copied for the call), ``prefill_time_s`` (copy plus the turn's prefill against the
context, or the fresh prompt's prefill) and ``decode_time_s``.

Writes ``DIR/bench_context.json`` and ``DIR/bench_context.md`` (with ``--tag T``:
``bench_context_T.*``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = {
    "default": {},
    "dense": {"mode": "resident", "selector": "dense"},
    "quest": {"selector": "quest"},
}


def _ids(n: int, vocab: int, rng) -> list[int]:
    return [int(t) for t in rng.integers(3, min(vocab, 40000), n)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default=None, help="model file (default: jaxkv.load()'s model)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 7680])
    ap.add_argument("--turns", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--modes", nargs="+", default=["default", "dense"], choices=sorted(MODES))
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint, tiny shapes")
    ap.add_argument("--fold-per-token", action="store_true",
                    help="fold the turn's tokens into the summaries one by one (the base "
                         "Selector.fold: update_select per token) instead of the selector's "
                         "own fold: the A/B of the bulk fold")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error(f"--reps must be >= 1, got {a.reps}")

    import jax
    import numpy as np

    import _meta
    import jaxkv
    from jaxkv import CacheConfig

    if a.quick:
        model = jaxkv.load(HERE.parent / "tests" / "fixtures" / "hf_qwen2", compile_cache=False)
        a.contexts, a.turns, a.new, a.reps = [96], [8, 40], 4, 1
        extra = dict(page_size=4, selected_pages=8)
    else:
        model = jaxkv.load(a.gguf) if a.gguf else jaxkv.load()
        extra = {}
    if a.fold_per_token:
        from jaxkv import selectors
        from jaxkv.selectors.base import Selector
        for name in selectors.names():
            type(selectors.get(name)).fold = Selector.fold
    cfg = model.config
    rng = np.random.default_rng(0)
    rows = []
    for mode in a.modes:
        cache = CacheConfig(**MODES[mode], **extra)
        for n in a.contexts:
            prompt = _ids(n, cfg.vocab_size, rng)
            first = jaxkv.generate(model, [prompt], cache=cache, max_new_tokens=a.new,
                                   stop_tokens=[], keep=True)
            ctx = first.context
            for m in a.turns:
                turn = _ids(m, cfg.vocab_size, rng)
                whole = prompt + first.tokens[0] + turn
                runs = {"continued": lambda: jaxkv.generate(
                            model, [turn], cache=cache, context=ctx, max_new_tokens=a.new,
                            stop_tokens=[]),
                        "fresh": lambda: jaxkv.generate(
                            model, [whole], cache=cache, max_new_tokens=a.new, stop_tokens=[])}
                got = {}
                for name, call in runs.items():
                    call()                                            # compiles
                    walls, stats = [], []
                    for _ in range(a.reps):
                        t0 = time.perf_counter()
                        r = call()
                        walls.append(time.perf_counter() - t0)
                        stats.append(r.stats)
                    med = lambda k: statistics.median(s.get(k) or 0.0 for s in stats)  # noqa: E731
                    got[name] = dict(wall_s=statistics.median(walls),
                                     copy_s=med("context_copy_time_s"),
                                     prefill_s=med("prefill_time_s"),
                                     decode_s=med("decode_time_s"),
                                     tokens=r.tokens[0])
                row = dict(mode=mode, selector=cache.selector, context_tokens=n, turn_tokens=m,
                           new_tokens=a.new, continued=got["continued"], fresh=got["fresh"],
                           same_tokens=got["continued"]["tokens"] == got["fresh"]["tokens"],
                           load=round(os.getloadavg()[0], 2))
                rows.append(row)
                c, f = row["continued"], row["fresh"]
                print(f"{mode:8s} context {n:6d} turn {m:5d}: continued {c['wall_s']:.2f} s "
                      f"(copy {c['copy_s']:.2f}, prefill {c['prefill_s']:.2f}, decode "
                      f"{c['decode_s']:.2f}), fresh {f['wall_s']:.2f} s, same tokens "
                      f"{row['same_tokens']}", flush=True)

    res = dict(benchmark="bench_context", device=str(jax.devices()[0]),
               backend=jax.default_backend(), cpus=os.cpu_count(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=_meta.commit(), jax_version=jax.__version__, model=cfg.name,
               dtype=cfg.dtype, quick=a.quick, reps=a.reps,
               fold="per token" if a.fold_per_token else "selector", rows=rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_context_{a.tag}" if a.tag else "bench_context"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# bench_context ({cfg.name} {cfg.dtype}, {res['backend']}, {res['cpus']} CPUs, "
             f"jax {jax.__version__}, commit {res['commit'][:7]}, fold {res['fold']}, "
             f"{res['date']})", "",
             "| cache | context | turn | continued s | copy s | turn prefill s | decode s "
             "| one fresh prompt s | fresh / continued | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, f = r["continued"], r["fresh"]
        lines.append(f"| {r['mode']} ({r['selector']}) | {r['context_tokens']} | "
                     f"{r['turn_tokens']} | {c['wall_s']:.2f} | {c['copy_s']:.2f} | "
                     f"{c['prefill_s'] - c['copy_s']:.2f} | {c['decode_s']:.2f} | "
                     f"{f['wall_s']:.2f} | {f['wall_s'] / c['wall_s']:.2f}x | "
                     f"{'yes' if r['same_tokens'] else 'no'} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
