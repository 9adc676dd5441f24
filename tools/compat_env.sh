#!/usr/bin/env bash
# ./.venv-hf4: transformers 4.57 (the oldest release the HF export supports) for tests/hf/test_export_hf_compat.py.
# An overlay on .venv, not a venv: the three packages that differ from .venv's, installed with --target and put
# first on PYTHONPATH by the test, so torch and the rest are .venv's own. Measured on a loaded 2-core CI-class
# machine: 1 min 13 s wall (18 s CPU), 135 MB; a second venv with its own torch took 5 min 3 s (82 s CPU), 1.1 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
OVERLAY=.venv-hf4
PINS="transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2"
if [ "$(cat "$OVERLAY/PINS" 2>/dev/null)" != "$PINS" ]; then
  rm -rf "$OVERLAY"
  # shellcheck disable=SC2086  # the pins are separate arguments
  .venv/bin/pip install -q --no-deps --target "$OVERLAY" $PINS
  echo "$PINS" > "$OVERLAY/PINS"
fi
