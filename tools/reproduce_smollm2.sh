#!/usr/bin/env bash
# The retrofit of a published pretrained model, end to end on CPU: SmolLM2-135M-Instruct (30 layers,
# tied embeddings, its own tokenizer and chat template) through layer analysis, surgery, healing,
# evaluation by test-time depth and HF export.
#
#   bash tools/reproduce_smollm2.sh [--quick] [--source HF_FOLDER] [--out DIR] [--seeds 0,1] [--steps N]
#                                   [--shape P,R,C] [--questions N]
#
# Stages (fixed seeds; the source comes from tools/fetch_smollm2.sh, which this script runs when
# --source is not given: one download of 93 MB, then the cached folder):
#   1. data      the healing mixture (bundled general + math corpora, 1:1) with 10% of the documents held
#                out by content hash; eval heldout writes them (the held-out loss), tools/make_math_task.py
#                the held-out GSM8K-style questions among them (checked against every training document)
#   2. analyze   tools/analyze_layers.py on the source with held-out documents: per-layer redundancy and the
#                --shape candidates (default 12,6,5: prelude 0-11, coda 25-29 and a core of 6 consecutive
#                layers among 12-24, so 7 dropped: the source's most redundant 7-layer span is 12-18), the 3
#                most redundant converted and measured; the one with the lowest loss at the healing start is used
#   3. convert   the chosen layers, recurrent (identity adapter: r = 1 is the kept layers exactly) and
#                static (the same layers as a plain stack); the source itself as a static model
#   4. before    held-out loss of the source and of the converted model at r = 1..32, before healing
#   5. heal      per seed: the recurrent model (1-sqrt curriculum to mean 4 over 75% of the steps,
#                backprop depth 4, Muon + AdamW at the paper's learning rates, 2 ranks: torchrun + gloo +
#                FSDP2), then the static model at equal training FLOPs (paper convention; flops.py --match),
#                on the first seed only (the CPU time of a second static run goes to the recurrent seeds)
#   6. evaluate  tools/compare.py: held-out loss and exact match on the held-out questions (lm-eval, greedy)
#                at r = 1..32 for every run; the source's exact match through the same harness
#   7. export    the first seed's healed model to HF; tools/check_export_chat.py: from_pretrained +
#                generate with the chat template gives the engine's tokens
#   8. summary   tools/summarize_smollm2.py: OUT/summary/summary.{json,csv,md} and the plots
# --quick: 2 healing steps of seed 0, static 1 step, 2 batches of loss at r = 1, 4, 8 questions,
# analysis on 2 rows: the test suite's run when the source is cached (minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0 OUT=outputs/smollm2 SOURCE= SEEDS_ARG= STEPS_ARG= SHAPE=12,6,5 QUESTIONS_ARG=
die() { echo "reproduce_smollm2.sh: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --source) SOURCE=${2:?--source needs an HF model folder}; shift ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --seeds) SEEDS_ARG=${2:?--seeds needs a list}; shift ;;
    --steps) STEPS_ARG=${2:?--steps needs a number}; shift ;;
    --shape) SHAPE=${2:?--shape needs P,R,C}; shift ;;
    --questions) QUESTIONS_ARG=${2:?--questions needs a number}; shift ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
for value in "$STEPS_ARG" "$QUESTIONS_ARG"; do
  [ -z "$value" ] || [[ "$value" =~ ^[1-9][0-9]*$ ]] || die "--steps and --questions take an integer >= 1, got $value"
done
[ -z "$SEEDS_ARG" ] || [[ "$SEEDS_ARG" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--seeds takes a comma-separated list (e.g. 0,1), got $SEEDS_ARG"
[[ "$SHAPE" =~ ^[1-9][0-9]*,[1-9][0-9]*,[1-9][0-9]*$ ]] || die "--shape takes P,R,C (e.g. 12,6,5), got $SHAPE"
if [ -e "$OUT" ] && [ ! -f "$OUT/timings.tsv" ] && [ -n "$(ls -A "$OUT")" ]; then
  die "$OUT exists and is not an earlier output of this script; choose another --out"
fi
if [ -n "$SOURCE" ] && [ ! -f "$SOURCE/config.json" ]; then die "--source $SOURCE: no HF model folder (config.json)"; fi

[ -x .venv/bin/python ] || bash tools/setup_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
PY=.venv/bin/python
if [ -z "$SOURCE" ]; then
  SOURCE=${HOME}/.cache/titan_recur/smollm2-135m-instruct-q4_1
  bash tools/fetch_smollm2.sh --out "$SOURCE"
fi
RECURRENCES=1,2,4,8,16,32
if [ "$QUICK" = 1 ]; then
  SEEDS=0 STEPS=2 QUESTIONS=8 LOSS_BATCHES=2 ANALYZE_TOKENS=512 MEASURE=1 RECURRENCES=1,4
else
  SEEDS=0,1 STEPS=30 QUESTIONS=100 LOSS_BATCHES=8 ANALYZE_TOKENS=8192 MEASURE=3
fi
SEEDS=${SEEDS_ARG:-$SEEDS}
SEED_LIST=${SEEDS//,/ }
FIRST_SEED=${SEED_LIST%% *}
STEPS=${STEPS_ARG:-$STEPS}
QUESTIONS=${QUESTIONS_ARG:-$QUESTIONS}
SEQ_LEN=256 MEAN=4 RANKS=2 LOSS_BATCH_SIZE=4

rm -rf "$OUT"
mkdir -p "$OUT/configs" "$OUT/data" "$OUT/models" "$OUT/eval"
TIMINGS="$OUT/timings.tsv"
START=$(date +%s)
printf 'stage\twall_s\n' > "$TIMINGS"
stage() {  # stage NAME CMD...: run CMD, append its wall seconds to timings.tsv
  local name=$1 t0; shift
  echo "== $name: $*" >&2
  t0=$(date +%s)
  "$@"
  printf '%s\t%s\n' "$name" $(( $(date +%s) - t0 )) >> "$TIMINGS"
}
train() {  # train NAME: one healing run on 2 ranks (torchrun + gloo + FSDP2), one thread each
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$RANKS" -m titan_recur.train \
    --config "$OUT/configs/$1.toml"
}

write_config() {  # write_config NAME MODEL STEPS SEED RECURRENCE_TOML
  cat > "$OUT/configs/$1.toml" <<TOML
[job]
dump_folder = "$OUT/runs/$1"
description = "reproduce_smollm2: $1 (SmolLM2-135M-Instruct, dequantized from Q4_1)"
seed = $4

[model]
path = "$2"

[training]
steps = $3
local_batch_size = $(( 16 / RANKS ))
global_batch_size = 16
seq_len = $SEQ_LEN
compile = false
ac_mode = "none"

[recurrence]
$5

[optimizer]
name = "muon"
lr = 0.001
adamw_lr = 0.00005

[lr_scheduler]
warmup_fraction = 0.05
decay_fraction = 0.5

[checkpoint]
interval = $(( $3 >= 2 ? $3 / 2 : 1 ))
keep_latest_k = 1

[data]
validation_fraction = 0.1

[[data.sources]]
name = "general"
path = "assets/corpus/general.jsonl"
kind = "jsonl"
weight = 1.0

[[data.sources]]
name = "math"
path = "assets/corpus/math.jsonl"
kind = "jsonl"
weight = 1.0

[metrics]
log_freq = 5
enable_tensorboard = false
TOML
}

RECURRENT_TOML="mean_recurrence = $MEAN
backprop_depth = $MEAN
curriculum = \"1-sqrt\"
warmup_fraction = 0.75"
STATIC_TOML="mean_recurrence = 1
curriculum = \"none\""
write_config data "$OUT/models/recurrent" 1 0 "$RECURRENT_TOML"  # the data split every run shares

# 1. data: the held-out documents and questions (never read by training: checked by make_math_task.py)
stage heldout "$PY" -m titan_recur.eval heldout --config "$OUT/configs/data.toml" --documents 100000 \
  --out "$OUT/data/heldout.jsonl"
stage questions "$PY" tools/make_math_task.py --config "$OUT/configs/data.toml" --questions "$QUESTIONS" \
  --out "$OUT/data/math_task"
TASK_YAML="$OUT/data/math_task/math_heldout.yaml"

# 2. analyze: which layers to drop and loop (OMP 2: one process at a time from here to the healing runs)
export OMP_NUM_THREADS=2
stage analyze "$PY" tools/analyze_layers.py "$SOURCE" --data "$OUT/data/heldout.jsonl" --seq-len "$SEQ_LEN" \
  --tokens "$ANALYZE_TOKENS" --recommend "$SHAPE" --measure "$MEASURE" --out "$OUT/analysis"
# The measured candidate with the lowest identity-adapter loss (the healing start) gives the layer lists.
read -r PRELUDE CORE CODA <<< "$("$PY" -c 'import json, sys
ranked = json.load(open(sys.argv[1]))["candidates"]["ranked"]
best = min((c for c in ranked if "loss_identity_r1" in c), key=lambda c: c["loss_identity_r1"])
print(*(",".join(map(str, best[part])) for part in ("prelude", "core", "coda")))' "$OUT/analysis/layer_analysis.json")"
LAYERS=(--prelude "$PRELUDE" --core "$CORE" --coda "$CODA")
echo "chosen layers: prelude $PRELUDE, core $CORE, coda $CODA"

# 3. convert
stage convert_recurrent "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/recurrent" "${LAYERS[@]}" --mean-recurrence "$MEAN"
stage convert_static "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/static" "${LAYERS[@]}" --static
stage convert_source "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/source" --static

# 4. before healing: held-out loss of the source and of the converted model by r; the source's exact match
LOSS_ARGS=(--data "$OUT/data/heldout.jsonl" --batches "$LOSS_BATCHES" --batch-size "$LOSS_BATCH_SIZE" --seq-len "$SEQ_LEN")
stage loss_source "$PY" -m titan_recur.eval loss --checkpoint "$OUT/models/source" "${LOSS_ARGS[@]}" \
  --recurrences 1 --out "$OUT/eval/source_loss"
stage loss_converted "$PY" -m titan_recur.eval loss --checkpoint "$OUT/models/recurrent" "${LOSS_ARGS[@]}" \
  --recurrences "$RECURRENCES" --out "$OUT/eval/converted_loss"
stage exact_source "$PY" -m titan_recur.eval harness --model-args "pretrained=$OUT/models/source,batch_size=$QUESTIONS" \
  --tasks "$TASK_YAML" --recurrences 1 --out "$OUT/eval/source_exact"

# 5. heal: the recurrent runs, then the static ones at equal training FLOPs
RUNS=()
for seed in $SEED_LIST; do
  write_config "recurrent_s$seed" "$OUT/models/recurrent" "$STEPS" "$seed" "$RECURRENT_TOML
seed = $(( 514229 + seed ))"
  RUNS+=("$OUT/runs/recurrent_s$seed")
done
write_config static_match "$OUT/models/static" 1 0 "$STATIC_TOML"
stage match "$PY" tools/flops.py --config "$OUT/configs/recurrent_s$FIRST_SEED.toml" --world-size "$RANKS" \
  --match "$OUT/configs/static_match.toml" --json > "$OUT/flops_match.json"
read -r STATIC_STEPS STATIC_STEPS_FULL <<< "$("$PY" -c 'import json, sys
m = json.load(open(sys.argv[1]))["matched_steps"]; print(max(1, round(m["paper"])), round(m["full"]))' "$OUT/flops_match.json")"
echo "compute-matched static steps: $STATIC_STEPS (paper convention), $STATIC_STEPS_FULL (full convention)"
for seed in $FIRST_SEED; do
  write_config "static_s$seed" "$OUT/models/static" "$STATIC_STEPS" "$seed" "$STATIC_TOML"
  RUNS+=("$OUT/runs/static_s$seed")
done
for run in "${RUNS[@]}"; do stage "train_$(basename "$run")" train "$(basename "$run")"; done

# 6. evaluate every healed run by r: held-out loss and exact match through lm-eval
stage compare "$PY" tools/compare.py "${RUNS[@]}" --task "$TASK_YAML" --data "$OUT/data/heldout.jsonl" \
  --loss-batches "$LOSS_BATCHES" --loss-batch-size "$LOSS_BATCH_SIZE" --seq-len "$SEQ_LEN" \
  --recurrences "$RECURRENCES" --batch-size "$QUESTIONS" --max-gen-toks 64 --out "$OUT/compare"

# 7. export the first seed's healed model; HF generate with the chat template = the engine's tokens
stage export "$PY" tools/export_hf.py "$OUT/runs/recurrent_s$FIRST_SEED/final_model" "$OUT/export"
stage chat_check "$PY" tools/check_export_chat.py "$OUT/export" "$OUT/runs/recurrent_s$FIRST_SEED/final_model" \
  --num-steps "$MEAN" --out "$OUT/eval/chat_check.json"

# 8. summary
stage summarize "$PY" tools/summarize_smollm2.py "$OUT" --out "$OUT/summary"
printf 'total\t%s\n' $(( $(date +%s) - START )) >> "$TIMINGS"
echo
column -t -s $'\t' "$TIMINGS"
cat <<TXT

Done. Layers: prelude $PRELUDE, core $CORE, coda $CODA. Static steps at equal FLOPs: $STATIC_STEPS (paper), $STATIC_STEPS_FULL (full).
  summary:   $OUT/summary/summary.md ($OUT/summary/summary.json, $OUT/summary/*.png)
  analysis:  $OUT/analysis/layer_analysis.json
  runs:      $OUT/runs/{recurrent_s*,static_s*}
  export:    $OUT/export (chat check: $OUT/eval/chat_check.json)
  timings:   $TIMINGS
TXT
