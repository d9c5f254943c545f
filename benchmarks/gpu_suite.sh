#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on a CUDA machine (the H200 through the device tool):
#   bash benchmarks/gpu_suite.sh OUTDIR [stage ...]
# stages: env tests fetch attention attnhost select decode quality tp (default: env tests fetch attention)
# tests: the whole GPU suite (~480 s on the H200; limit $TESTS_LIMIT, default 560 s)
# tests-files: the GPU tests of $TEST_FILES only
# tests-1, tests-2: the whole GPU suite in two calls (the files with GPU tests, sorted, split in
#   halves; the suite as one stage needs ~600 s on the H200, over a device call's limit)
# prefill-attn: causal prefill attention per layer, XLA / Pallas tunings / cuDNN (bench_prefill_attention.py)
# prefill: 8B-like prefill of 32k and 128k prompts, resident and host (bench_decode --no-decode;
#   JAXKV_IMPL_PREFILL_ATTENTION=pallas|cudnn|xla picks the attention, tagged in the JSON name)
# tp: tensor parallelism on every visible GPU (issue 8; run on the nvidia-h200-x2 kind)
# grid-a .. grid-i: the decode grid of issue 6, a few points per stage (a, b, c1/c2/c4, d;
#   64-token pages; the JSON, tagged with the stage and $JAXKV_COMMIT, is saved after every
#   point); benchmarks/summarize_grid.py merges them into one table and plot;
#   grid-e (8B-like B=8 128k) and grid-f (8B-like B=1 1M) have 128 GiB tiers: two-GPU kind (RAM)
# capacity: a host tier larger than the free device memory (probes/probe_host_capacity.py; 28 vs 16 GiB)
# abc-8b, abc-qwen: the issue-6 headline ratios (128k; a, b, c2 in one run; 8B-like B=1, Qwen-like B=8;
#   then b and c2 re-measured alternately $PAIRS times (default 8): the target is the median pair ratio)
#   abc-8b-lag, abc-qwen-lag: the same with CacheConfig(selection_lag=1) for b and c2;
#   abc-qwen-b16, abc-qwen-b16-lag: Qwen-like at B=16; abc-8b-default, abc-qwen-default: the
#   selection CacheConfig() makes (quest_rescore8, 1024 tokens in 16-token pages) instead of Quest's 2048 in 64
#   abc-qwen-p8: that selection in 8-token pages (page_size=8, 128 pages), Qwen-like B=8
# trace-qwen-default: b and c2 of abc-qwen-default, one profiled round each (kernels per step)
# trace-selection: Quest against CacheConfig()'s selection (quest_rescore8, 1024 tokens in
#   16-token pages), resident, 128k, one profiled round each after the timed pairs (ab_step
#   --trace, shared KV): issue 27's selection time by kernel; parts trace-selection-q8
#   (Qwen-like B=8) and trace-selection-8b (8B-like B=1), ~3 min each
# quality: RULER retrieval (bench_quality.py; $QUALITY_GGUF, $QUALITY_LENGTHS (default 2048),
#   $QUALITY_ARGS, $QUALITY_TAG); quality-lag: only dense and the lagged Quest runs
# tp-b8: only the tensor-parallel 8B-like B=8 128k part of tp
# grid-*: GRID_CONFIGS / GRID_POOLS override the configurations (default a,b,c,d / 1,2,4)
# topo: the GPUs' PCIe / NUMA topology
# matmul: decode-shaped weight products, XLA's default vs cuBLAS (probes/bench_matmul.py)
# matmul-opts: the Qwen-like B=8 products under XLA option variants ($MATMUL_VARIANTS) and
#   weight layouts ($MATMUL_LAYOUTS: io = [in, out], oi = [out, in])
# matmul-l2: each projection with its weight from HBM vs from L2 (probes/bench_matmul.py --l2)
# launch: the per-kernel floor of chained tiny kernels, XLA / Pallas, PDL on and off (probes/bench_launch.py)
# locality: fetch rate by where the fetched pages lie in the host tier (bench_fetch --only-locality)
# steady: per-step slopes of the fetch loop, XLA's DMA and bulk device_put (bench_fetch --only-steady)
# ab: same-process A/B of decode-step variants (ab_step.py; $AB_VARIANTS, $AB_SHAPE, $AB_CONFIG b|c2,
#   $AB_PAIRS; AB_DUMP=1 also returns the optimized HLO of every compiled round as ab_hlo.tgz)
# pieces: the first stage's top-k in strided pieces (CacheConfig.candidate_pieces): the
#   step at Qwen-like B=8 (16-token pages) and 8B-like B=1 against quest_rescore8 and Quest (ab_step,
#   shared KV, 1024 tokens), the top-k alone (probes/first_stage_topk.py), the GPU test; up to 14 min:
#   split it over calls by its parts pieces-q8, pieces-topk, pieces-8b, pieces-test
# pages8: CacheConfig()'s 1024 tokens in 8-token pages, per page and with the first stage by
#   blocks of two pages, against Quest, and the 16-token default in a second process (ab_step,
#   shared KV); parts pages8-q8 (Qwen-like B=8) and pages8-8b (8B-like B=1), ~7 min each
# final-choice: the final choice at the default's 512 candidates: its kernel with 8 warps (the
#   default), with 4 (Tuning.rescore_select_warps=4), and its XLA form (rescore_select_method)
#   (ab_step, Qwen-like B=8 in 16-token pages and 8B-like B=1, shared KV); about 7 min
# int8-bounds: Quest's page bounds in int8 with a power-of-two scale per page and KV head
#   (CacheConfig.bounds_dtype="int8": half the bytes its scores kernel reads) against the
#   KV dtype's: the GPU tests, then the resident step (ab_step, shared KV, 128k, 1024
#   tokens in 16-token pages; Quest with float (its default) and int8 bounds,
#   quest_rescore8 with int8 (its default) and float bounds; $AB_VARIANTS replaces them);
#   parts int8-bounds-test, int8-bounds-q8, int8-bounds-8b, ~1-2 min each on an H100
# first-stage: issue 27's cheaper first stages at the default budget (1024 tokens, 8x candidates), same-process
#   A/B against Quest and quest_rescore8: blocks of pages (candidate_block; 8B-like B=1 and Qwen-like B=8 at
#   128k), the radix top-k (Qwen-like B=1 at 1M), then each top-k alone (probes/first_stage_topk.py); ~15 min,
#   split it over calls by its parts first-stage-8b, first-stage-q8, first-stage-1m, first-stage-topk
# Every stage writes its log and JSON under OUTDIR; a short summary is printed last.
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUTDIR [stage ...]}; shift
STAGES=${*:-env tests fetch attention}
# every stage name is checked first: a misspelt one fails before hours of others run
KNOWN=" $(sed -n 's/^    \([a-z0-9|-]*\))[ (].*/\1/p; s/^    \([a-z0-9|-]*\))$/\1/p' "$0" | tr '|' ' ' | tr '\n' ' ') "
for s in $STAGES; do
  case "$KNOWN" in *" $s "*) ;; *) echo "gpu_suite.sh: unknown stage '$s' (usage: gpu_suite.sh OUTDIR [stage ...])" >&2; exit 2 ;; esac
done
case "$KNOWN" in *" $OUT "*) echo "gpu_suite.sh: the first argument is the output folder, got the stage '$OUT'" >&2; exit 2 ;; esac
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}:.
export PYTHONUNBUFFERED=1
export JAXKV_COMMIT=${JAXKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
# pytest-timeout bounds each GPU test where it is installed (it is not a dependency)
TIMEOUT_ARG=$($PY -c 'import pytest_timeout' 2>/dev/null && echo --timeout=200)
summary=()
failed=0
run() {  # name timeout cmd...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  summary+=("$(printf '%-10s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - t0 ))")")
  tail -n 25 "$OUT/$name.log"
}
for s in $STAGES; do
  echo "===== $s"
  case $s in
    env) run env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv && $PY -c 'import jax; print(jax.__version__, jax.devices())'" ;;
    tests) run tests ${TESTS_LIMIT:-560} $PY -m pytest -q -m gpu -p no:cacheprovider tests/ --continue-on-collection-errors $TIMEOUT_ARG -o addopts="-ra" ;;
    tests-files) run tests_files ${TESTS_LIMIT:-300} $PY -m pytest -q -m gpu -p no:cacheprovider ${TEST_FILES:?set TEST_FILES} \
        -o addopts="-ra" --tb=short ;;
    tests-1|tests-2)
        mapfile -t files < <(grep -l "mark\.gpu" tests/test_*.py | sort)
        half=$(( (${#files[@]} + 1) / 2 ))
        if [ "$s" = tests-1 ]; then part=("${files[@]:0:half}"); else part=("${files[@]:half}"); fi
        run "$s" ${TESTS_LIMIT:-540} $PY -m pytest -q -m gpu -p no:cacheprovider "${part[@]}" \
          $TIMEOUT_ARG -o addopts="-ra" ;;
    fetch) run fetch 300 $PY benchmarks/bench_fetch.py --out "$OUT" ;;
    attention) run attention 300 $PY benchmarks/bench_attention.py --out "$OUT" ;;
    attnhost) run attnhost 150 $PY benchmarks/bench_attention_host.py --out "$OUT" ;;
    prefill-attn) run prefill-attn 300 $PY benchmarks/bench_prefill_attention.py --out "$OUT" ;;
    prefill) run prefill 420 $PY benchmarks/bench_decode.py --no-decode --prefill 32k,128k --no-plot \
        --budget 400 --tag "prefill_${JAXKV_IMPL_PREFILL_ATTENTION:-default}_$JAXKV_COMMIT" --out "$OUT" ;;
    select) run select 200 $PY benchmarks/bench_select.py --out "$OUT" ;;
    decode) run decode 560 $PY benchmarks/bench_decode.py --out "$OUT" ;;
    grid-a|grid-b|grid-c|grid-d|grid-e|grid-f|grid-g|grid-h|grid-i)
        case $s in
          grid-a) args="--shape 8b --contexts 32k --batches 1,8" ;;
          grid-b) args="--shape 8b --contexts 512k --batches 1" ;;
          grid-c) args="--shape qwen1.5b --contexts 32k,128k,512k --batches 1" ;;
          grid-d) args="--shape qwen1.5b --contexts 32k --batches 8" ;;
          grid-e) args="--shape 8b --contexts 128k --batches 8 --host-mem-gb 135" ;;
          grid-f) args="--shape 8b --contexts 1M --batches 1 --host-mem-gb 135" ;;
          grid-g) args="--shape 8b --contexts 128k --batches 1" ;;
          grid-h) args="--shape qwen1.5b --contexts 128k --batches 8" ;;
          grid-i) args="--shape qwen1.5b --contexts 1M --batches 1" ;;
        esac
        # grid-e's host tier is 128.2 GiB: XLA's pinned-host allocator needs a limit above it
        # but not far above (it grows its regions by doubling: in the two-GPU B=8 run a 190 GB
        # limit made it ask for one 128 GiB region after a 64 GiB one, and the process was killed)
        lim=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-100}; case $s in grid-e|grid-f) lim=140 ;; esac
        XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$lim run "$s" 570 $PY benchmarks/bench_decode.py $args \
          --configs ${GRID_CONFIGS:-a,b,c,d} --pools ${GRID_POOLS:-1,2,4} \
          --page-size 64 --prefill none --probe-steps 0 --no-plot --budget 530 --tag "${s}_$JAXKV_COMMIT" --out "$OUT" ;;
    abc-8b|abc-qwen|abc-8b-lag|abc-qwen-lag|abc-qwen-b16|abc-qwen-b16-lag|abc-8b-default|abc-qwen-default|abc-qwen-p8)
        ps=64
        case $s in
          abc-8b) args="--shape 8b --batches 1 --tag 8b_128k_b1_abc_$JAXKV_COMMIT" ;;
          abc-qwen) args="--shape qwen1.5b --batches 8 --tag qwen_128k_b8_abc_$JAXKV_COMMIT" ;;
          abc-8b-lag) args="--shape 8b --batches 1 --selection-lag 1 --tag 8b_128k_b1_abc_lag_$JAXKV_COMMIT" ;;
          abc-qwen-lag) args="--shape qwen1.5b --batches 8 --selection-lag 1 --tag qwen_128k_b8_abc_lag_$JAXKV_COMMIT" ;;
          abc-qwen-b16) args="--shape qwen1.5b --batches 16 --tag qwen_128k_b16_abc_$JAXKV_COMMIT" ;;
          abc-qwen-b16-lag) args="--shape qwen1.5b --batches 16 --selection-lag 1 --tag qwen_128k_b16_abc_lag_$JAXKV_COMMIT" ;;
          abc-8b-default|abc-qwen-default|abc-qwen-p8)  # CacheConfig()'s selection: quest_rescore8, 1024 tokens (p8: in 8-token pages)
            ps=16; sel="--selector quest_rescore8 --selected-tokens 1024"
            case $s in
              abc-8b-default) args="--shape 8b --batches 1 $sel --tag 8b_128k_b1_abc_default_$JAXKV_COMMIT" ;;
              abc-qwen-p8) ps=8; args="--shape qwen1.5b --batches 8 $sel --tag qwen_128k_b8_abc_p8_$JAXKV_COMMIT" ;;
              *) args="--shape qwen1.5b --batches 8 $sel --tag qwen_128k_b8_abc_default_$JAXKV_COMMIT" ;;
            esac ;;
        esac
        run "$s" 300 $PY benchmarks/bench_decode.py $args --contexts 128k --configs a,b,c --pools 2 \
          --page-size $ps --prefill none --probe-steps 0 --no-plot --budget 260 --timed-rounds 6 \
          --pairs ${PAIRS:-8} --out "$OUT" ;;
    trace-qwen-default)
        # where the host tier's extra time per step goes: resident (b) and the 2x-pool host
        # tier (c2) with CacheConfig()'s selection, Qwen-like B=8 at 128k, one traced round
        # each (device time per kernel in the JSON's "kernels")
        run trace_qwen_default 300 $PY benchmarks/bench_decode.py --shape qwen1.5b --batches 8 \
          --selector quest_rescore8 --selected-tokens 1024 --contexts 128k --configs b,c --pools 2 \
          --page-size 16 --prefill none --probe-steps 0 --no-plot --budget 240 --timed-rounds 4 \
          --trace "$OUT/trace" --tag "qwen_128k_b8_trace_default_$JAXKV_COMMIT" --out "$OUT"
        rm -rf "$OUT/trace" ;;
    trace-selection|trace-selection-q8|trace-selection-8b)
        fs="--variants default,rescore8 --budget-tokens 1024 --page-size 16 --pairs ${AB_PAIRS:-2} --share-kv --out $OUT"
        case $s in trace-selection|trace-selection-q8) run trace_selection_q8 280 $PY benchmarks/ab_step.py \
            --shape qwen1.5b --batch 8 --trace "$OUT/trace_q8" --tag "trace_default_qwen8_$JAXKV_COMMIT" $fs
            rm -rf "$OUT/trace_q8" ;; esac
        case $s in trace-selection|trace-selection-8b) run trace_selection_8b 250 $PY benchmarks/ab_step.py \
            --shape 8b --batch 1 --trace "$OUT/trace_8b" --tag "trace_default_8b1_$JAXKV_COMMIT" $fs
            rm -rf "$OUT/trace_8b" ;; esac ;;
    topo) run topo 60 bash -c "nvidia-smi topo -m && { lscpu | grep -i -E 'numa|socket|model name' || true; } && \
        $PY -c 'import sys; sys.path.insert(0, \"benchmarks\"); import _numa, json; print(json.dumps(_numa.gpu_numa()))'" ;;
    capacity) run capacity 300 $PY benchmarks/probes/probe_host_capacity.py --tier-gb 28 --free-gb 16 --out "$OUT"
        # the optimized HLO of each probed program, as one file (the device returns few files)
        [ -d "$OUT/hlo" ] && tar -czf "$OUT/capacity_hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo" ;;
    matmul) run matmul 200 $PY benchmarks/probes/bench_matmul.py --out "$OUT" ;;
    matmul-opts) run matmul_opts 300 $PY benchmarks/probes/bench_matmul.py --shapes qwen1.5b --batches 8 \
        --variants ${MATMUL_VARIANTS:-xla,cublas,exhaustive} --layouts ${MATMUL_LAYOUTS:-io} --out "$OUT" ;;
    matmul-l2) run matmul_l2 240 $PY benchmarks/probes/bench_matmul.py --l2 --shapes qwen1.5b,8b --batches 1,8 \
        --out "$OUT" ;;
    launch) run launch 120 $PY benchmarks/probes/bench_launch.py --out "$OUT" ;;
    locality) run locality 200 $PY benchmarks/bench_fetch.py --only-locality --out "$OUT" ;;
    steady) run steady 300 $PY benchmarks/bench_fetch.py --only-steady --budget-s 240 --out "$OUT" ;;
    pieces|pieces-q8|pieces-8b|pieces-topk|pieces-test)
        # the first stage in strided pieces (CacheConfig.candidate_pieces): the step against the
        # row's top-k (one shared KV cache: fits an H100), the top-k alone, its GPU test
        fs="--budget-tokens 1024 --pairs ${AB_PAIRS:-3} --share-kv --out $OUT"
        case $s in pieces|pieces-q8) run pieces_q8 300 $PY benchmarks/ab_step.py --shape qwen1.5b \
            --batch 8 --page-size 16 --variants default,rescore8_pieces1,rescore8_pieces8,rescore8_pieces16 \
            --tag "pieces_qwen8_p16_$JAXKV_COMMIT" $fs ;; esac
        case $s in pieces|pieces-topk) run pieces_topk 150 $PY benchmarks/probes/first_stage_topk.py \
            --shapes qwen_b8_p16 8b_b1 --out "$OUT" ;; esac
        case $s in pieces|pieces-8b) run pieces_8b 240 $PY benchmarks/ab_step.py --shape 8b --batch 1 \
            --variants default,rescore8_pieces1,rescore8_pieces8,rescore8_pieces16 --tag "pieces_8b1_$JAXKV_COMMIT" $fs ;; esac
        case $s in pieces|pieces-test) run pieces_test 150 $PY -m pytest -q -m gpu -p no:cacheprovider \
            tests/test_selectors.py -k pieces -o addopts="-ra" ;; esac ;;
    pages8|pages8-q8|pages8-8b)
        # CacheConfig()'s 1024 tokens in 8-token pages (selected_pages=128; 1024 candidates):
        # per page and with the first stage per block of two pages (the bounds of 16-token
        # pages), the latter also with the final choice's kernel at its 1024 candidates,
        # against Quest in 8-token pages; then the 16-token default and its Quest in a
        # second process of the same call (ab_step shares one page size per process)
        fs="--budget-tokens 1024 --pairs ${AB_PAIRS:-2} --share-kv --out $OUT"
        case $s in pages8|pages8-q8)
          run p8_q8 240 $PY benchmarks/ab_step.py --shape qwen1.5b --batch 8 --page-size 8 \
            --variants default,rescore8,rescore8_block2,rescore8_block2_sel1024 --tag "p8_qwen8_$JAXKV_COMMIT" $fs
          run p16_q8 180 $PY benchmarks/ab_step.py --shape qwen1.5b --batch 8 --page-size 16 \
            --variants default,rescore8 --tag "p16_qwen8_$JAXKV_COMMIT" $fs ;; esac
        case $s in pages8|pages8-8b)
          run p8_8b 240 $PY benchmarks/ab_step.py --shape 8b --batch 1 --page-size 8 \
            --variants default,rescore8,rescore8_block2,rescore8_block2_sel1024 --tag "p8_8b1_$JAXKV_COMMIT" $fs
          run p16_8b 180 $PY benchmarks/ab_step.py --shape 8b --batch 1 --page-size 16 \
            --variants default,rescore8 --tag "p16_8b1_$JAXKV_COMMIT" $fs ;; esac ;;
    final-choice)
        # the final choice at 512 candidates (CacheConfig()'s 1024 tokens in 16-token pages):
        # the kernel with 8 warps (the default) and 4, and XLA's form
        fs="--budget-tokens 1024 --pairs ${AB_PAIRS:-3} --share-kv --out $OUT"
        run fc_q8 300 $PY benchmarks/ab_step.py --shape qwen1.5b --batch 8 --page-size 16 \
            --variants default,rescore8,rescore8_select_xla,rescore8_select_w4 \
            --tag "final_choice_qwen8_p16_$JAXKV_COMMIT" $fs
        run fc_8b 240 $PY benchmarks/ab_step.py --shape 8b --batch 1 \
            --variants default,rescore8,rescore8_select_xla,rescore8_select_w4 \
            --tag "final_choice_8b1_$JAXKV_COMMIT" $fs ;;
    int8-bounds|int8-bounds-test|int8-bounds-q8|int8-bounds-8b)
        fs="--variants ${AB_VARIANTS:-default,quest_int8b,rescore8,rescore8_floatb} --budget-tokens 1024 --page-size 16 --pairs ${AB_PAIRS:-3} --share-kv --out $OUT"
        case $s in int8-bounds|int8-bounds-test) run int8_bounds_test 200 $PY -m pytest -q -m gpu \
            -p no:cacheprovider $TIMEOUT_ARG tests/test_quest_int8_bounds.py -o addopts="-ra" ;; esac
        case $s in int8-bounds|int8-bounds-q8) run int8_bounds_q8 300 $PY benchmarks/ab_step.py \
            --shape qwen1.5b --batch 8 --tag "int8_bounds_qwen8_p16_$JAXKV_COMMIT" $fs ;; esac
        case $s in int8-bounds|int8-bounds-8b) run int8_bounds_8b 280 $PY benchmarks/ab_step.py \
            --shape 8b --batch 1 --tag "int8_bounds_8b1_$JAXKV_COMMIT" $fs ;; esac ;;
    first-stage|first-stage-8b|first-stage-q8|first-stage-1m|first-stage-topk)
        # one shared KV cache: every part fits an H100 as well as an H200
        fs="--budget-tokens 1024 --pairs ${AB_PAIRS:-3} --share-kv --out $OUT"
        case $s in first-stage|first-stage-8b) run fs_8b 300 $PY benchmarks/ab_step.py --shape 8b --batch 1 \
            --variants default,rescore8_block1,rescore8_block4,rescore8_block8 --tag "block_8b1_$JAXKV_COMMIT" $fs ;; esac
        case $s in first-stage|first-stage-q8) run fs_q8 300 $PY benchmarks/ab_step.py --shape qwen1.5b --batch 8 \
            --variants default,rescore8_block1,rescore8_block4,rescore8_block8 --tag "block_qwen8_$JAXKV_COMMIT" $fs ;; esac
        case $s in first-stage|first-stage-1m) run fs_1m 400 $PY benchmarks/ab_step.py --shape qwen1.5b --batch 1 \
            --context 1M --variants default,rescore8,rescore8_topk_radix --tag "radix_qwen1M_$JAXKV_COMMIT" $fs ;; esac
        case $s in first-stage|first-stage-topk) run fs_topk 200 $PY benchmarks/probes/first_stage_topk.py \
            --out "$OUT" ;; esac ;;
    ab) flags=${XLA_FLAGS:-}
        [ "${AB_DUMP:-0}" = 1 ] && flags="$flags --xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_round.*"
        XLA_FLAGS=$flags run ab ${AB_LIMIT:-500} $PY benchmarks/ab_step.py --variants ${AB_VARIANTS:-default,topk_full_row} --shape ${AB_SHAPE:-qwen1.5b} \
          --config ${AB_CONFIG:-b} --pairs ${AB_PAIRS:-6} --tag "${AB_TAG:-$JAXKV_COMMIT}" --out "$OUT"
        [ -d "$OUT/hlo" ] && tar -czf "$OUT/ab_hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo" ;;
    quality|quality-lag)
        # RULER cases from benchmarks/quality_data; the GGUF is not in the GPU image: QUALITY_GGUF.
        # A run cut short keeps its finished runs; copy its JSON into OUT and run again (--resume).
        sel=(); [ $s = quality-lag ] && sel=(--runs dense 'quest*-lag')
        run "$s" ${QUALITY_LIMIT:-560} $PY benchmarks/bench_quality.py --gguf "${QUALITY_GGUF:?set QUALITY_GGUF=path.gguf}" \
          --lengths ${QUALITY_LENGTHS:-2048} ${sel[@]+"${sel[@]}"} ${QUALITY_ARGS:-} --tag "${QUALITY_TAG:-ruler_$JAXKV_COMMIT}" \
          --resume --out "$OUT" ;;
    tp) run tp_tests 300 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_parallel.py -o addopts="-ra"
        n=$($PY -c 'import jax; print(jax.device_count())')
        run tp_decode 400 $PY benchmarks/bench_decode.py --devices "$n" --shape 8b --contexts 128k \
          --batches 1 --configs a,b,c --pools 2 --page-size 64 --prefill none --no-plot --budget 360 \
          --tag 8b_128k_b1_tp$n --out "$OUT"
        ;&
    tp-b8)
        n=$($PY -c 'import jax; print(jax.device_count())')
        # B=8 at 128k (128.2 GiB of KV) does not fit one GPU's memory; split over the GPUs it does.
        # Pinned-host limit: each GPU has its own pinned-host allocator with this limit, and it
        # grows by doubling: a 64.1 GiB shard makes it ask for a 128 GiB region unless the limit
        # caps it (with 140, two 128 GiB requests: the process was killed, 2026-11-29).
        XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${TP_HOST_LIMIT_GB:-70} run tp_decode_b8 400 $PY benchmarks/bench_decode.py \
          --devices "$n" --shape 8b --contexts 128k --batches 8 --configs ${TP_CONFIGS:-a,b,c} --pools 2 --page-size 64 \
          --prefill none --no-plot --budget 360 --host-mem-gb 135 --tag 8b_128k_b8_tp${n}_$JAXKV_COMMIT \
          --out "$OUT" ;;
    *) echo "unknown stage $s"; failed=1 ;;
  esac
done
echo "===== summary ($JAXKV_COMMIT)"
printf '%s\n' "${summary[@]}"
exit $failed
