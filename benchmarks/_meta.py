"""Run metadata shared by the benchmark scripts."""
import os
import subprocess


def commit() -> str:
    """The commit being measured: $JAXKV_COMMIT (set it on machines without .git), else git."""
    if os.environ.get("JAXKV_COMMIT"):
        return os.environ["JAXKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def time_calls(f, args, reps: int) -> float:
    """Median seconds of ``reps`` calls ``f(*args)`` (each waited for), after one warm-up call."""
    import time

    import jax
    import numpy as np

    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_chained(body, init, args, iters: int, reps: int, unroll: int, warmups: int = 1) -> float:
    """Median seconds per ``body`` call in a jitted ``fori_loop`` of ``iters`` iterations, each
    making ``unroll`` chained calls ``c = body(i * unroll + u, c, *args)`` (the loop's own
    per-iteration cost, ~10 us on GPU (docs/decisions.md), is spread over them as in an
    unrolled layer loop)."""
    import time

    import jax
    import numpy as np

    def it(i, c, a):
        for u in range(unroll):
            c = body(i * unroll + u, c, *a)
        return c

    f = jax.jit(lambda c, a: jax.lax.fori_loop(0, iters, lambda i, c: it(i, c, a), c))
    for _ in range(warmups):
        jax.block_until_ready(f(init, args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(init, args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / iters / unroll


def write_rows(out_dir: str, name: str, rows: list) -> dict:
    """Write ``{"meta": ..., "rows": rows}`` to ``out_dir/name`` (the device, date, commit and
    jax version of this run as ``meta``) and return the meta."""
    import datetime
    import json

    import jax

    meta = dict(device=str(jax.devices()[0].device_kind), date=datetime.date.today().isoformat(),
                commit=commit(), jax=jax.__version__)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return meta


def names_of(known, what: str = "names"):
    """An argparse ``type`` for a comma-separated list of names out of ``known``: the list, or
    an argparse error naming the unknown ones and the choices (before anything runs)."""
    import argparse

    def parse(text: str) -> list:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                (f"unknown {what}: {', '.join(bad)}" if bad else f"{text!r} names no {what}")
                + f" (choose from {', '.join(sorted(known))})")
        return names
    return parse
