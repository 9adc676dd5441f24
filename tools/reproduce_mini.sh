#!/usr/bin/env bash
# The paper's question in miniature, on CPU: at equal training compute, does retrofitting recurrence
# beat post-training the static model, and does accuracy grow with test-time depth?
#
#   bash tools/reproduce_mini.sh [--quick] [--steps N] [--eval-examples N] [--out DIR] [--source HF_FOLDER]
#
# Stages (fixed seeds, offline, 2 ranks on gloo):
#   1. task     tools/make_depth_task.py: chains of +/- digit operations mod 10, train 1-3 operations,
#               validation 1-3 (in distribution), test 4-6 (longer than any training chain)
#   2. convert  tools/convert_hf.py assets/depth_llama (8 layers, pretrained on the task + general text)
#               -> recurrent (2,2,2) and static (all 8 layers)
#   3. train    the recurrent model: 1-sqrt curriculum to mean 4 over 75% of the steps, Muon
#   4. match    tools/flops.py --match: the static steps costing the same training FLOPs (paper convention;
#               the full convention's count is reported beside it)
#   5. train    the static model for that many steps, same data, optimizer and schedule shape
#   6. compare  tools/compare.py: exact match (harness, greedy generation) on both splits and held-out loss,
#               at r = 1..32, for every checkpoint of both runs; tables and plots in OUT/compare
# --quick runs every stage with a few steps and examples (the test suite's end-to-end check).
# --steps N trains the recurrent arm N steps (default 200; checkpoints every N/4) and --eval-examples N
# scores N questions per chain length (default 40): longer or larger runs of the same pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
OUT=outputs/mini
SOURCE=assets/depth_llama
STEPS_ARG=
EVAL_ARG=
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --steps) STEPS_ARG=${2:?--steps needs a number}; shift ;;
    --eval-examples) EVAL_ARG=${2:?--eval-examples needs a number}; shift ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --source) SOURCE=${2:?--source needs an HF model folder}; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "reproduce_mini.sh: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for value in "$STEPS_ARG" "$EVAL_ARG"; do
  if [ -n "$value" ] && ! [[ "$value" =~ ^[1-9][0-9]*$ ]]; then
    echo "reproduce_mini.sh: error: --steps and --eval-examples take an integer >= 1, got $value" >&2
    exit 2
  fi
done

[ -x .venv/bin/python ] || bash tools/setup_env.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
PY=.venv/bin/python
SEED=0
SHAPE=2,2,2
MEAN=4
if [ "$QUICK" = 1 ]; then
  TRAIN_EXAMPLES=2000; EVAL_EXAMPLES=4; STEPS=6; RECURRENCES=1,4; LOSS_BATCHES=2
else
  TRAIN_EXAMPLES=100000; EVAL_EXAMPLES=40; STEPS=200; RECURRENCES=1,2,4,8,16,32; LOSS_BATCHES=8
fi
STEPS=${STEPS_ARG:-$STEPS}
EVAL_EXAMPLES=${EVAL_ARG:-$EVAL_EXAMPLES}
if [ "$QUICK" = 1 ]; then INTERVAL=3; else INTERVAL=$(( STEPS >= 4 ? STEPS / 4 : 1 )); fi

if [ -e "$OUT" ] && [ ! -f "$OUT/timings.tsv" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "reproduce_mini.sh: error: $OUT exists and is not an earlier output of this script; choose another --out" >&2
  exit 2
fi
if [ ! -f "$SOURCE/config.json" ]; then
  echo "reproduce_mini.sh: error: --source $SOURCE: no HF model folder (config.json)" >&2
  exit 2
fi
rm -rf "$OUT"
mkdir -p "$OUT/configs"
TIMINGS="$OUT/timings.tsv"
printf 'stage\twall_s\tuser_s\tsys_s\n' > "$TIMINGS"

# stage NAME CMD...: run CMD; append its wall and CPU seconds (user, system; children included) to timings.tsv.
stage() {
  local name=$1; shift
  echo "== $name: $*" >&2
  local t0 c0
  t0=$(date +%s.%N)
  cpu_seconds; c0=$CPU
  "$@"
  cpu_seconds
  awk -v name="$name" -v t0="$t0" -v t1="$(date +%s.%N)" -v c0="$c0" -v c1="$CPU" 'BEGIN {
    split(c0, a, " "); split(c1, b, " ")
    printf "%s\t%.1f\t%.1f\t%.1f\n", name, t1 - t0, b[1] - a[1], b[2] - a[2]
  }' >> "$TIMINGS"
}
# CPU="user system": CPU seconds of this shell's finished children (bash's `times`, run in this shell).
TIMES_FILE="$OUT/.times"
cpu_seconds() {
  times > "$TIMES_FILE"
  CPU=$(tail -n 1 "$TIMES_FILE" | awk '{for (i = 1; i <= 2; i++) {split($i, t, /[ms]/); printf "%.2f ", t[1] * 60 + t[2]}}')
}

torchrun2() { "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$@"; }

# One train config per arm: identical except [job], [model], [training] steps and [recurrence].
write_config() {  # write_config NAME MODEL STEPS RECURRENCE_TOML
  cat > "$OUT/configs/$1.toml" <<TOML
[job]
dump_folder = "$OUT/runs/$1"
description = "reproduce_mini: $1 arm"
seed = $SEED

[model]
path = "$2"

[training]
steps = $3
local_batch_size = 8
global_batch_size = 16
seq_len = 128
compile = false
ac_mode = "none"

[recurrence]
$4

[optimizer]
name = "muon"
lr = 0.004
adamw_lr = 0.002

[lr_scheduler]
warmup_fraction = 0.05
decay_fraction = 0.5

[checkpoint]
interval = $INTERVAL
keep_latest_k = 0

[data]
[[data.sources]]
name = "depth_task"
path = "$OUT/task/train.jsonl"
kind = "jsonl"

[metrics]
log_freq = 25
enable_tensorboard = false
TOML
}

stage task "$PY" tools/make_depth_task.py --out "$OUT/task" --max-steps 3 --seed "$SEED" \
  --train-examples "$TRAIN_EXAMPLES" --eval-examples "$EVAL_EXAMPLES"

stage convert_recurrent "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/recurrent" --shape "$SHAPE" \
  --mean-recurrence "$MEAN" --seed "$SEED"
stage convert_static "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/static" --static

write_config recurrent "$OUT/models/recurrent" "$STEPS" \
  "mean_recurrence = $MEAN
backprop_depth = $MEAN
curriculum = \"1-sqrt\"
warmup_fraction = 0.75
seed = 514229"
stage train_recurrent torchrun2 -m titan_recur.train --config "$OUT/configs/recurrent.toml"

write_config static "$OUT/models/static" 1 "mean_recurrence = 1
curriculum = \"none\""
stage match "$PY" tools/flops.py --config "$OUT/configs/recurrent.toml" --world-size 2 \
  --match "$OUT/configs/static.toml" --json > "$OUT/flops_match.json"
MATCHED=$("$PY" -c 'import json, sys
m = json.load(open(sys.argv[1]))["matched_steps"]; print(round(m["paper"]), round(m["full"]))' "$OUT/flops_match.json")
read -r STATIC_STEPS STATIC_STEPS_FULL <<< "$MATCHED"
echo "compute-matched static steps: $STATIC_STEPS (paper convention), $STATIC_STEPS_FULL (full convention)"
write_config static "$OUT/models/static" "$STATIC_STEPS" "mean_recurrence = 1
curriculum = \"none\""
stage train_static torchrun2 -m titan_recur.train --config "$OUT/configs/static.toml"

stage compare "$PY" tools/compare.py "$OUT/runs/recurrent" "$OUT/runs/static" \
  --task "$OUT/task/depth_chain_validation.yaml,$OUT/task/depth_chain_test.yaml" \
  --data "$OUT/task/validation.jsonl" --loss-batches "$LOSS_BATCHES" --recurrences "$RECURRENCES" \
  --checkpoints --max-gen-toks 4 --out "$OUT/compare"

awk -F'\t' 'NR > 1 {w += $2; u += $3; s += $4} END {printf "total\t%.1f\t%.1f\t%.1f\n", w, u, s}' "$TIMINGS" >> "$TIMINGS"
echo
column -t -s $'\t' "$TIMINGS"
cat <<TXT

Done. Compute-matched static steps: $STATIC_STEPS (paper convention), $STATIC_STEPS_FULL (full).
  tables:   $OUT/compare/compare.md ($OUT/compare/compare.json)
  plots:    $OUT/compare/*_vs_r.png, $OUT/compare/*_vs_flops.png
  runs:     $OUT/runs/{recurrent,static} (metrics.jsonl, checkpoints/, final_model/)
  timings:  $TIMINGS (wall and CPU seconds per stage)
TXT
