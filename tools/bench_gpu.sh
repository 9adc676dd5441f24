#!/usr/bin/env bash
# One GPU's benchmark points for Llama-3.2-1B 4,6,4 (random init, bf16): the real training step (tools/bench_step.py:
# tokens/s, MFU in both conventions, peak memory against the preflight's estimate, no-grad and grad iteration times,
# the step's forward / backward / optimizer split) and decoding at r = 32, prompt 32 (tools/bench_generate.py speed:
# eager and the fast path, tokens/s, the bandwidth bound and its share, warm-up seconds; check: the fast path's bf16
# logits against eager, every token step under set_sync_debug_mode("error")).
#   bash tools/bench_gpu.sh            # the training grid (~36 points: r 4, 8, 32; seq 1024, 4096; compile on/off;
#                                      # each AC mode), then decoding at batch 1, 8 and 64 (DECODE=0 skips it)
#   QUICK=1 bash tools/bench_gpu.sh    # r 8 and 32 at seq 1024, compile on, AC per_iteration and none, then decoding
#   WINDOW=1 bash tools/bench_gpu.sh   # <= 8 minutes, one 10-minute call: decoding first, then training r = 32
#                                      # batch 8 and 16 and the static 16 layers, each point under its own timeout
#   DRY_RUN=1 bash tools/bench_gpu.sh  # WINDOW's points on the CPU, tiny shapes, one step each: the script works
# It runs as a lent GPU machine has it: no .venv (then python3; PY overrides), titan_recur not installed (the checkout
# goes on PYTHONPATH), no datasets/torchdata. The figures go as JSON lines to BENCH_JSONL (default
# $OUT/bench_gpu.jsonl where $OUT is a folder, as on that machine, else outputs/bench_gpu.jsonl; a point that fails or
# runs out of time is a line {"point", "failed"}), everything printed also to the .log beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PYTHON=${VENV_PYTHON:-.venv/bin/python}
if [ -z "${PY:-}" ]; then
  if [ -x "$VENV_PYTHON" ]; then PY=$VENV_PYTHON; else PY=python3; fi
fi
if [ -z "${BENCH_JSONL:-}" ]; then
  if [ -d "${OUT:-}" ]; then BENCH_JSONL=$OUT/bench_gpu.jsonl; else BENCH_JSONL=outputs/bench_gpu.jsonl; fi
fi
LOG=${BENCH_JSONL%.jsonl}.log
mkdir -p "$(dirname "$BENCH_JSONL")"
: > "$BENCH_JSONL"
echo "== python: $PY" | tee "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

run_point() {  # name seconds (0: no limit) command...: its output to the console and the log; a failure is a line
  local name=$1 seconds=$2 status=0
  shift 2
  echo "== $name" | tee -a "$LOG"
  timeout -s KILL "$seconds" "$@" 2>&1 | tee -a "$LOG" || status=$?
  if [ "$status" != 0 ]; then
    local why="exit $status"
    if [ "$status" = 137 ] && [ "$seconds" != 0 ]; then why="killed at its ${seconds} s limit (or out of memory)"; fi
    echo "== $name: failed, $why" | tee -a "$LOG"
    printf '{"point": "%s", "failed": "%s"}\n' "$name" "$why" >> "$BENCH_JSONL"
  fi
}

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

train_point() {  # name seconds bench_step flags...: one process group of one rank, as torchrun --nproc-per-node 1
  # makes, but launched directly: torchrun starts its worker in a session of its own, which timeout cannot stop.
  local name=$1 seconds=$2
  shift 2
  run_point "$name" "$seconds" env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
    "$PY" tools/bench_step.py "$@" --jsonl "$BENCH_JSONL"
}

grid_point() {  # r seq compile ac
  local r=$1 seq=$2 compile=$3 ac=$4 k n
  k=$(( r < 8 ? r : 8 )); n=$(( r - k ))
  local flags=(--preset llama3.2-1b --shape 4,6,4 --num-steps "$n,$k" --seq-len "$seq" --local-batch $(( 8192 / seq ))
               --ac-mode "$ac" --steps "${STEPS:-10}" --warmup 3)
  [ "$compile" = 1 ] && flags+=(--compile)
  train_point "train r=$r seq $seq compile $compile ac $ac" 0 "${flags[@]}"
}

decode_points() {  # seconds per speed point, seconds for the check, rounds, then the model and size flags
  local speed_s=$1 check_s=$2 rounds=$3 batch
  shift 3
  for batch in 1 8 64; do
    run_point "decode batch $batch" "$speed_s" "$PY" tools/bench_generate.py speed "$@" --batch-sizes "$batch" \
      --engines full "${DECODE_COMPILE[@]}" --rounds "$rounds" --jsonl "$BENCH_JSONL"
  done
  # Batch 1 and the speed points' sizes: the fast path's pieces are those of batch 1, from the inductor cache.
  run_point "decode check" "$check_s" "$PY" tools/bench_generate.py check "$@" --batch-size 1 --jsonl "$BENCH_JSONL"
}

DECODE_FLAGS=(--device cuda --dtype bfloat16 --dim 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --shape 4,6,4
              --recurrences 32 --prompt-len 32)
DECODE_COMPILE=(--compile)
if [ "${WINDOW:-0}" = 1 ] || [ "${DRY_RUN:-0}" = 1 ]; then
  train=(--preset llama3.2-1b --seq-len 1024 --compile --steps 3 --warmup 2)
  recurrent=("${train[@]}" --shape 4,6,4 --num-steps 24,8 --ac-mode per_iteration)
  static=("${train[@]}" --shape 16,0,0 --num-steps 0,0 --ac-mode none)
  new_tokens=64
  # Seconds: each decode batch, the check, training batch 8, batch 16, static: 470 at most. A point past its limit
  # is killed and recorded, and the next one runs.
  limits=(70 45 75 85 55)
  if [ "${DRY_RUN:-0}" = 1 ]; then
    # The same points on the CPU: a d-32 random model for decoding; assets/tiny_llama_recurrent at (2,1) for every
    # training point, the static arm's too (no tiny static model exists); one step each; nothing compiled but the
    # check's fast path (a CPU compiles for minutes); no limits (a test must not depend on the machine's speed).
    DECODE_FLAGS=(--device cpu --dtype bfloat16 --dim 32 --heads 2 --kv-heads 1 --ffn 64 --vocab 64 --shape 1,2,1
                  --recurrences 2 --prompt-len 4)
    DECODE_COMPILE=()
    tiny=(--model assets/tiny_llama_recurrent --num-steps 2,1 --seq-len 32 --steps 1 --warmup 1)
    recurrent=("${tiny[@]}" --ac-mode per_iteration)
    static=("${tiny[@]}" --ac-mode none)
    new_tokens=4
    limits=(0 0 0 0 0)
  fi
  decode_points "${limits[0]}" "${limits[1]}" 1 "${DECODE_FLAGS[@]}" --new-tokens "$new_tokens"
  train_point "train r=32 batch 8" "${limits[2]}" "${recurrent[@]}" --local-batch 8
  train_point "train r=32 batch 16" "${limits[3]}" "${recurrent[@]}" --local-batch 16
  train_point "train static batch 8" "${limits[4]}" "${static[@]}" --local-batch 8
else
  if [ "${QUICK:-0}" = 1 ]; then
    for r in 8 32; do for ac in per_iteration none; do grid_point "$r" 1024 1 "$ac"; done; done
  else
    for seq in 1024 4096; do for compile in 1 0; do for ac in per_iteration full none; do for r in 4 8 32; do
      grid_point "$r" "$seq" "$compile" "$ac"
    done; done; done; done
  fi
  if [ "${DECODE:-1}" = 1 ]; then
    decode_points 0 0 2 "${DECODE_FLAGS[@]}" --new-tokens 128
  fi
fi
echo "wrote $BENCH_JSONL and $LOG"
