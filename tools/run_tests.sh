#!/usr/bin/env bash
# The test suite, as the README gives it: CPU only, multi-process tests on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
exec .venv/bin/python -m pytest -q "$@"
