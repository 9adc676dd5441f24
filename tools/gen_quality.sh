#!/usr/bin/env bash
# The quality trade-off table of docs/generation.md, on CPU in ~10 minutes: train the debug model
# (train_configs/debug_model.toml) longer and at its full mean depth from the first step (no
# curriculum), then decode its held-out split token by token through the cache at cheaper depths
# (tools/bench_generate.py quality). Extra arguments go to the quality command.
#
#   nice -n 10 bash tools/gen_quality.sh [--num-steps 8 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-outputs/gen_quality}
CONFIG=train_configs/debug_model.toml

if [[ ! -f "$OUT/final_model/config.json" ]]; then
  "$PYTHON" -m titan_recur.train --config "$CONFIG" --job.dump_folder "$OUT" --training.steps 60 \
    --recurrence.curriculum none --checkpoint.interval 60 --validation.interval 30
fi
OMP_NUM_THREADS=1 "$PYTHON" tools/bench_generate.py quality --checkpoint "$OUT/final_model" --config "$CONFIG" "$@"
