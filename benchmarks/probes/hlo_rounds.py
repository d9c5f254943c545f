"""Lowered StableHLO of the default decode rounds and prefill layers, for checking that a
refactor leaves the compiled programs unchanged.

    PYTHONPATH=. python benchmarks/probes/hlo_rounds.py --out DIR [--impl pallas] [--texts]
    PYTHONPATH=. python benchmarks/probes/hlo_rounds.py --out DIR --target gpu   # no GPU needed

For each configuration (host tier and resident; quest, indexer and dense; exact and lagged
selection; the other host schedules) it lowers one decode round and one prefill layer of a
small model (bf16, head_dim 64 on GPU, where the Pallas kernels lower to Triton; f32 on CPU,
where ``--impl pallas`` lowers the kernels in interpret mode, so their bodies are in the HLO)
and writes the sha256 of each text to ``DIR/hlo_rounds.json`` (with ``--texts`` the texts
too). Compare two such files with ``--compare A.json B.json``. ``--target gpu`` lowers the GPU's
programs on any machine (:mod:`jaxkv.lowering`: an abstract H200, the state as shapes); its
texts differ from a GPU run's (no donation or compiler options), so compare it with itself.

A Pallas kernel lowered for the GPU is embedded as Triton MLIR bytecode that carries source
locations (file and line of every op), so moving kernel code changes the bytes but not the
program. Each such blob is replaced by the sha256 of its Triton IR printed without debug
info before hashing.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

try:
    from jaxkv.models import configs, llama
except ImportError:  # trees before the jaxkv.models mapping
    from models import configs, llama
from jaxkv import CacheConfig, Sampling, engine
from jaxkv.api import make_plan
from jaxkv.kernels import _common

CASES = {
    "resident_quest": dict(mode="resident", selector="quest"),
    "resident_quest_lag": dict(mode="resident", selector="quest", selection_lag=1),
    "resident_dense": dict(mode="resident", selector="dense"),
    "resident_indexer": dict(mode="resident", selector="indexer"),
    "host_quest": dict(mode="host", selector="quest"),
    "host_quest_lag": dict(mode="host", selector="quest", selection_lag=1),
    "host_dense": dict(mode="host", selector="dense"),
    "host_indexer": dict(mode="host", selector="indexer"),
    "host_indexer_lag": dict(mode="host", selector="indexer", selection_lag=1),
    "host_quest_small_pool": dict(mode="host", selector="quest", pool_pages=12),
    "host_quest_lag_small_pool": dict(mode="host", selector="quest", selection_lag=1,
                                      pool_pages=12),
    "host_quest_scratch": dict(mode="host", selector="quest", schedule="scratch"),
    "host_quest_layer": dict(mode="host", selector="quest", schedule="layer"),
    "host_quest_nocache": dict(mode="host", selector="quest", reuse=False),
    "host_quest_dense2": dict(mode="host", selector="quest", dense_layers=1),
    "host_quest_lag_dense2": dict(mode="host", selector="quest", selection_lag=1,
                                  dense_layers=1),
    "host_quest_int8_shift": dict(mode="host", selector="quest", kv_dtype="int8",
                                  kv_key_shift=True),
    "host_quest_fp8_rotated": dict(mode="host", selector="quest", kv_dtype="float8_e4m3fn",
                                   kv_key_rotation=True, dense_layers=1),
    "host_rescore8": dict(mode="host", selector="quest_rescore8"),
}


_IR = re.compile(r'ir = "((?:[^"\\]|\\.)*)"')


def _unescape(s: str) -> bytes:
    """An MLIR string attribute's bytes (``\\XX`` hex escapes)."""
    out, i = bytearray(), 0
    while i < len(s):
        if s[i] != "\\":
            out += s[i].encode()
            i += 1
        elif s[i + 1] in "\\\"":
            out.append(ord(s[i + 1]))
            i += 2
        else:
            out.append(int(s[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def _triton_ir(bytecode: bytes) -> str:
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir
    ctx = ir.Context()
    triton.dialect.register_dialect(ctx)
    with ctx:
        return ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)


def normalize(text: str) -> str:
    """``text`` with every embedded Triton kernel replaced by the sha256 of its IR without
    source locations."""
    def one(m):
        ir_text = _triton_ir(_unescape(m.group(1)))
        return 'ir = "sha256:' + hashlib.sha256(ir_text.encode()).hexdigest() + '"'
    return _IR.sub(one, text)


def model_config(indexer: bool):
    gpu = _common.backend() == "gpu"
    kw = dict(dtype="bfloat16", head_dim=64, num_kv_heads=2, num_heads=8) if gpu else {}
    cfg = configs.tiny(**kw)
    return configs.with_indexer(cfg) if indexer else cfg


def lower_case(name: str, kw: dict, impl: str | None, target: bool = False) -> dict:
    cfg = model_config(kw["selector"] == "indexer")
    params = llama.init_params(cfg, seed=0)
    ps = 16 if _common.backend() == "gpu" else 4
    cache = CacheConfig(page_size=ps, selected_pages=4, implementation=impl, **kw)
    lens = [300, 170] if ps == 16 else [30, 17]
    plan = make_plan(cfg, cache, lens, 8, num_stop=4)
    if target:
        from jaxkv import lowering
        st = engine.abstract_state(plan, lens)
        return {"round": lowering.lower_round(plan, params, st),
                "prefill": lowering.lower_prefill(plan, params["layers"][0], st.kv,
                                                  st.summaries, st.dense)}
    kv, summ = engine.init_kv(plan), engine.init_summaries(plan)
    dense = engine.init_dense(plan)
    state = engine.start_state(plan, kv, summ, lens, jnp.ones((plan.batch,), jnp.int32),
                               jax.random.key(0), dense=dense)
    rnd = engine.lower_decode_round(plan, params, state, Sampling.make(),
                                    jnp.full((4,), -1, jnp.int32), jnp.int32(8)).as_text()
    x = jnp.zeros((plan.batch, plan.prompt_len, cfg.d_model), cfg.dtype)
    pre = engine.prefill_layer.lower(plan, params["layers"][0], jnp.int32(0), x,
                                     jnp.asarray(lens, jnp.int32), kv, summ, dense).as_text()
    return {"round": rnd, "prefill": pre}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--impl", default=None, help="implementation (default: per backend)")
    ap.add_argument("--texts", action="store_true", help="also write the HLO texts")
    ap.add_argument("--target", choices=("gpu",), default=None,
                    help="lower the GPU's programs on this machine (an abstract H200)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p))["sha256"] for p in args.compare)
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        print(f"{len(set(a) & set(b))} common programs, {len(diff)} differ: {diff}")
        sys.exit(1 if diff else 0)
    os.makedirs(args.out, exist_ok=True)
    hashes = {}
    for name in args.cases.split(","):
        with _common.target_platform(args.target) if args.target else contextlib.nullcontext():
            lowered = lower_case(name, CASES[name], args.impl, bool(args.target))
        texts = {k: normalize(v) for k, v in lowered.items()}
        for part, text in texts.items():
            key = f"{name}/{part}"
            hashes[key] = hashlib.sha256(text.encode()).hexdigest()
            if args.texts:
                with open(os.path.join(args.out, f"{name}.{part}.mlir"), "w") as f:
                    f.write(text)
        print(name, hashes[f"{name}/round"][:12], hashes[f"{name}/prefill"][:12], flush=True)
    with open(os.path.join(args.out, "hlo_rounds.json"), "w") as f:
        json.dump({"backend": args.target or jax.default_backend(), "impl": args.impl,
                   "jax": jax.__version__, "sha256": hashes}, f, indent=1)


if __name__ == "__main__":
    main()
