#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite on CPU. GPU tests (marker "gpu") skip without a GPU.
# Extra arguments go to pytest, e.g. bash scripts/test.sh -k lru (-n 0: one process).
# Test files run in parallel worker processes (pytest-xdist; one file stays on one worker):
# as many as CPUs, at most 4 (JAXKV_TEST_WORKERS overrides): 18% less time than one process
# on the 2-core CI machine (docs/decisions.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# The suite's programs are tiny and each compiles once: LLVM's optimizations cost more than
# they save (a quarter of the suite's CPU time; docs/decisions.md). A level in the caller's
# XLA_FLAGS comes later and wins.
export XLA_FLAGS="--xla_backend_optimization_level=0 ${XLA_FLAGS:-}"
NCPU=$(nproc 2>/dev/null || echo 1)
WORKERS=${JAXKV_TEST_WORKERS:-$(( NCPU < 4 ? NCPU : 4 ))}
exec .venv/bin/python -m pytest -q --durations=15 -n "$WORKERS" --dist loadfile "$@"
