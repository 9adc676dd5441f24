#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it (not editable) into a fresh virtual
# environment without system site-packages, and run one command of each kind from a folder outside
# the checkout. A step of .ci/run; any failure fails it.
# The dependencies: by default those of the environment running this script (.ci/run's .venv, already
# installed and compiled), seen by the fresh venv through a path line, never its .pth files (so not its
# editable titan_recur); `pip check` then checks the wheel's declared requirements against them.
# WHEEL_CHECK_DEPS=fresh installs the pinned dependencies into the fresh venv instead (minutes).
#   WHEEL_CHECK_DIR  work folder (default .cache/wheel_check; removed when the check passes)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${WHEEL_CHECK_DIR:-$REPO/.cache/wheel_check}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
DEPS=${WHEEL_CHECK_DEPS:-shared}
rm -rf "$WORK"
mkdir -p "$WORK/dist" "$WORK/run"
# The console scripts pyproject.toml declares ([project.scripts]), read by the environment's python: each must be
# installed into the fresh venv and run by a step below (a step's name starts with the script it runs).
SCRIPTS=$("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    print(*tomllib.load(f)["project"]["scripts"])
EOF
)
STEPPED=" "
step() { printf '%-28s' "$1"; STEPPED+="${1%% *} "; }
ok() { echo "ok ($((SECONDS - START)) s)"; }
START=$SECONDS

step "build wheel"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$REPO" && ok
WHEEL=$(ls "$WORK"/dist/titan_recur-*.whl)
step "fresh venv + install"
"$PYTHON" -m venv --without-pip "$WORK/venv"
BIN=$WORK/venv/bin
SITE=$("$BIN/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ "$DEPS" = fresh ]; then
  "$PYTHON" -m pip --python "$BIN/python" install -q --no-compile torch==2.13.0   # the CPU build
  "$PYTHON" -m pip --python "$BIN/python" install -q --no-compile -c "$REPO/constraints.txt" "$WHEEL[eval]"
else
  "$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/shared_dependencies.pth"
  "$PYTHON" -m pip --python "$BIN/python" install -q --no-deps "$WHEEL"
  "$PYTHON" -m pip --python "$BIN/python" check > /dev/null   # every declared requirement is met
fi
ok

cd "$WORK/run"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
step "console scripts installed"
for script in $SCRIPTS; do
  test -x "$BIN/$script" || { echo "pip did not install $script"; exit 1; }
done
ok

step "package is the wheel's"
"$BIN/python" -c "import titan_recur, sys; sys.exit(not titan_recur.__file__.startswith('$WORK/venv/'))" && ok

step "titan-recur-convert"
"$BIN/titan-recur-convert" "$REPO/assets/tiny_llama" converted --shape 1,2,1 --dry-run | grep -q "dry run: nothing written" && ok

step "titan-recur-flops"  # a shipped config (with its extends), found from outside the checkout
"$BIN/titan-recur-flops" --config train_configs/tinyllama_cc_math.toml --world-size 64 \
    --model.path none --model.init random --json | grep -q '"steps": 50000' && ok

step "titan-recur-prepare-data"
"$BIN/titan-recur-prepare-data" --tokenizer "$REPO/assets/tokenizer" --path "$REPO/assets/corpus/math.jsonl" \
    --kind jsonl --seq-len 64 --out prepared --workers 1 > /dev/null 2>&1 && ok

step "titan-recur-train"  # the shipped debug config, its data sources pointed at the checkout's assets
"$BIN/titan-recur-train" --config train_configs/debug_model.toml --job.dump_folder run \
    --model.path "$REPO/assets/tiny_llama_recurrent" --training.steps 2 --validation.enable false \
    --data.sources.0.path "$REPO/assets/corpus/general.jsonl" --data.sources.1.path "$REPO/assets/corpus/math.jsonl" \
    > train.log 2>&1 && test -f run/final_model/model.safetensors && ok

step "titan-recur-eval loss"
"$BIN/titan-recur-eval" loss --checkpoint run/final_model --data "$REPO/assets/corpus/math.jsonl" \
    --recurrences 1,2 --batches 1 --batch-size 2 --seq-len 32 --out eval_loss > /dev/null && test -f eval_loss/validation_loss.json && ok

step "titan-recur-eval harness"  # the shipped task yaml is found and read (offline, its dataset cannot load)
set +e
"$BIN/titan-recur-eval" harness --model-args pretrained=run/final_model --tasks gsm8k_cot_recur --out h 2> harness.err
code=$?
set -e
if [ $code -ne 2 ] || grep -q "unknown task" harness.err || ! grep -q "openai/gsm8k" harness.err; then
  echo "exit $code"; cat harness.err; exit 1
fi
ok

step "titan-recur-export"
"$BIN/titan-recur-export" run/final_model hf_export > /dev/null && test -f hf_export/config.json && ok

step "titan-recur-generate"  # greedy tokens from the trained run, two core iterations each
"$BIN/titan-recur-generate" --checkpoint run/final_model --prompt "1 + 1 =" --max-new-tokens 3 --num-steps 2 \
    --json > generate.json && grep -q '"prompts"' generate.json && ok

step "titan-recur-analyze-layers"
"$BIN/titan-recur-analyze-layers" --help > /dev/null && ok

step "titan-recur-compare"  # the trained run against itself: one held-out loss point at r = 1
"$BIN/titan-recur-compare" run --data "$REPO/assets/corpus/math.jsonl" --recurrences 1 --loss-batches 1 \
    --loss-batch-size 2 --seq-len 32 --out compare > /dev/null 2>&1 && ok

for script in $SCRIPTS; do
  case "$STEPPED" in *" $script "*) ;; *) echo "no step runs $script (pyproject.toml's [project.scripts])"; exit 1 ;; esac
done

rm -rf "$WORK"
echo "wheel check passed in $((SECONDS - START)) s"
