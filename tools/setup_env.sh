#!/usr/bin/env bash
# Create (or reuse) ./.venv with the tested, pinned dependencies. CPU build of torch by default;
# GPU users install their CUDA/ROCm torch first (see README) and set TITAN_RECUR_TORCH=skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# tests/system/test_slurm_real.py runs the launcher under a private Slurm cluster. With TITAN_RECUR_REQUIRE_SLURM=1
# (.ci/run sets it; a user's install never touches system packages) install Slurm and munge when we can
# (root, apt-get, no slurmctld yet). Not fatal: if apt fails, that test says why.
if [ "${TITAN_RECUR_REQUIRE_SLURM:-0}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    && ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ]; then
  mkdir -p .cache
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurm-wlm munge; } >.cache/setup_env_slurm.log 2>&1; then
    echo "setup_env: could not install slurm-wlm and munge (.cache/setup_env_slurm.log); tests/system/test_slurm_real.py reports it" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ "${TITAN_RECUR_TORCH:-}" != "skip" ]; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -c constraints.txt -e '.[dev]'
bash tools/compat_env.sh
