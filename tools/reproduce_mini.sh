#!/usr/bin/env bash
# The paper's question in miniature, on CPU: at equal training compute, does retrofitting recurrence
# into a pretrained model beat post-training it without recurrence, and does accuracy grow with
# test-time depth?
#
#   bash tools/reproduce_mini.sh [--quick] [--seeds 0,1,2] [--steps N] [--eval-examples N] [--out DIR] [--task perm|arith]
#                                [--source HF_FOLDER] [--surgery "CONVERT FLAGS"] [--static-factors "1 2 4" | --static-factors ""]
#                                [--attention-mask causal|document] [--resume]
#
# Stages (fixed seeds, offline; each training run is one process of one thread, two runs at a time):
#   1. task     tools/make_depth_task.py: the permutation word problem (8 states, two fixed permutations
#               generating A_8, `3 a b a = 5`), training chains of 1-12 operators, 100 questions per
#               length 1..12 for evaluation and 13..16 beyond training (one harness task each), held out of
#               the training file wherever a length has room (5-16; 1-4 have too few questions)
#   2. convert  tools/convert_hf.py on the source (assets/perm_llama: a 4-layer d-128 Llama pretrained by
#               this trainer on chains of 1-6, which it solves; tools/make_mini_source.sh rebuilds it):
#               recurrent 1,2,1 (nothing dropped, identity adapter: r = 1 is the source exactly), static
#   3. match    tools/flops.py --match: the static steps costing the recurrent arm's training FLOPs
#   4. train    per seed (runs recurrent_s<seed>, static_x<factor>_s<seed>): the recurrent arm (1-sqrt
#               curriculum to mean 4 over 75% of the steps, backprop depth 4, Muon, loss on every token, 400
#               steps of 16 x 64 tokens), and the static arm at 1x, 2x and 4x the matched FLOPs (same data,
#               optimizer and schedule shape)
#   5. compare  tools/compare.py: exact match per chain length (harness, greedy generation) and the
#               answer-only held-out loss at r = 1..32 for every run (one process: decoding 100 questions at
#               r = 32 on the 12-layer arith source peaks near 20 GB); tools/summarize_mini.py: the tables with
#               means over seeds and 95% intervals, and the headline plots, in OUT/summary
# --seeds: the seeds of every arm (default 0,1,2). --task arith: the variable-binding arithmetic task
# (`a = 3 ; b = a + 5 ; c = b * 7 ; c mod 10 ?`, rows of 160 tokens, the loss on the answers only) on a
# source pretrained on it (bash tools/make_mini_source.sh --task arith, then --source OUT/hf).
# --surgery replaces --shape 1,2,1 in the recurrent conversion (e.g. "--prelude 0 --core 1-2 --coda 5",
# docs/surgery.md's study; checked by a dry run of that conversion before --out is touched);
# --static-factors chooses the static arms ("" for none). --attention-mask: every run's training.attention_mask
# (and so the comparison's loss); "document" for a source pretrained with it (make_mini_source.sh
# --attention-mask document), so post-training packs questions as its pretraining did (default causal).
# --resume: continue an earlier call on the same --out with the same arguments (and source weights; one line
# and exit 2 otherwise): its finished stages are kept, an unfinished training run continues from its latest
# checkpoint. Ctrl-C or SIGTERM to the script's process group (as Slurm's scancel or preemption sends) makes
# every training run write a checkpoint and exit; those extra checkpoints are removed once the runs finish.
# Without --resume every call starts over. timings.tsv's total is the wall time of every call together.
# --quick: seed 0, 120 steps, the 1x static arm, 50 questions per length 7-12 (long chains only),
# r = 1 and 4, both runs on 2 ranks (torchrun + gloo + FSDP2): the test suite's run, which asserts the
# effect's direction on it.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
RESUME=0
OUT=outputs/mini
TASK=perm
SOURCE=
SEEDS_ARG= STEPS_ARG= EVAL_ARG= SURGERY= FACTORS_ARG=unset ATTENTION_MASK=causal
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --resume) RESUME=1 ;;
    --seeds) SEEDS_ARG=${2:?--seeds needs a list of seeds}; shift ;;
    --task) TASK=${2:?--task needs perm or arith}; shift ;;
    --steps) STEPS_ARG=${2:?--steps needs a number}; shift ;;
    --eval-examples) EVAL_ARG=${2:?--eval-examples needs a number}; shift ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --source) SOURCE=${2:?--source needs an HF model folder}; shift ;;
    --surgery) SURGERY=${2:?--surgery needs convert_hf.py flags}; shift ;;
    --static-factors) FACTORS_ARG=${2?--static-factors needs a list}; shift ;;
    --attention-mask) ATTENTION_MASK=${2:?--attention-mask needs a mask}; shift ;;
    -h|--help) sed -n '2,42p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
if [ -n "$SEEDS_ARG" ] && ! [[ "$SEEDS_ARG" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "reproduce_mini.sh: error: --seeds takes a comma-separated list of seeds (e.g. 0,1,2), got $SEEDS_ARG" >&2
  exit 2
fi
case "$TASK" in
  # FORMAT: the post-training loss. perm's is on every token; arith's on the answers only, because its
  # prompts are mostly unpredictable digits whose loss drowns the one answer token (300 all-token steps
  # took its source from 1.00 to 0.31 at length 1: docs/results.md).
  perm) SOURCE=${SOURCE:-assets/perm_llama}; SEQ_LEN=64 FORMAT=text ;;
  arith)
    SEQ_LEN=160 FORMAT=prompt_completion
    if [ -z "$SOURCE" ]; then
      echo "reproduce_mini.sh: error: --task arith needs --source: a model pretrained on it (bash tools/make_mini_source.sh --task arith)" >&2
      exit 2
    fi ;;
  *) echo "reproduce_mini.sh: error: --task takes perm or arith, got $TASK" >&2; exit 2 ;;
esac

[ -x .venv/bin/python ] || bash tools/setup_env.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
PY=.venv/bin/python
MASKS=$("$PY" -c 'import typing; from titan_recur.config.schema import AttentionMask; print(*typing.get_args(AttentionMask))')
if ! [[ " $MASKS " == *" $ATTENTION_MASK "* ]]; then
  echo "reproduce_mini.sh: error: --attention-mask takes one of: $MASKS; got $ATTENTION_MASK" >&2
  exit 2
fi
SHAPE=1,2,1
MEAN=4
if [ "$QUICK" = 1 ]; then
  SEEDS=0; STEPS=120; EVAL_EXAMPLES=50; EVAL_LENGTHS=7-12; EXTRAPOLATION=none; RECURRENCES=1,4; FACTORS="1"
  LOSS_BATCHES=2; RANKS=2
else
  SEEDS=0,1,2; STEPS=400; EVAL_EXAMPLES=100; EVAL_LENGTHS=1-12; EXTRAPOLATION=13-16; RECURRENCES=1,2,4,8,16,32
  FACTORS="1 2 4"; LOSS_BATCHES=16; RANKS=1
fi
SEEDS=${SEEDS_ARG:-$SEEDS}
SEED_LIST=${SEEDS//,/ }
FIRST_SEED=${SEED_LIST%% *}
STEPS=${STEPS_ARG:-$STEPS}
EVAL_EXAMPLES=${EVAL_ARG:-$EVAL_EXAMPLES}
[ "$FACTORS_ARG" = unset ] || FACTORS=$FACTORS_ARG
for value in $FACTORS; do
  [[ "$value" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce_mini.sh: error: --static-factors takes integers >= 1, got $value" >&2; exit 2; }
done

if [ "$RESUME" = 0 ] && [ -e "$OUT" ] && [ ! -f "$OUT/timings.tsv" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "reproduce_mini.sh: error: $OUT exists and is not an earlier output of this script; choose another --out" >&2
  exit 2
fi
if [ ! -f "$SOURCE/config.json" ]; then
  echo "reproduce_mini.sh: error: --source $SOURCE: no HF model folder (config.json)" >&2
  exit 2
fi
# What a call computes from: --resume continues only the same (the source by its weights' SHA-256).
SETTINGS=$(printf '%s\n' "task=$TASK" "source=$SOURCE" \
  "source_sha256=$(cat "$SOURCE"/*.safetensors | sha256sum | cut -d' ' -f1)" "surgery=${SURGERY:---shape $SHAPE}" \
  "seeds=$SEEDS" "steps=$STEPS" "eval_examples=$EVAL_EXAMPLES" "static_factors=$FACTORS" \
  "attention_mask=$ATTENTION_MASK" "quick=$QUICK")
if [ "$RESUME" = 1 ]; then
  if [ ! -f "$OUT/settings.txt" ] || [ ! -f "$OUT/timings.tsv" ]; then
    echo "reproduce_mini.sh: error: --resume: $OUT holds no earlier call of this script (settings.txt, timings.tsv); run without --resume" >&2
    exit 2
  fi
  EARLIER=$(cat "$OUT/settings.txt")
  if [ "$EARLIER" != "$SETTINGS" ]; then
    CHANGED=$(comm -3 <(sort <<< "$EARLIER") <(sort <<< "$SETTINGS") | awk -F'\t' '
      {i = index($1 $2, "="); key = substr($1 $2, 1, i - 1); value = "\"" substr($1 $2, i + 1) "\""}
      $1 != "" {was[key] = value} $2 != "" {now[key] = value; keys[++n] = key}
      END {for (j = 1; j <= n; j++) printf "%s%s %s, now %s", (j > 1 ? "; " : ""), keys[j], was[keys[j]], now[keys[j]]}')
    echo "reproduce_mini.sh: error: --resume: $OUT was made with other settings ($CHANGED); rerun with the earlier ones, or without --resume to start over" >&2
    exit 2
  fi
fi
# The recurrent conversion's flags (--surgery) on the source, as a dry run, before $OUT is replaced.
DRY_RUN_OUT=$(mktemp -d)
# shellcheck disable=SC2086  # --surgery is a list of flags
if ! CONVERT_ERROR=$("$PY" tools/convert_hf.py "$SOURCE" "$DRY_RUN_OUT/recurrent" ${SURGERY:---shape $SHAPE} \
    --mean-recurrence "$MEAN" --dry-run 2>&1 > /dev/null); then
  rmdir "$DRY_RUN_OUT"
  echo "reproduce_mini.sh: error: --surgery '${SURGERY:---shape $SHAPE}' (the recurrent conversion of $SOURCE): ${CONVERT_ERROR##*error: }" >&2
  exit 2
fi
rmdir "$DRY_RUN_OUT"
TIMINGS="$OUT/timings.tsv" CALLS="$OUT/calls.tsv"
if [ "$RESUME" = 0 ]; then
  rm -rf "$OUT"
  mkdir -p "$OUT/configs" "$OUT/logs"
  echo "$SETTINGS" > "$OUT/settings.txt"
  printf 'stage\twall_s\tuser_s\tsys_s\n' > "$TIMINGS"
  printf 'start_utc\tend_utc\twall_s\texit\n' > "$CALLS"
else
  sed -i '/^total\t/d' "$TIMINGS"
fi
START=$(date +%s.%N)
# Every call's wall time, however it ends (a signal, a failed stage), for the total.
record_call() {
  local status=$?
  local end; end=$(date +%s.%N)
  printf '%s\t%s\t%s\t%d\n' "$(date -u -d "@$START" +%FT%TZ)" "$(date -u -d "@$end" +%FT%TZ)" \
    "$(awk -v t0="$START" -v t1="$end" 'BEGIN {printf "%.1f", t1 - t0}')" "$status" >> "$CALLS"
}
trap record_call EXIT
# Ctrl-C or SIGTERM: every training run writes a checkpoint and exits (the trainer's preemption handling); wait for them.
stop_on_signal() {
  trap '' INT TERM
  echo "reproduce_mini.sh: stopped by a signal; the training runs write a checkpoint and exit. Continue with the same arguments and --resume" >&2
  local jobs; jobs=$(jobs -p | paste -sd, -)
  [ -z "$jobs" ] || pkill -TERM -P "$jobs" || true
  wait
  exit 130
}
trap stop_on_signal INT TERM

# stage NAME CMD...: run CMD; append its wall and CPU seconds (user, system; children included) to timings.tsv.
# A stage finished by an earlier call (its row in timings.tsv; only with --resume) is kept.
stage() {
  local name=$1; shift
  if awk -F'\t' -v name="$name" '$1 == name {found = 1} END {exit !found}' "$TIMINGS"; then
    echo "== $name: finished by an earlier call, kept" >&2; return
  fi
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

# train NAME: one training run, on 2 ranks (torchrun + gloo + FSDP2) or as one process.
train() {
  if [ "$RANKS" = 2 ]; then
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m titan_recur.train --config "$OUT/configs/$1.toml"
  else
    "$PY" -m titan_recur.train --config "$OUT/configs/$1.toml"
  fi
}

# in_background NAME: stage train_NAME in the background, two at a time (one process each); finish waits for all.
JOBS=0
in_background() {
  if [ "$RANKS" = 2 ]; then stage "train_$1" train "$1"; return; fi
  if [ "$JOBS" -ge 2 ]; then wait -n || { echo "reproduce_mini.sh: error: a training run failed" >&2; exit 1; }; JOBS=$(( JOBS - 1 )); fi
  # The run's own shell outlives a signal (trap :) until its trainer has written its checkpoint and exited.
  (trap : INT TERM; stage "train_$1" train "$1") >> "$OUT/logs/$1.log" 2>&1 &
  JOBS=$(( JOBS + 1 ))
}
finish() {
  while [ "$JOBS" -gt 0 ]; do
    wait -n || { echo "reproduce_mini.sh: error: a training run failed (logs in $OUT/logs)" >&2; exit 1; }
    JOBS=$(( JOBS - 1 ))
  done
}

# One train config per run: identical except [job], [model], [training] steps, [recurrence] and the checkpoint
# interval (half the steps: the halfway checkpoint is evaluated too).
write_config() {  # write_config NAME MODEL STEPS SEED RECURRENCE_TOML
  cat > "$OUT/configs/$1.toml" <<TOML
[job]
dump_folder = "$OUT/runs/$1"
description = "reproduce_mini: $1"
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
attention_mask = "$ATTENTION_MASK"

[recurrence]
$5

[optimizer]
name = "muon"
lr = 0.004
adamw_lr = 0.002

[lr_scheduler]
warmup_fraction = 0.05
decay_fraction = 0.5

[checkpoint]
interval = $(( $3 >= 2 ? $3 / 2 : 1 ))
keep_latest_k = 0

[data]
[[data.sources]]
name = "${TASK}_task"
path = "$OUT/task/train.jsonl"
kind = "jsonl"
format = "$FORMAT"
shuffle_buffer = 10000

[metrics]
log_freq = 50
enable_tensorboard = false
TOML
}

stage task "$PY" tools/make_depth_task.py --task "$TASK" --out "$OUT/task" --train-lengths 1-12 \
  --eval-lengths "$EVAL_LENGTHS" --extrapolation-lengths "$EXTRAPOLATION" --eval-examples "$EVAL_EXAMPLES" --seed 0
# shellcheck disable=SC2086  # --surgery is a list of flags
stage convert_recurrent "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/recurrent" ${SURGERY:---shape $SHAPE} \
  --mean-recurrence "$MEAN"
stage convert_static "$PY" tools/convert_hf.py "$SOURCE" "$OUT/models/static" --static

RUNS=()
for seed in $SEED_LIST; do
  write_config "recurrent_s$seed" "$OUT/models/recurrent" "$STEPS" "$seed" "mean_recurrence = $MEAN
backprop_depth = $MEAN
curriculum = \"1-sqrt\"
warmup_fraction = 0.75
seed = $(( 514229 + seed ))"
  RUNS+=("$OUT/runs/recurrent_s$seed")
done
STATIC_RECURRENCE="mean_recurrence = 1
curriculum = \"none\""
write_config static_match "$OUT/models/static" 1 0 "$STATIC_RECURRENCE"
match_flops() {
  "$PY" tools/flops.py --config "$OUT/configs/recurrent_s$FIRST_SEED.toml" --world-size "$RANKS" \
    --match "$OUT/configs/static_match.toml" --json > "$OUT/flops_match.json"
}
stage match match_flops
MATCHED=$("$PY" -c 'import json, sys
m = json.load(open(sys.argv[1]))["matched_steps"]; print(round(m["paper"]), round(m["full"]))' "$OUT/flops_match.json")
read -r STATIC_STEPS STATIC_STEPS_FULL <<< "$MATCHED"
echo "compute-matched static steps: $STATIC_STEPS (paper convention), $STATIC_STEPS_FULL (full convention)"

STATIC=()
for factor in $FACTORS; do
  for seed in $SEED_LIST; do
    write_config "static_x${factor}_s$seed" "$OUT/models/static" $(( factor * STATIC_STEPS )) "$seed" "$STATIC_RECURRENCE"
    STATIC=("static_x${factor}_s$seed" "${STATIC[@]}")  # the longest first: two runs at a time then finish sooner
    RUNS+=("$OUT/runs/static_x${factor}_s$seed")
  done
done
[ "${#STATIC[@]}" -gt 0 ] && in_background "${STATIC[0]}"
for seed in $SEED_LIST; do in_background "recurrent_s$seed"; done
for name in "${STATIC[@]:1}"; do in_background "$name"; done
finish
# Checkpoints written on a signal served only to resume; the comparison evaluates the planned ones (halfway, last).
for run in "${RUNS[@]}"; do
  read -r STEPS_OF_RUN INTERVAL < <(awk -F' = ' '$1 == "steps" {s = $2} $1 == "interval" {i = $2} END {print s, i}' \
    "$OUT/configs/${run##*/}.toml")
  for checkpoint in "$run"/checkpoints/step-*; do
    step=${checkpoint##*step-}
    if [ -d "$checkpoint" ] && (( step % INTERVAL != 0 && step != STEPS_OF_RUN )); then
      echo "removing $checkpoint: written on a signal to resume from, not one the comparison evaluates" >&2
      rm -rf "$checkpoint"
    fi
  done
done

TASKS=$(ls "$OUT/task/${TASK}"_[0-9]*.yaml | awk -F"${TASK}_" '{print $NF "\t" $0}' | sort -n | cut -f2 | paste -sd, -)  # by length
stage compare "$PY" tools/compare.py "${RUNS[@]}" --task "$TASKS" --data "$OUT/task/validation.jsonl" \
  --format prompt_completion --loss-batches "$LOSS_BATCHES" --recurrences "$RECURRENCES" --checkpoints \
  --batch-size 100 --max-gen-toks 2 --out "$OUT/compare"
stage summarize "$PY" tools/summarize_mini.py "$OUT/compare/compare.json" --task "$OUT/task/task.json" \
  --out "$OUT/summary"

# total: the elapsed wall time of every call (training runs overlap, two at a time) and the CPU seconds of every stage.
EARLIER_CALLS=$(awk -F'\t' 'NR > 1 {w += $3} END {print w + 0}' "$CALLS")
awk -F'\t' -v wall="$(awk -v t0="$START" -v t1="$(date +%s.%N)" -v w="$EARLIER_CALLS" 'BEGIN {print t1 - t0 + w}')" \
  'NR > 1 {u += $3; s += $4} END {printf "total\t%.1f\t%.1f\t%.1f\n", wall, u, s}' "$TIMINGS" >> "$TIMINGS"
echo
column -t -s $'\t' "$TIMINGS"
cat <<TXT

Done. Compute-matched static steps: $STATIC_STEPS (paper convention), $STATIC_STEPS_FULL (full).
  summary:  $OUT/summary/summary.md ($OUT/summary/summary.json, $OUT/summary/*.png)
  tables:   $OUT/compare/compare.md ($OUT/compare/compare.json), per chain length and run
  runs:     $OUT/runs/{recurrent_s*,static_x*_s*} (metrics.jsonl, checkpoints/, final_model/)
  timings:  $TIMINGS (wall and CPU seconds per stage; training stages overlap, total is the elapsed wall of every call: $CALLS)
TXT
