"""Probe (outside JAX): how fast can ANY path on this GPU gather scattered pages from pinned
host memory? Issue 2 asks the Pallas fetch for >= 0.95 of the bulk host->device rate at
256 pages x 64 KiB; this probe measures, in one process with CUDA events, per-step slopes
(time of N back-to-back steps, fitted over N) of:

- ``bulk``: one cudaMemcpyAsync host->device of 128 MiB .. 1 GiB (the reference slope);
- ``ce_block``: one cudaMemcpyAsync of a step-sized contiguous block per step;
- ``kernel_*``: a CUDA C++ gather kernel reading the pinned pages zero-copy (16-byte loads;
  bytes in flight per thread and block size varied; ``l2_256`` adds the PTX ``L2::256B``
  prefetch-size qualifier to the loads; ``nc`` uses the read-only path);
- ``ce_graph``: the copy engine as a gather: one cudaMemcpyAsync per page, captured in a CUDA
  graph of 256 copies per step;
- ``ce_batch``: ``cudaMemcpyBatchAsync`` (one call per step for all pages), if the runtime has it.

Needs CuPy (on the GPU machine's image; not a jaxkv dependency). Writes probe_pcie_gather.json.
Run:  python3 benchmarks/probes/probe_pcie_gather.py --out DIR
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import subprocess

import numpy as np

KiB, MiB, GiB = 1024, 1024**2, 1024**3

SRC = r"""
extern "C" __global__ void gather(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                  const int* __restrict__ src_rows,
                                  const int* __restrict__ dst_rows, int row_vec, int chunk_vec,
                                  int per_thread) {
  const int m = blockIdx.y, chunk = blockIdx.x;
  const uint4* s = src + (size_t)src_rows[m] * row_vec + (size_t)chunk * chunk_vec;
  uint4* d = dst + (size_t)dst_rows[m] * row_vec + (size_t)chunk * chunk_vec;
  uint4 buf[MAXV];
#pragma unroll
  for (int i = 0; i < MAXV; i++) {
    int idx = threadIdx.x + i * blockDim.x;
    if (i < per_thread && idx < chunk_vec) {
#if MODE == 1
      buf[i] = __ldg(s + idx);
#elif MODE == 2
      uint4 v;
      asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(s + idx));
      buf[i] = v;
#else
      buf[i] = s[idx];
#endif
    }
  }
#pragma unroll
  for (int i = 0; i < MAXV; i++) {
    int idx = threadIdx.x + i * blockDim.x;
    if (i < per_thread && idx < chunk_vec) d[idx] = buf[i];
  }
}
"""


def fit(ns, ts):
    A = np.stack([np.ones(len(ns)), np.asarray(ns, float)], 1)
    (a, b), *_ = np.linalg.lstsq(A, np.asarray(ts, float), rcond=None)
    return float(a), float(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--host-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import cupy as cp  # after parsing: --help works without CuPy

    rt = cp.cuda.runtime
    stream = cp.cuda.Stream(non_blocking=True)
    M, row = args.pages, args.page_kib * KiB
    n_rows = int(args.host_gib * GiB) // row
    host_bytes = n_rows * row
    hptr = rt.hostAlloc(host_bytes, 1 | 2)  # portable | mapped
    dptr_host = hptr  # unified addressing: the mapped host pointer is valid on the device
    hview = np.ctypeslib.as_array((ctypes.c_uint8 * host_bytes).from_address(hptr))
    hview32 = hview.view(np.uint32).reshape(n_rows, row // 4)
    hview32[:] = (np.arange(n_rows, dtype=np.uint32)[:, None] * 7919 + 1)
    pool = cp.zeros((M, row // 4), cp.uint32)
    big = cp.zeros(GiB // 4, cp.uint32)
    rng = np.random.default_rng(0)
    NS = (8, 16, 32, 64)
    tabs = {n: rng.choice(n_rows, size=(n, M)).astype(np.int32) for n in NS}
    for n in NS:  # distinct rows within a step
        for t in range(n):
            tabs[n][t] = rng.choice(n_rows, M, replace=False)
    dtab = cp.asarray(np.arange(M, dtype=np.int32))
    res = dict(probe="probe_pcie_gather", date=datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), pages=M, page_bytes=row, step_bytes=M * row,
               host_bytes=host_bytes, device=rt.getDeviceProperties(0)["name"].decode(),
               commit=os.environ.get("JAXKV_COMMIT", "unknown"), cases={})

    def timed(fn, n):
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        fn(n)  # warm
        stream.synchronize()
        ts = []
        for _ in range(args.reps):
            ev0.record(stream)
            fn(n)
            ev1.record(stream)
            ev1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3)
        return float(np.median(ts))

    def case(name, fn, ns=NS, nbytes=M * row):
        try:
            ts = [timed(fn, n) for n in ns]
            a, b = fit(ns, ts)
            res["cases"][name] = dict(ns=list(ns), call_us=ts, fixed_us=a, us_per_step=b,
                                      GBps=nbytes / b / 1e3)
            print(f"{name:>24}: {b:9.1f} us/step  fixed {a:7.1f} us  {nbytes / b / 1e3:6.2f} GB/s",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            res["cases"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"{name}: FAILED {res['cases'][name]['error']}", flush=True)

    # bulk: one copy of `size` bytes; slope over sizes
    sizes = [128 * MiB, 256 * MiB, 512 * MiB, GiB]
    bts = []
    for sz in sizes:
        def f(_n, sz=sz):
            rt.memcpyAsync(big.data.ptr, hptr, sz, rt.memcpyHostToDevice, stream.ptr)
        bts.append(timed(f, 1))
    a, b = fit(sizes, bts)
    res["bulk"] = dict(sizes=sizes, call_us=bts, fixed_us=a, GBps=1.0 / b / 1e3)
    print(f"{'bulk':>24}: {res['bulk']['GBps']:.2f} GB/s slope, fixed {a:.1f} us "
          f"(1 GiB call {GiB / bts[-1] / 1e3:.2f} GB/s)", flush=True)

    def ce_block(n):
        for t in range(n):
            off = (int(tabs[64][t % 64][0]) % (n_rows - M)) * row
            rt.memcpyAsync(pool.data.ptr, hptr + off, M * row, rt.memcpyHostToDevice, stream.ptr)
    case("ce_block", ce_block)

    arch = "-arch=sm_90"
    for mode, mname in ((0, "ld"), (1, "nc"), (2, "l2_256")):
        mod = cp.RawModule(code=SRC, options=(arch, f"-DMODE={mode}", "-DMAXV=8"))
        kern = mod.get_function("gather")
        dtabs = {n: cp.asarray(tabs[n]) for n in NS}
        row_vec = row // 16
        for threads, per_thread in ((256, 4), (256, 8), (512, 8), (128, 8), (1024, 4)):
            chunk_vec = min(row_vec, threads * per_thread)
            grid = (row_vec // chunk_vec, M)

            def run(n, kern=kern, chunk_vec=chunk_vec, grid=grid, threads=threads,
                    per_thread=per_thread):
                with stream:
                    for t in range(n):
                        kern(grid, (threads,), (np.uint64(dptr_host), pool, dtabs[n][t], dtab,
                                                np.int32(row_vec), np.int32(chunk_vec),
                                                np.int32(per_thread)))
            case(f"kernel_{mname}_t{threads}_v{per_thread}", run)
        # correctness of the last variant
        run(8)
        stream.synchronize()
        got = cp.asnumpy(pool[:, 0])
        want = tabs[8][7].astype(np.uint32) * 7919 + 1
        res["cases"].setdefault(f"kernel_{mname}_t1024_v4", {})["correct"] = bool(
            np.array_equal(got, want))

    # copy engine as a gather: a CUDA graph of one memcpyAsync per page
    try:
        graphs = []
        for t in range(max(NS)):
            stream.begin_capture()
            for m in range(M):
                rt.memcpyAsync(pool.data.ptr + m * row, hptr + int(tabs[max(NS)][t][m]) * row,
                               row, rt.memcpyHostToDevice, stream.ptr)
            graphs.append(stream.end_capture())

        def ce_graph(n):
            for g in graphs[:n]:
                g.launch(stream)
        case("ce_graph", ce_graph)
    except Exception as e:  # noqa: BLE001
        res["cases"]["ce_graph"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print("ce_graph FAILED", e)

    # cudaMemcpyBatchAsync (CUDA >= 12.8), through ctypes
    try:
        lib = None
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            import nvidia.cuda_runtime as ncr  # type: ignore
            d = os.path.join(os.path.dirname(ncr.__file__), "lib")
            lib = ctypes.CDLL(os.path.join(d, sorted(x for x in os.listdir(d) if "cudart" in x)[0]))
        fn = lib.cudaMemcpyBatchAsync

        class MemLoc(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class Attrs(ctypes.Structure):
            _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLoc),
                        ("dstLocHint", MemLoc), ("flags", ctypes.c_uint)]

        attrs = Attrs(1, MemLoc(0, 0), MemLoc(0, 0), 0)  # stream order
        idx = (ctypes.c_size_t * 1)(0)
        sizes_arr = (ctypes.c_size_t * M)(*([row] * M))
        dsts = (ctypes.c_void_p * M)(*[pool.data.ptr + m * row for m in range(M)])
        srcs_by = {n: [(ctypes.c_void_p * M)(*[hptr + int(r) * row for r in tabs[n][t]])
                       for t in range(n)] for n in NS}
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

        def ce_batch(n):
            for t in range(n):
                err = fn(dsts, srcs_by[n][t], sizes_arr, M, ctypes.byref(attrs), idx, 1,
                         ctypes.c_void_p(stream.ptr))
                if err:
                    raise RuntimeError(f"cudaMemcpyBatchAsync error {err}")
        case("ce_batch", ce_batch)
        stream.synchronize()
        got = cp.asnumpy(pool[:, 0])
        want = tabs[64][63].astype(np.uint32) * 7919 + 1
        res["cases"]["ce_batch"]["correct"] = bool(np.array_equal(got, want))
    except Exception as e:  # noqa: BLE001
        res["cases"]["ce_batch"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print("ce_batch FAILED", e)

    bulk = res["bulk"]["GBps"]
    print(f"\nper-step slopes, {M} x {row // KiB} KiB pages, vs bulk slope {bulk:.2f} GB/s")
    for k, v in res["cases"].items():
        if "GBps" in v:
            v["frac_of_bulk"] = v["GBps"] / bulk
            ok = f" correct={v['correct']}" if "correct" in v else ""
            print(f"{k:>24} {v['frac_of_bulk']:.3f}{ok}")
    try:
        res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                        "--format=csv,noheader"], capture_output=True,
                                       text=True).stdout.strip()
    except OSError:
        pass
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_pcie_gather.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
