#!/usr/bin/env bash
# Create (or reuse) ./.venv with the tested, pinned dependencies. CPU build of torch by default;
# GPU users install their CUDA/ROCm torch first (see README) and set TITAN_RECUR_TORCH=skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ "${TITAN_RECUR_TORCH:-}" != "skip" ]; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -c constraints.txt -e '.[dev]'
bash tools/compat_env.sh
