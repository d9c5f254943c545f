"""CPU speed of jaxkv.generate next to transformers: SmolLM2-135M-Instruct (the bundled GGUF,
or ``--gguf FILE``; float32, one request), prefill tokens/s at 512 / 2k / 8k prompt tokens
and decode tokens/s, resident (dense selector) and host tier (Quest, 256 tokens: 16 pages of 16); ``--modes ...
default``: ``CacheConfig()`` as a call without ``cache=`` gets it (the two-stage selector at
1024 tokens, host tier); ``default-xla``: the same with the second stage's XLA reference
(``Tuning(rescore_method="xla")``) in place of the CPU's blocked formulation; ``default-p8`` /
``default-p8b2``: the default's 1024 tokens in 8-token pages (``page_size=8,
selected_pages=128``), the second with the first stage by blocks of two (``candidate_block=2``);
``s512`` / ``s512c256``: 512 tokens (``selected_pages=32``) with the default's 512 candidates
(its floor of 8192 tokens' pages) and with the 8x multiple's 256 (``candidate_pages=256``).

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/bench_cpu.py --out DIR \\
        [--lengths 512 2048 8192] [--new 32] [--reps 2] [--torch-python /path/to/python]
    # smoke test with a random tiny model (no GGUF, no torch), about half a minute:
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/bench_cpu.py --out DIR --quick

Per mode and prompt length (8k: 8192 less the new tokens, the model's context): one call to
compile (its compile time is reported), then ``--reps`` timed calls of ``generate`` (random
token ids, ``--new`` new tokens, greedy); the figures are the best and the median of ``stats["prefill_tokens_per_s"]`` (the whole prefill:
embedding, the layers, the first token) and ``stats["decode_tokens_per_s"]``. Also per length:
the time of the prefill attention alone (the default implementation, one layer's shapes, times
the layer count), so the rest of the prefill (the per-token work) can be read per token: the
prefill grows with the attention's T^2 share only when that stays flat.

transformers: with torch and transformers importable here, or in the interpreter given by
``--torch-python`` (a Python 3.11 venv: the CPU torch wheel is for 3.11), a worker process runs
``LlamaForCausalLM`` from the same GGUF in float32 (SDPA attention): prefill = one forward of
the prompt with the cache (``logits_to_keep=1``), decode = the median step of ``--new`` greedy
steps with the cache. Without torch the JSON records the issue's comparison figures instead
(issue 34, a 2-core machine of the same kind). Each figure carries the 1-minute load average
at its measurement: the machines are shared, compare figures measured close together.

Writes ``DIR/bench_cpu.json`` and ``DIR/bench_cpu.md`` (``--tag T``: ``bench_cpu_T.*``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# transformers on a machine of the same kind, issue 34 (used when torch is not available)
ISSUE_TRANSFORMERS = {
    "source": "issue 34 (2-core CPU machine, torch float32, one request, no measurement here)",
    "end_to_end": [
        {"prompt_tokens": 2048, "new_tokens": 24, "seconds": 4.6},
        {"prompt_tokens": 4096, "new_tokens": 24, "seconds": 10.6},
        {"prompt_tokens": 7168, "new_tokens": 24, "seconds": 23.0},
    ],
}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [1] + [int(t) for t in rng.integers(100, min(vocab, 40000), n - 1)]


# ---------------------------------------------------------------------------- transformers
def torch_worker(lengths: list[int], new: int, reps: int, gguf: str) -> list[dict]:
    """transformers' prefill and decode speed (run in an interpreter with torch; no jax)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    rows = []
    for n in lengths:
        n = min(n, model.config.max_position_embeddings - new)
        ids = torch.tensor([_prompt(n, model.config.vocab_size)])
        pre, dec = [], []
        for rep in range(reps + 1):  # the first call warms up
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model(ids, use_cache=True, logits_to_keep=1)
                t1 = time.perf_counter()
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                steps = []
                for _ in range(new):
                    s = time.perf_counter()
                    o = model(tok, past_key_values=past, use_cache=True)
                    past, tok = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                    steps.append(time.perf_counter() - s)
            if rep:
                pre.append(n / (t1 - t0))
                dec.append(1.0 / float(np.median(steps)))
        rows.append({"prompt_tokens": n, "prefill_tokens_per_s": max(pre),
                     "prefill_tokens_per_s_median": float(np.median(pre)),
                     "decode_tokens_per_s": max(dec),
                     "decode_tokens_per_s_median": float(np.median(dec)), "load": _load(),
                     "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "attention": model.config._attn_implementation})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def run_transformers(args, gguf: str):
    python = args.torch_python
    if python is None:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
            python = sys.executable
        except ImportError:
            return None
    cmd = [python, str(Path(__file__).resolve()), "--torch-worker", "--gguf", gguf,
           "--lengths", *map(str, args.lengths), "--new", str(args.new), "--reps", str(args.reps)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"transformers worker failed ({python})")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- jaxkv
def attention_seconds(cfg, n: int, reps: int) -> float:
    """One layer's prefill attention (default implementation) at the bucket of ``n`` tokens,
    times the layer count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from _meta import time_calls
    from jaxkv.kernels.prefill_attention import prefill_attention

    T = 1 << max(0, n - 1).bit_length()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, T, cfg.num_heads, cfg.head_dim)), cfg.dtype)
    k = jnp.asarray(rng.standard_normal((1, T, cfg.num_kv_heads, cfg.head_dim)), cfg.dtype)
    lens = jnp.asarray([n], jnp.int32)
    f = jax.jit(lambda q, k, v, l: prefill_attention(q, k, v, l))
    return cfg.num_layers * time_calls(f, (q, k, k, lens), reps)


def run_jaxkv(args, cfg, params) -> list[dict]:
    import numpy as np

    import jaxkv

    modes = {"resident": dict(mode="resident", selector="dense"),
             "host": dict(mode="host", selector="quest", page_size=16, selected_pages=16),
             "default": {},
             # the default with the second stage's XLA reference instead of the CPU's blocked
             # formulation (an A/B of the two in one process: --modes default default-xla)
             "default-xla": dict(tuning=jaxkv.Tuning(rescore_method="xla")),
             # the default's 1024 tokens in 8-token pages, per page and with the first stage
             # by blocks of two (the page-size question of docs/decisions.md)
             "default-p8": dict(page_size=8, selected_pages=128),
             "default-p8b2": dict(page_size=8, selected_pages=128, candidate_block=2),
             # 512 tokens with the default's candidates (the floor of 8192 tokens' pages: 512)
             # and with the 8x multiple's 256 (the floor's cost on the CPU)
             "s512": dict(selected_pages=32),
             "s512c256": dict(selected_pages=32, candidate_pages=256)}
    rows = []
    for n in args.lengths:
        n = min(n, cfg.max_position - args.new)  # 8k: the prompt leaves room for the new tokens
        attn = attention_seconds(cfg, n, max(1, args.reps))
        for mode in args.modes:
            cache = jaxkv.CacheConfig(**modes[mode])
            ids = _prompt(n, cfg.vocab_size)
            first = jaxkv.generate(cfg, params, [ids], max_new_tokens=args.new, cache=cache)
            stats = []
            for _ in range(args.reps):
                r = jaxkv.generate(cfg, params, [ids], max_new_tokens=args.new, cache=cache)
                stats.append(dict(r.stats, load=_load()))
            pre = [s["prefill_tokens_per_s"] for s in stats]
            dec = [s["decode_tokens_per_s"] for s in stats]
            best = max(stats, key=lambda s: s["prefill_tokens_per_s"])
            rows.append({
                "mode": mode, "selector": cache.selector, "prompt_tokens": n,
                "budget_tokens": (None if cache.selector == "dense"
                                  else cache.selected_pages * cache.page_size),
                "new_tokens": args.new,
                "prefill_tokens_per_s": max(pre), "prefill_tokens_per_s_median": float(np.median(pre)),
                "decode_tokens_per_s": max(dec), "decode_tokens_per_s_median": float(np.median(dec)),
                "prefill_s": best["prefill_time_s"],
                "attention_s": attn, "rest_ms_per_token": 1e3 * (best["prefill_time_s"] - attn) / n,
                "first_call_compile_s": first.stats["compile_time_s"],
                "first_call_prefill_s": first.stats["prefill_time_s"],
                "loads": [s["load"] for s in stats]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def cpu_model() -> str:
    """The processor's name from /proc/cpuinfo ("unknown" elsewhere): the comparison depends
    on it (torch's MKL and oneDNN paths differ between vendors)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def markdown(res: dict) -> str:
    out = [f"# bench_cpu ({res['model']}, {res['cpus']} CPUs ({res.get('cpu_model', '?')}), "
           f"jax {res['jax']}, commit {res['commit'][:7]}, {res['date']})", "",
           "| mode | prompt | prefill tok/s (best / median) | decode tok/s (best / median) | "
           "attention s | rest ms/token | compile s | load |", "|---|---|---|---|---|---|---|---|"]
    for r in res["jaxkv"]:
        sel = r.get("selector", "")
        budget = r.get("budget_tokens")
        sel = f"{sel} {budget}" if budget else sel
        out.append(f"| {r['mode']} ({sel}) | {r['prompt_tokens']} | {r['prefill_tokens_per_s']:.0f} / "
                   f"{r['prefill_tokens_per_s_median']:.0f} | {r['decode_tokens_per_s']:.1f} / "
                   f"{r['decode_tokens_per_s_median']:.1f} | {r['attention_s']:.2f} | "
                   f"{r['rest_ms_per_token']:.2f} | {r['first_call_compile_s']:.1f} | "
                   f"{'-'.join(map(str, r['loads']))} |")
    t = res["transformers"]
    if isinstance(t, list):
        out += ["", "transformers (same machine):", "",
                "| prompt | prefill tok/s (best / median) | decode tok/s (best / median) | load |",
                "|---|---|---|---|"]
        for r in t:
            out.append(f"| {r['prompt_tokens']} | {r['prefill_tokens_per_s']:.0f} / "
                       f"{r['prefill_tokens_per_s_median']:.0f} | {r['decode_tokens_per_s']:.1f} / "
                       f"{r['decode_tokens_per_s_median']:.1f} | {r['load']} |")
    else:
        out += ["", f"transformers: not measured here; {t['source']}:", ""]
        out += [f"- {e['prompt_tokens']} prompt + {e['new_tokens']} new tokens in {e['seconds']} s"
                for e in t["end_to_end"]]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", help="suffix of the output names (bench_cpu_TAG.json / .md)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--modes", nargs="+", default=["resident", "host"],
                    choices=["resident", "host", "default", "default-xla", "default-p8",
                             "default-p8b2", "s512", "s512c256"],
                    help="repeat modes to alternate them (same process)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per call (decode steps)")
    ap.add_argument("--reps", type=int, default=2, help="timed calls after the first")
    ap.add_argument("--torch-python", default=None,
                    help="interpreter with torch + transformers + gguf for the comparison")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="random tiny model, short prompts, no transformers (a smoke test)")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", default=None,
                    help="a GGUF model file (default: the bundled SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.torch_worker:
        print(json.dumps(torch_worker(args.lengths, args.new, args.reps, args.gguf)))
        return
    if args.out is None:
        ap.error("--out is required")
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import jax

    from _meta import commit
    from jaxkv.models import configs, gguf_loader, llama

    if args.quick:
        args.lengths, args.new, args.reps = [128], 8, 1
        cfg = configs.tiny(max_position=4096)
        params, gguf, name = llama.init_params(cfg, 0), None, "tiny (random)"
    else:
        gguf = args.gguf or str(gguf_loader.default_model_path())
        cfg, params = gguf_loader.load_gguf(gguf, dtype="float32")
        name = ("SmolLM2-135M-Instruct" if args.gguf is None else Path(gguf).stem) + " f32"
    res = {"model": name, "backend": jax.default_backend(), "cpus": os.cpu_count(),
           "cpu_model": cpu_model(),
           "jax": jax.__version__, "commit": commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "args": vars(args)}
    res["jaxkv"] = run_jaxkv(args, cfg, params)
    t = None if (args.quick or args.no_torch) else run_transformers(args, gguf)
    res["transformers"] = t if t is not None else ISSUE_TRANSFORMERS
    os.makedirs(args.out, exist_ok=True)
    stem = f"bench_cpu_{args.tag}" if args.tag else "bench_cpu"
    Path(args.out, f"{stem}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    Path(args.out, f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
