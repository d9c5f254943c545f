"""Multi-device cases for tests/test_parallel.py, run in a subprocess with 4 CPU devices.

``python tests/parallel_cases.py OUT.json [case ...]`` sets
XLA_FLAGS=--xla_force_host_platform_device_count=4 before importing jax (the device count is
fixed at import), runs the named cases (default: all) and writes their results as JSON.
Every case compares tensor-parallel runs against the single-device run of the same call.
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import CacheConfig, Sampling, engine, parallel  # noqa: E402
from jaxkv.api import make_plan  # noqa: E402
from jaxkv.models import configs, llama  # noqa: E402

# 8 query / 4 KV heads of 16 (G = 2), MLP 128: N = 2 and N = 4 both divide
CFG = configs.tiny(num_kv_heads=4, num_heads=8)
PARAMS = llama.init_params(CFG, seed=0)
RNG = np.random.default_rng(int(os.environ.get("JAXKV_TEST_SEED", "8")))
PROMPTS = [[int(t) for t in RNG.integers(3, CFG.vocab_size, n)] for n in (37, 21)]
NEW = 12
QUEST = CacheConfig(mode="host", selector="quest", page_size=4, selected_pages=4)


def _gen(cache, n, cfg=CFG, params=PARAMS, **kw):
    kw.setdefault("max_new_tokens", NEW)
    mesh = None if n == 1 else jax.devices()[:n]
    res = jaxkv.generate(cfg, params, PROMPTS, cache=cache, stop_tokens=[], mesh=mesh, **kw)
    return {"tokens": res.tokens,
            "stats": {k: v for k, v in res.stats.items() if isinstance(v, (int, float, str, dict))}}


def _compare(cache, ns, **kw):
    return {str(n): _gen(cache, n, **kw) for n in (1,) + tuple(ns)}


# --------------------------------------------------------------------------- cases
def case_host_quest():
    return _compare(QUEST, (2, 4))


def case_lagged():
    # lagged selection: Quest per KV head, so each device selects for its own heads
    return _compare(dataclasses.replace(QUEST, selection_lag=1, pool_pages=8), (2,))


def case_host_churn():
    # pool of 6 slots (= k + pinned, the minimum): pages churn on every device; misses are
    # copied to scratch rows first (schedule "scratch"; the default "step" reads them in place)
    return _compare(dataclasses.replace(QUEST, pool_pages=6, schedule="scratch"), (4,))


def case_fp8():
    # fp8 KV with the keys' shift: each device keeps the shift of its own KV heads
    return _compare(dataclasses.replace(QUEST, kv_dtype="float8_e4m3fn", kv_key_shift=True), (2,),
                    max_new_tokens=6)


def case_resident_quest():
    return _compare(dataclasses.replace(QUEST, mode="resident"), (4,))


def case_dense_layer_schedule():
    # dense selector, per-layer LRU ensure, first layer dense (its K/V kept on device too)
    return _compare(CacheConfig(mode="host", selector="dense", page_size=8, schedule="layer",
                                dense_layers=1), (2,))


def case_sampled():
    return _compare(QUEST, (2,), sampling=Sampling.make(temperature=0.8, top_k=20), seed=3)


def case_pallas():
    return _compare(dataclasses.replace(QUEST, implementation="pallas"), (2,), max_new_tokens=5)


def case_bench_decode():
    """The decode benchmark (benchmarks/decode_lib.py) on 2 devices, a quick subset (synthetic
    fill on every device, rebinding through map_state, decode rounds over the mesh)."""
    import tempfile
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import decode_lib
    st = decode_lib.Settings(configs=("b", "c2"), probe_steps=0, devices=2)
    with tempfile.TemporaryDirectory() as d:
        res = decode_lib.run(d, quick=True, batches=[2], settings=st, prefill=(64,), plot=False)
        files = sorted(os.listdir(d))
    cases = res["cases"]
    return {"files": files, "devices": res["devices"],
            "errors": [c["error"] for c in cases if "error" in c],
            "results": [{k: r.get(k) for k in ("config", "devices", "tokens_per_s", "hit_rate",
                                                "steps", "misses_per_layer_step")}
                        for c in cases for r in c.get("results", [])],
            "bucket": [c.get("bucket_check", {}).get("compilations") for c in cases],
            "prefill": [{k: p.get(k) for k in ("mode", "devices", "tokens_per_s", "error")}
                        for p in res["prefill"]]}


def case_bad_mesh():
    out = {}
    for name, mesh in (("three", jax.devices()[:3]), ("twice", [jax.devices()[0]] * 2),
                       ("not_devices", [1, 2])):
        try:
            jaxkv.generate(CFG, PARAMS, PROMPTS, mesh=mesh, max_new_tokens=2)
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def case_prefill():
    """Prefill through engine (one device) and parallel (4): logits, host tiers (every KV head's
    K/V) and Quest summaries agree. With q/k/v biases (the fused ``bqkv`` split too)."""
    cache = QUEST
    cfg = dataclasses.replace(CFG, qkv_bias=True)
    params0 = llama.init_params(cfg, seed=2)
    lens = [len(p) for p in PROMPTS]
    tokens = np.zeros((2, 64), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    lengths = jnp.asarray(lens, jnp.int32)
    out = {}
    for n in (1, 4):
        tp = None if n == 1 else parallel.TensorParallel.create(jax.devices()[:n], cfg)
        eng = engine if tp is None else tp
        plan = make_plan(cfg if tp is None else tp.local_model(), cache, lens, NEW, 4)
        params = params0
        if tp is not None:
            plan, params = tp.plan(plan), tp.shard_params(params0)
        kv, summ = eng.init_kv(plan), eng.init_summaries(plan)
        x = eng.embed_prompt(plan, params, jnp.asarray(tokens))
        for layer in range(cfg.num_layers):
            x, kv, summ, _ = eng.prefill_layer(plan, params["layers"][layer], jnp.int32(layer), x,
                                               lengths, kv, summ, ())
        last = jnp.take_along_axis(jnp.asarray(x), (lengths - 1)[:, None, None], axis=1)
        logits = np.asarray(llama.final_logits(params0, cfg, last))[:, 0]
        host = np.asarray(kv.host_kv)
        ps, D = plan.page_size, CFG.head_dim
        if tp is not None:   # [N, L*P, 2*(H/N)*ps*D] -> [L*P, 2, H, ps, D] (device j: heads block j)
            host = host.reshape(n, host.shape[1], 2, -1, ps, D).transpose(1, 2, 0, 3, 4, 5)
        host = host.reshape(host.shape[0], 2, CFG.num_kv_heads, ps, D)
        kmax = np.asarray(summ[0])
        if tp is not None:   # [N, L, B, Np, H/N, D] -> [L, B, Np, H, D]
            kmax = np.moveaxis(kmax, 0, 3).reshape(kmax.shape[1:4] + (CFG.num_kv_heads, D))
        out[n] = (logits, host, kmax, kv.host_kv.sharding.memory_kind)
    (l1, h1, k1, _), (l4, h4, k4, mk) = out[1], out[4]
    used = np.isfinite(k1)
    return {"logits_max_abs": float(np.max(np.abs(l1 - l4))),
            "logits_scale": float(np.max(np.abs(l1))),
            "argmax_equal": bool((l1.argmax(-1) == l4.argmax(-1)).all()),
            "host_max_abs": float(np.max(np.abs(h1 - h4))),
            "summary_max_abs": float(np.max(np.abs(np.where(used, k1 - k4, 0)))),
            "summary_finite_equal": bool((np.isfinite(k4) == used).all()),
            "host_memory_kind": mk}


def case_one_program():
    """Compiled decode round over 4 devices: one while loop in the entry computation, the host
    tier an (aliased) pinned-host parameter, never copied, the all-reduces inside the loop."""
    n = 4
    tp = parallel.TensorParallel.create(jax.devices()[:n], CFG)
    lens = [30, 17]
    plan = tp.plan(make_plan(tp.local_model(CFG), QUEST, lens, 8, 4))
    params = tp.shard_params(PARAMS)
    state = engine.start_state(plan, tp.init_kv(plan), tp.init_summaries(plan), lens,
                               jnp.ones((len(lens),), jnp.int32), jax.random.key(0),
                               lookahead=tp.init_lookahead(plan))
    hlo = tp.lower_decode_round(plan, params, state, Sampling.make(), jnp.full((4,), -1, jnp.int32),
                                jnp.int32(8)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    shapes = [plan.spec.host_shape, (1,) + plan.spec.host_shape, (n,) + plan.spec.host_shape]
    pats = [re.compile(r"\[" + ",".join(map(str, s)) + r"\]") for s in shapes]
    copies = [l.strip()[:200] for l in hlo.splitlines()
              if any(p.search(l) for p in pats) and re.search(r"\b(copy|copy-start|copy-done)\(", l)]
    host_param = re.search(r"f32\[1," + ",".join(map(str, plan.spec.host_shape)) + r"\]\{[^}]*S\(5\)\}",
                           hlo.splitlines()[0])
    return {"entry_whiles": len(re.findall(r"\bwhile\(", entry)),
            "entry_all_reduces": len(re.findall(r"all-reduce(-start)?\(", entry)),
            "all_reduces": len(re.findall(r"all-reduce(-start)?\(", hlo)),
            "host_copies": copies, "host_param_pinned": bool(host_param),
            "num_partitions": int(re.search(r"num_partitions=(\d+)", hlo).group(1)),
            "host_kv_memory_kind": state.kv.host_kv.sharding.memory_kind}


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main(argv):
    out, names = argv[0], argv[1:] or list(CASES)
    res = {"devices": len(jax.devices()), "prompts": PROMPTS}
    for name in names:
        t = time.perf_counter()
        res[name] = CASES[name]()
        print(f"{name}: {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1:])
