"""Does a host tier larger than the device's free memory work? (a GPU probe)

A program that touches the whole pinned tier must not hold a device buffer of its size: with a
tier larger than the free device memory such a program fails with a device out-of-memory error
(e.g. "Out of memory while trying to allocate 128.25GiB with allocator GPU_0_bfc"), and only a
tier that does not fit the device can show it. docs/benchmark-log.md (sixth and seventh
sessions) has the runs that found and fixed such a program.

This probe takes the device down to ``--free-gb`` GiB of free memory with a ballast array,
then, for a Qwen-like host tier of ``--tier-gb`` GiB (larger than that), runs each program that
touches the whole tier and records, per stage: ok / the error, the device allocator's peak
bytes, and the compiled memory analysis (device temp / argument / output bytes; a temp the
size of the tier means a device copy):

  alloc_prog the zeroed tier: the in-program allocator's memory analysis (a jitted jnp.zeros
            typed to host memory; compile only), then kvcache.host_zeros (run: seconds,
            host RSS)
  fill_prog the fill chunk's compiled memory analysis (nothing run)
  variants  compile-only memory analysis of the smallest programs writing into a donated
            pinned-host array of the tier's shape (Pallas write_pages with and without the
            host re-annotation, dynamic-update-slice, a fori_loop of writes)
  fill     synthetic.build_state (the fill chunk, one jit call per chunk)
  decode   one engine.decode_round on the filled state
  generate jaxkv.generate with a short prompt and max_context sized to the tier (prefill_layer)

  PYTHONPATH=. python3 benchmarks/probes/probe_host_capacity.py --tier-gb 28 --free-gb 16 --out $OUT

Without a GPU (or with ``--tiny``) it runs the same stages on the tiny model (no ballast),
which is how CI keeps the script working.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import decode_lib as bd  # noqa: E402
from benchmarks import synthetic  # noqa: E402
from jaxkv import CacheConfig, Sampling, engine, generate  # noqa: E402
from jaxkv import cache as kvcache  # noqa: E402
from jaxkv.kernels import page_write  # noqa: E402

GiB = 1 << 30
INVALID = -1


def _peak() -> int:
    return int(bd.memory_stats().get("device_peak_bytes_in_use", 0))


_HLO_DIR: Path | None = None


def _analysis(compiled, name: str | None = None) -> dict:
    """The compiled memory analysis; with ``name``, the optimized HLO goes to hlo/<name>.txt
    under --out (which buffers live in S(5), where a copy of the tier appears)."""
    if name and _HLO_DIR is not None:
        try:
            _HLO_DIR.mkdir(parents=True, exist_ok=True)
            (_HLO_DIR / f"{name}.txt").write_text(compiled.as_text())
        except Exception as e:  # noqa: BLE001 - the analysis still counts
            print(f"    no HLO text for {name}: {e!r}", flush=True)
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # noqa: BLE001 - backends without it
        return {"error": repr(e)}
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "host_temp_size_in_bytes", "host_argument_size_in_bytes",
            "host_output_size_in_bytes")
    return {k: int(getattr(m, k)) for k in keys if getattr(m, k, None) is not None}


def _stage(name: str, fn, rows: list) -> object:
    """Runs ``fn() -> (value, extra dict)``; appends a row; returns the value (None on error)."""
    p0, t0 = _peak(), time.perf_counter()
    row = {"stage": name}
    try:
        value, extra = fn()
        row.update(ok=True, **extra)
    except Exception as e:  # noqa: BLE001 - the error is the finding
        value = None
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        traceback.print_exc()
    row.update(seconds=time.perf_counter() - t0, device_peak_before=p0, device_peak_after=_peak())
    rows.append(row)
    print(f"  {name:9s} {'ok' if row['ok'] else 'FAILED'} {row['seconds']:.1f} s "
          f"{row.get('error', '')}", flush=True)
    return value


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier-gb", type=float, default=28.0, help="host tier size (GiB)")
    ap.add_argument("--free-gb", type=float, default=16.0, help="device memory left free (GiB)")
    ap.add_argument("--tiny", action="store_true", help="tiny model, no ballast (CPU check)")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    global _HLO_DIR
    _HLO_DIR = Path(a.out) / "hlo"
    gpu = jax.default_backend() == "gpu"
    shape = "qwen1.5b" if gpu and not a.tiny else "tiny"
    cfg = bd.model_config(shape)
    params = bd.get_params(shape, 0)
    ps, k = 64, 8
    per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * jnp.dtype(cfg.dtype).itemsize
    ctx = 1 << 14 if shape == "tiny" else bd._pow2_floor(int(a.tier_gb * GiB / per_token))
    cache = CacheConfig(mode="host", selector="quest", page_size=ps, selected_pages=k,
                        round_steps=4, max_context=ctx)
    plan = engine.Plan(model=cfg, cache=cache, batch=1, prompt_len=ctx, max_context=ctx, num_stop=4)
    tier = plan.spec.host_bytes
    rec = dict(benchmark="probe_host_capacity", device=bd._device_str(), commit=bd._commit(),
               jax_version=jax.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               shape=shape, context=ctx, tier_bytes=int(tier), stages=[])
    print(f"{shape}: host tier {tier / GiB:.1f} GiB (context {ctx})", flush=True)

    ballast = None
    if gpu and not a.tiny:
        s = jax.devices()[0].memory_stats() or {}
        spare = int(s.get("bytes_limit", 0)) - int(s.get("bytes_in_use", 0)) - int(a.free_gb * GiB)
        if spare > 0:
            ballast = jnp.zeros((spare // 4,), jnp.float32)
            ballast.block_until_ready()
        rec["ballast_bytes"] = max(spare, 0)
        print(f"ballast {max(spare, 0) / GiB:.1f} GiB: {a.free_gb} GiB of device memory left",
              flush=True)
    rows = rec["stages"]
    lengths = [ctx - 2 * ps]

    def alloc_program():
        """The zeroed tier: the in-program allocator (a jitted jnp.zeros typed to host memory,
        which XLA computes in device memory: compile-only) and kvcache.host_zeros (run:
        seconds, host RSS)."""
        spec, host = plan.spec, kvcache.host_sharding()
        old = jax.jit(lambda: jax.device_put(jnp.zeros(spec.host_shape, spec.dtype),
                                             jax.memory.Space.Host), out_shardings=host)
        extra = {"memory_analysis": _analysis(old.lower().compile(), "alloc_in_program")}
        m0, t0 = bd.memory_stats(), time.perf_counter()
        x = kvcache.host_zeros(spec.host_shape, spec.dtype, host)
        x.block_until_ready()
        m1 = bd.memory_stats()
        extra.update(host_zeros_s=time.perf_counter() - t0, host_zeros_kind=x.sharding.memory_kind,
                     host_zeros_typed=str(jax.typeof(x).memory_space),
                     rss_before=m0.get("host_rss_bytes"), rss_after=m1.get("host_rss_bytes"))
        del x
        return None, extra

    _stage("alloc_prog", alloc_program, rows)

    def fill_program():
        kv, summ = engine.init_kv(plan), engine.init_summaries(plan)
        extra = {"memory_analysis": _analysis(synthetic.lower_fill_chunk(plan, kv, summ).compile(), "fill_chunk")}
        del kv, summ
        return None, extra

    _stage("fill_prog", fill_program, rows)

    def variants():
        """Compile-only: the smallest programs that write into a donated pinned-host array of the
        tier's shape, to tell which construct holds a tier-sized device buffer."""
        dst = engine.init_kv(plan).host_kv          # lowered against, never run
        host = dst.sharding
        M = 64
        rows = jnp.arange(M, dtype=jnp.int32)
        pages = jnp.zeros((M, dst.shape[1]), dst.dtype)
        progs = {
            "write_pages": lambda d, r, p: page_write.write_pages(d, r, p),
            "write_pages+keep_on_host": lambda d, r, p: page_write.keep_on_host(
                page_write.write_pages(d, r, p)),
            "dynamic_update_slice": lambda d, r, p: jax.lax.dynamic_update_slice_in_dim(
                d, jax.device_put(p, jax.memory.Space.Host), r[0], 0),
            "fori_loop(write_pages)": lambda d, r, p: jax.lax.fori_loop(
                0, 4, lambda i, x: page_write.keep_on_host(page_write.write_pages(x, r + i * M, p)),
                d),
        }
        out = {}
        for name, f in progs.items():
            try:
                jf = jax.jit(f, donate_argnums=(0,), out_shardings=host)
                out[name] = _analysis(jf.lower(dst, rows, pages).compile(),
                                      "variant_" + "".join(c if c.isalnum() else "_" for c in name))
            except Exception as e:  # noqa: BLE001
                out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"    {name:26s} {out[name]}", flush=True)
        del dst
        return None, {"variants": out}

    _stage("variants", variants, rows)

    def fill():
        st = synthetic.build_state(plan, lengths, seed=0)
        jax.block_until_ready(st)
        return st, {}

    state = _stage("fill", fill, rows)

    def decode():
        sampling, stop = Sampling.make(temperature=0.0), jnp.full((4,), INVALID, jnp.int32)
        lowered = engine.lower_decode_round(plan, params, state, sampling, stop, jnp.int32(8))
        extra = {"memory_analysis": _analysis(lowered.compile(), "decode_round")}
        out = engine.decode_round(plan, params, state, sampling, stop, jnp.int32(8))
        jax.block_until_ready(out)
        return out, extra

    if state is not None:
        _stage("decode", decode, rows)
    del state

    def gen():
        res = generate(cfg, params, [[1, 2, 3, 4, 5]], max_new_tokens=4,
                       cache=dataclasses.replace(cache, max_context=ctx))
        return res, {"tokens": [list(map(int, t)) for t in res.tokens]}

    _stage("generate", gen, rows)
    del ballast
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"probe_host_capacity_{shape}.json"
    path.write_text(json.dumps(rec, indent=1))
    print(f"\n{'stage':9s} {'ok':>5s} {'peak GiB':>9s} {'temp GiB':>9s}   (tier {tier / GiB:.1f} GiB)")
    for r in rows:
        temp = r.get("memory_analysis", {}).get("temp_size_in_bytes")
        print(f"{r['stage']:9s} {str(r['ok']):>5s} {r['device_peak_after'] / GiB:9.2f} "
              f"{'-' if temp is None else f'{temp / GiB:9.2f}':>9s}")
    print(f"wrote {path}")
    return rec


if __name__ == "__main__":
    main()
