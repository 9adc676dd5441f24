#!/usr/bin/env bash
# The quality trade-off table of docs/generation.md: the test-time settings (fixed r, KV sharing, warm start,
# every exit criterion at several thresholds) on a model that uses depth, the recurrent arm of
# tools/reproduce_mini.sh (run first if outputs/mini is absent, ~12.5 min on 2 cores), on the long chains
# of its task: ~2.5 min of decoding. Extra arguments go to tools/bench_generate.py task.
#
#   bash tools/gen_quality.sh [--num-steps 32 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MODEL=outputs/mini/runs/recurrent_s0/final_model

if [[ ! -f "$MODEL/config.json" ]]; then
  bash tools/reproduce_mini.sh
fi
OMP_NUM_THREADS=1 "$PYTHON" tools/bench_generate.py task --checkpoint "$MODEL" --task-dir outputs/mini/task \
  --lengths 7-12 "$@"
