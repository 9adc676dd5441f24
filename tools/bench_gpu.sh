#!/usr/bin/env bash
# The training step on one GPU: Llama-3.2-1B 4,6,4 (random init), bf16 FSDP2, r in {4, 8, 32} (k = min(r, 8)),
# seq 1024 and 4096, compile on/off, each AC mode. Prints two lines per point (tokens/s, MFU in both conventions,
# peak memory against the preflight's estimate, no-grad and grad iteration times; the step's forward / backward /
# optimizer split) and writes all points as JSON lines to $OUT (default outputs/bench_gpu.jsonl).
#   bash tools/bench_gpu.sh            # the full grid (~36 points)
#   QUICK=1 bash tools/bench_gpu.sh    # r 8 and 32 at seq 1024, compile on, AC per_iteration and none (4 points)
# Then decoding (DECODE=0 skips it): the same shape at r = 32, bf16, prompt 32, 128 new tokens, batch 1, 8 and 64,
# eager and the fast path (tokens/s, the bandwidth bound and its share, warm-up seconds), and the fast path's
# bf16 logits against eager with every token step under set_sync_debug_mode("error").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/bench_gpu.jsonl}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
export TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor" OMP_NUM_THREADS=8

point() {  # r seq compile ac
  local r=$1 seq=$2 compile=$3 ac=$4 k n batch
  k=$(( r < 8 ? r : 8 )); n=$(( r - k )); batch=$(( 8192 / seq ))
  local flags=(--preset llama3.2-1b --shape 4,6,4 --num-steps "$n,$k" --seq-len "$seq" --local-batch "$batch"
               --ac-mode "$ac" --steps "${STEPS:-10}" --warmup 3)
  [ "$compile" = 1 ] && flags+=(--compile)
  $PY -m torch.distributed.run --standalone --nproc-per-node 1 tools/bench_step.py "${flags[@]}" --jsonl "$OUT" \
    | tail -n 2 || echo "r=$r seq $seq compile $compile ac $ac: failed (e.g. out of memory; see above)"
}

if [ "${QUICK:-0}" = 1 ]; then
  for r in 8 32; do for ac in per_iteration none; do point "$r" 1024 1 "$ac"; done; done
else
  for seq in 1024 4096; do for compile in 1 0; do for ac in per_iteration full none; do for r in 4 8 32; do
    point "$r" "$seq" "$compile" "$ac"
  done; done; done; done
fi
if [ "${DECODE:-1}" = 1 ]; then
  shape=(--dim 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --shape 4,6,4)
  $PY tools/bench_generate.py speed --device cuda --dtype bfloat16 "${shape[@]}" --batch-sizes 1,8,64 \
    --recurrences 32 --prompt-len 32 --new-tokens 128 --engines full --compile --rounds 2
  $PY tools/bench_generate.py check --device cuda --dtype bfloat16 "${shape[@]}" --recurrences 32
fi
echo "wrote $OUT"
