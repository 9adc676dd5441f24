#!/bin/bash
# TinyLlama-1.1B depth-recurrence retrofit (4,8,4): train_configs/tinyllama.toml by default,
# on 8 nodes x 8 GPUs (64 GPUs x 16 sequences x 1024 tokens = 2^20 tokens per step, one micro-step).
# The paper's runs (configs and commands): docs/cluster.md, "Reproduce the paper".
#
# From the repository root:
#   mkdir -p logs && sbatch slurm/tinyllama_retrofit.sh
#   sbatch slurm/tinyllama_retrofit.sh --training.steps 100      # extra args go to the trainer
#   sbatch --nodes 2 slurm/tinyllama_retrofit.sh                 # 16 GPUs: 4 micro-steps per step
#   CONFIG=train_configs/tinyllama_static.toml sbatch slurm/tinyllama_retrofit.sh    # static
#   CONFIG=train_configs/tinyllama_cc_math.toml sbatch slurm/tinyllama_retrofit.sh   # CC-Math
#   DRY_RUN=1 bash slurm/tinyllama_retrofit.sh                   # print the srun/torchrun commands only
#   RUN_NAME=my_run sbatch slurm/tinyllama_retrofit.sh           # outputs/my_run (default: the config's name)
#
# Partition, account, QoS: add -p/-A/-q to sbatch (or #SBATCH lines below). The logs/ folder must
# exist before sbatch (Slurm does not create it). A preempted or timed-out job requeues itself and
# resumes from the latest checkpoint in outputs/$RUN_NAME; see slurm/launch.sh and docs/cluster.md.
#SBATCH --job-name=tinyllama-retrofit
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out

CONFIG=${CONFIG:-train_configs/tinyllama.toml}

# sbatch runs a spooled copy of this file: reach the checkout through REPO, the submit directory
# or (run directly) this file's folder; the launcher then checks it and does the rest.
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
[[ -f $REPO/slurm/launch.sh ]] || { echo "error: no slurm/launch.sh in $REPO: sbatch from the repo root or set REPO" >&2; exit 2; }
export REPO CONFIG
source "$REPO/slurm/launch.sh" "$@"
