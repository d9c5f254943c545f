#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: a real generation with the default model.
# Extra arguments go to the jaxkv command line (python -m jaxkv --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m jaxkv "$@"
