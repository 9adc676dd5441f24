#!/usr/bin/env bash
# docs/surgery.md's study: does tools/analyze_layers.py's ranking predict which retrofit ends better?
# On the miniature's task (docs/results.md), from a 6-layer source, every placement of a 2-layer core
# between prelude layer 0 and coda layer 5 (two layers dropped) is ranked, then retrofitted and trained
# with the same recipe, and scored on the long chains.
#
#   bash tools/surgery_study.sh [--out DIR]
#
# Stages:
#   1. source   tools/make_mini_source.sh --layers 6 --steps 4000 (the shipped source's recipe with 6 blocks; ~12 min)
#   2. analyze  tools/analyze_layers.py --recommend 1,2,1 --measure 3 on the answer-only loss of the task
#   3. retrofit tools/reproduce_mini.sh per placement (--surgery, one seed, the static arm with the first)
#   4. table    OUT/study.md: each placement's analysis ranks next to its accuracy at r = 1, 2, 4, 8
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=outputs/surgery_study
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?--out needs a folder}; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "surgery_study.sh: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -x .venv/bin/python ] || bash tools/setup_env.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
mkdir -p "$OUT"

[ -f "$OUT/source/hf/config.json" ] || bash tools/make_mini_source.sh --layers 6 --steps 4000 --out "$OUT/source"
"$PY" tools/make_depth_task.py --out "$OUT/task" --train-lengths 1-12 --eval-lengths 1-12 --seed 0
"$PY" tools/analyze_layers.py "$OUT/source/hf" --data "$OUT/task/validation.jsonl" --format prompt_completion \
  --seq-len 64 --tokens 16384 --recommend 1,2,1 --measure 3 --out "$OUT/analysis" | tee "$OUT/analysis.txt"

factors=1
for core in 1-2 2-3 3-4; do
  rm -rf "$OUT/core$core"
  bash tools/reproduce_mini.sh --source "$OUT/source/hf" --surgery "--prelude 0 --core $core --coda 5" --seeds 0 \
    --static-factors "$factors" --out "$OUT/core$core"
  factors=""
done

"$PY" - "$OUT" <<'PY' | tee "$OUT/study.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
analysis = json.loads((out / "analysis" / "layer_analysis.json").read_text())
print("| core | analysis rank (measured loss) | angular rank | loss, identity r=1 | long chains r=1 | r=2 | r=4 | r=8 |")
print("|---|---|---|---|---|---|---|---|")
for core in ("1-2", "2-3", "3-4"):
    summary = json.loads((out / f"core{core}" / "summary" / "summary.json").read_text())
    final = summary["arms"]["recurrent"]["points"][-1]["results"]
    first, last = map(int, core.split("-"))
    ranked = analysis["candidates"]["ranked"]  # in the tool's order: by measured loss
    rank, candidate = next((i, c) for i, c in enumerate(ranked, 1) if c["core"] == list(range(first, last + 1)))
    cells = " | ".join(f"{final[str(r)]['long']['mean']:.2f}" for r in (1, 2, 4, 8))
    paper = " (the paper's)" if candidate["paper_placement"] else ""
    print(f"| {core}{paper} | {rank} | {candidate['angular_rank']} | {candidate['loss_identity_r1']:.4f} | {cells} |")
static = json.loads((out / "core1-2" / "summary" / "summary.json").read_text())["arms"]["static_x1"]
print(f"\nstatic, all 6 layers, matched FLOPs of the 1-2 retrofit: {static['points'][-1]['results']['1']['long']['mean']:.2f}")
PY
