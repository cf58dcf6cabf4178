#!/usr/bin/env bash
# Create .venv (if missing) and install lightning-het with its test tools.
# torch is installed first and pinned (TORCH_SPEC, default torch==2.13.0): an unpinned resolve on a clean Linux
# machine pulls a multi-GB CUDA build. On a GPU machine set e.g. TORCH_SPEC="torch==2.13.0" with the CUDA index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[dev]"
