#!/usr/bin/env bash
# End-to-end CPU demo on the bundled assets: convert -> train on 2 ranks -> loss vs recurrence.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${TITAN_RECUR_SETUP:-}" = skip ] || bash tools/setup_env.sh   # skip: the suite runs this script in its .venv
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
PY=.venv/bin/python
OUT=${DEMO_OUT:-outputs/demo}
rm -rf "$OUT"

echo "== 1/3 surgery: assets/tiny_llama (8 layers) -> prelude 1, core 2, coda 1"
$PY tools/convert_hf.py assets/tiny_llama "$OUT/converted" --shape 1,2,1 --adapter-init random

echo "== 2/3 train: 2 ranks (torchrun, gloo, FSDP2), 1-sqrt curriculum to mean 4, Muon"
$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m titan_recur.train \
  --config train_configs/debug_model.toml --model.path "$OUT/converted" --job.dump_folder "$OUT/run" \
  --training.steps 100 --validation.interval 50

echo "== 3/3 evaluate: held-out loss at test-time recurrence r"
$PY -m titan_recur.eval loss --checkpoint "$OUT/run/final_model" --recurrences 1,2,4,8,16 \
  --config "$OUT/run/config.json" --batches 8 --out "$OUT/eval"   # the run's config: its validation split

cat <<TXT

Done.
  TensorBoard:   .venv/bin/tensorboard --logdir $OUT/run/tb
  metrics:       $OUT/run/metrics.jsonl
  checkpoints:   $OUT/run/checkpoints/
  final model:   $OUT/run/final_model/
  loss vs r:     $OUT/eval/validation_loss.png  ($OUT/eval/validation_loss.json)
TXT
