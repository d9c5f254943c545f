#!/usr/bin/env bash
# Two single-GPU stage lists side by side, one per GPU of a two-GPU machine (nvidia-h200-x2):
#   bash benchmarks/gpu_pair.sh OUTDIR "stages for GPU 0" "stages for GPU 1"
# Each list runs gpu_suite.sh with CUDA_VISIBLE_DEVICES set to its GPU, logs under OUTDIR/gpu0[.log]
# and OUTDIR/gpu1[.log] (PACK=1: packed into OUTDIR/pair.tgz at the end). Ratios stay within
# one process (one GPU); the two processes share the host's RAM and CPUs, not a GPU or a PCIe
# link.
set -uo pipefail
OUT=${1:?usage: gpu_pair.sh OUTDIR "stages0" "stages1"}
here=$(dirname "$0")
mkdir -p "$OUT"
CUDA_VISIBLE_DEVICES=0 bash "$here/gpu_suite.sh" "$OUT/gpu0" ${2:?} > "$OUT/gpu0.log" 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=1 bash "$here/gpu_suite.sh" "$OUT/gpu1" ${3:?} > "$OUT/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1
for g in 0 1; do echo "########## GPU $g"; tail -n 40 "$OUT/gpu$g.log"; done
# PACK=1: one archive instead of the two folders (the device tool returns at most 8 files)
if [ "${PACK:-0}" = 1 ]; then
  tar -czf "$OUT/pair.tgz" -C "$OUT" gpu0 gpu1 gpu0.log gpu1.log && rm -rf "$OUT/gpu0" "$OUT/gpu1"
fi
