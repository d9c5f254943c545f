#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite on CPU. GPU tests (marker "gpu") skip without a GPU.
# Extra arguments go to pytest, e.g. bash scripts/test.sh -k lru
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m pytest -q --durations=15 "$@"
