#!/usr/bin/env bash
# The quality trade-off table of docs/generation.md, on CPU in ~3 minutes: the demo's model
# (tools/demo.sh: the bundled tiny Llama retrofit 1,2,1 with a random adapter, trained 100 steps on
# 2 ranks; its held-out loss falls from r = 1 to r = 4), decoded token by token through the cache
# at cheaper depths than r = 16 (tools/bench_generate.py quality). Extra arguments go to the
# quality command.
#
#   bash tools/gen_quality.sh [--num-steps 16 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
MODEL=outputs/demo/run/final_model

if [[ ! -f "$MODEL/config.json" ]]; then
  bash tools/demo.sh
fi
OMP_NUM_THREADS=1 "$PYTHON" tools/bench_generate.py quality --checkpoint "$MODEL" \
  --config train_configs/debug_model.toml --num-steps 16 --lower-steps 1,2,4,8 "$@"
