#!/bin/bash
# Shared Slurm launcher of titan_recur: one torchrun per node (srun, one task per node), c10d
# rendezvous on the head node, outputs under outputs/$RUN_NAME, requeue after a preemption.
#
# The per-model scripts (slurm/llama1b_retrofit.sh, tinyllama_retrofit.sh, olmo2_retrofit.sh) carry
# the #SBATCH headers, set CONFIG/RUN_NAME defaults and source this file. It also runs on its own:
#     CONFIG=train_configs/debug_model.toml sbatch -N 2 --gpus-per-node 8 --signal B:USR1@300 \
#         --requeue --open-mode append -o logs/%x-%j.out slurm/launch.sh [--section.key VALUE ...]
# Arguments are passed through to the trainer (python -m titan_recur.train), after --config and
# --job.dump_folder, so they override both. --dry-run (or DRY_RUN=1) prints the commands instead of
# running them, then runs the trainer's preflight on this node (`python -m titan_recur.train ...
# --check --world-size <nodes x GPUs>`: config, model folder, tokenizer, data sources, batch
# geometry, the plan) and fails with its status (2) when a check fails; outside Slurm it fakes the
# allocation from SLURM_* variables (below).
#
# Environment (all optional):
#   CONFIG            train config, relative to the repository (set by the per-model scripts)
#   RUN_NAME          outputs/$RUN_NAME is the dump folder (default: the config's file name without
#                     .toml). Keep it across resubmissions: a rerun resumes from its checkpoints.
#   GPUS_PER_NODE     processes per node (default: SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, else 8)
#   RDZV_HOST         rendezvous host (default: the first node of the allocation)
#   RDZV_PORT         rendezvous port (default 29500)
#   SHUTDOWN_TIMEOUT  seconds torchrun gives the workers to write the preemption checkpoint after it
#                     forwards a signal, before SIGKILL (default 240; keep it below the 300 s of
#                     --signal=B:USR1@300). Read by recent torchrun (2.13); older ones use 30 s.
#   MAX_REQUEUES      no more self-requeues once SLURM_RESTART_COUNT reaches this (default 100)
#   VENV              virtualenv to activate (default: $REPO/.venv when it exists)
#   TORCHRUN          the torchrun command (default: torchrun, through the stand-in below)
#   SRUN_EXTRA_ARGS   extra srun flags for site quirks, e.g. "--gpus-per-node=8 --cpu-bind=none"
#   PYTHON            the python of the dry run's preflight (default: $VENV/bin/python, else
#                     $REPO/.venv/bin/python, else python3); PREFLIGHT=0 skips the preflight
#   DRY_RUN=1         print, don't run. Fake allocation: SLURM_JOB_ID, SLURM_JOB_NODELIST (expanded
#                     by `scontrol show hostnames`, or by a built-in expander when scontrol is
#                     absent), SLURM_NNODES, SLURM_GPUS_ON_NODE; missing ones default to job
#                     "dry-run" on the #SBATCH --nodes of the calling script, hosts node0, node1, ...
#
# Preemption and requeue (exit codes of titan_recur.training.trainer: 0 done, 42 preempted after writing a
# checkpoint, 3 non-finite loss, 2 bad config/input):
#   #SBATCH --signal=B:USR1@300 sends SIGUSR1 to this batch shell only, 300 s before the time limit.
#   The trap below forwards it once to srun, which relays it to its tasks: the torchrun agents (and,
#   with proctrack/cgroup, every process of the step). torchrun, told to handle SIGUSR1
#   (--signals-to-handle), forwards it to its workers and waits SHUTDOWN_TIMEOUT seconds; each
#   trainer finishes its step, all ranks agree, write a checkpoint and exit 42. torchrun itself never
#   propagates a worker's exit code (measured with torch 2.13), so the requeue decision is: srun
#   failed AND (its status was 42 OR this shell received SIGUSR1).
#   torchrun ends a handled signal by re-raising torch's SignalException out of its main() once its
#   workers are down: the planned path, which Python reports as an uncaught exception (a traceback in
#   the job log per node, status 1). So the job step runs a stand-in first on PATH (written to
#   .cache/launch/job-<id>/, shared like the checkout, removed when srun ends): the same
#   torch.distributed.run.main under torchrun's own interpreter, which turns only that exception into
#   one "[launch] torchrun on <node>: ..." line and status 128 + signal; any other error keeps its
#   traceback. Not with TORCHRUN set (that command runs as given).
#   Why not --signal=USR1@300 (without B:)? Slurm would then signal the step processes directly but
#   not this shell, which could not know to requeue; and with proctrack/pgid the workers (torchrun
#   starts them in their own sessions) would not get it at all. Without --signals-to-handle,
#   torchrun dies on SIGUSR1 (default action) and Slurm kills the workers mid-checkpoint.
#   Scheduler preemption / scancel send SIGTERM to every process: torchrun forwards SIGTERM (handled
#   by default) and the trainers checkpoint the same way; this shell does not requeue on SIGTERM
#   (a cancelled job stays cancelled; PreemptMode=REQUEUE requeues by itself).
#   Resume is automatic: the requeued job (same job id, same RUN_NAME) reruns the same command and
#   the trainer resumes from the latest complete checkpoint under outputs/$RUN_NAME/checkpoints.

EXIT_PREEMPTED=42

log() { printf '[launch] %s\n' "$*"; }
die() { printf '[launch] error: %s\n' "$*" >&2; exit 2; }

# "gpu[001-003,7],cpu5" -> one host per line: what `scontrol show hostnames` prints (fallback when
# scontrol is absent, e.g. a dry run on a laptop). Zero padding is kept; several bracket groups too.
expand_hostlist() {
  local list=$1 item="" depth=0 ch i
  for ((i = 0; i < ${#list}; i++)); do
    ch=${list:i:1}
    case $ch in
      "[") depth=$((depth + 1)) ;;
      "]") depth=$((depth - 1)) ;;
    esac
    if [[ $ch == "," && $depth -eq 0 ]]; then
      [[ -n $item ]] && _expand_host "$item"
      item=""
    else
      item+=$ch
    fi
  done
  [[ -n $item ]] && _expand_host "$item"
  return 0
}

_expand_host() {
  local host=$1
  if [[ $host != *"["* ]]; then
    printf '%s\n' "$host"
    return
  fi
  local prefix=${host%%\[*} rest=${host#*\[}
  local ranges=${rest%%\]*} suffix=${rest#*\]}
  local range lo hi width n
  local IFS=,
  for range in $ranges; do
    lo=${range%%-*}
    hi=${range#*-}
    width=${#lo}
    for ((n = 10#$lo; n <= 10#$hi; n++)); do
      _expand_host "$prefix$(printf '%0*d' "$width" "$n")$suffix"
    done
  done
}

node_hostnames() {
  local nodelist=$1
  # scontrol needs a reachable Slurm configuration (not so on a login node of another cluster, or on a
  # machine with slurm-wlm installed but no cluster): then the built-in expander.
  if command -v scontrol >/dev/null 2>&1 && scontrol show hostnames "$nodelist" 2>/dev/null; then
    return
  fi
  expand_hostlist "$nodelist"
}

# The #SBATCH --nodes=N of the script that sourced this file (dry runs outside Slurm).
_header_nodes() {
  local script=$1
  [[ -f $script ]] || return 0
  sed -n -E 's/^#SBATCH[[:space:]]+(--nodes[= ]|-N[[:space:]]*)([0-9]+).*/\2/p' "$script" | head -n 1
}

# Shell-quote words for printing (copy-pasteable): plain words stay as they are.
_quote() {
  local out=() word
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+=("$word")
    else
      out+=("'${word//\'/\'\\\'\'}'")
    fi
  done
  printf '%s' "${out[*]}"
}

# The stand-in's program (see "torchrun ends a handled signal" above): torchrun's main(), with the
# SignalException it raises after shutting its workers down on a handled signal reported in one line, and
# the exit barrier's lost store at the end of a finished run (a torch elastic race) logged in one line.
TORCHRUN_QUIET_PY='"""torchrun, ending in one line on a signal it handled (written by slurm/launch.sh)."""
import logging
import os
import signal
import socket
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


class ExitBarrierInOneLine(logging.Filter):
    """After its workers end, each agent waits at an exit barrier on the rendezvous store; when the agent
    hosting the store passes it and exits first, the others lose the store and torch logs a traceback for a
    run whose workers all finished (a race under load). One line instead."""

    def filter(self, record):
        if record.getMessage().startswith("Error waiting on exit barrier"):
            record.msg = "exit barrier: the rendezvous store ended before this node left it (its workers had finished)"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(ExitBarrierInOneLine())
try:
    main()
except SignalException as exc:
    handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for name in handled.split(","):
        signal.signal(getattr(signal, name.strip()), signal.SIG_IGN)  # ending now: a later one changes nothing
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    status = 128 + exc.sigval
    print(
        f"[launch] torchrun on {node}: got {exc.sigval.name}, passed it to its workers and waited for them "
        f"(up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT s); exit {status}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(status)
'

# Put the stand-in for `torchrun` first on PATH (exported to the job step); false when it cannot be
# made (no torchrun on PATH, or its first line is not a plain "#!/path/python"): torchrun runs as is.
quiet_torchrun() {
  local dir=$1 real shebang python
  real=$(command -v torchrun) || return 1
  IFS= read -r shebang < "$real" || return 1
  python=${shebang#\#!}
  if [[ $shebang != "#!/"* || $python == *[[:space:]]* || ${python##*/} != python* || ! -x $python ]]; then
    log "torchrun: $real as is (its first line '$shebang' is not a plain python path)"
    return 1
  fi
  mkdir -p "$dir" || return 1
  printf '%s' "$TORCHRUN_QUIET_PY" > "$dir/torchrun_quiet.py" || return 1
  printf '#!/bin/bash\nexec %q %q "$@"\n' "$python" "$dir/torchrun_quiet.py" > "$dir/torchrun" || return 1
  chmod +x "$dir/torchrun" || return 1
  export PATH="$dir:$PATH"
  log "torchrun: $real through $dir/torchrun (a signal it forwards ends it in one line, not a traceback)"
}

launch_main() {
  set -uo pipefail
  local dry_run=${DRY_RUN:-0} arg
  TRAIN_ARGS=()
  for arg in "$@"; do
    if [[ $arg == "--dry-run" ]]; then dry_run=1; else TRAIN_ARGS+=("$arg"); fi
  done
  [[ $dry_run == 0 || $dry_run == "" ]] && dry_run=0 || dry_run=1

  # Repository root: REPO, else the folder above this file (when run from the checkout), else the
  # submit directory (sbatch runs a spooled copy of the batch script).
  local here candidate
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." 2>/dev/null && pwd)
  for candidate in "${REPO:-}" "$here" "${SLURM_SUBMIT_DIR:-}"; do
    if [[ -n $candidate && -f $candidate/slurm/launch.sh ]]; then REPO=$candidate; break; fi
  done
  [[ -n ${REPO:-} && -f $REPO/slurm/launch.sh ]] || die "cannot find the repository: submit from its root or set REPO"
  cd "$REPO" || die "cannot cd to $REPO"

  [[ -n ${CONFIG:-} ]] || die "set CONFIG=train_configs/<name>.toml (or use a slurm/*_retrofit.sh script)"
  [[ -f $CONFIG ]] || die "config $CONFIG not found under $REPO"
  RUN_NAME=${RUN_NAME:-$(basename "$CONFIG" .toml)}
  local dump="outputs/$RUN_NAME"

  # The allocation.
  local job_id=${SLURM_JOB_ID:-} nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
  local nnodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}
  if [[ -z $job_id ]]; then
    ((dry_run)) || die "not inside a Slurm job: submit with sbatch (or DRY_RUN=1 to print the commands)"
    job_id=dry-run
  fi
  local hosts=() host
  if [[ -n $nodelist ]]; then
    while IFS= read -r host; do [[ -n $host ]] && hosts+=("$host"); done < <(node_hostnames "$nodelist")
    ((${#hosts[@]})) || die "cannot expand SLURM_JOB_NODELIST=$nodelist"
  else
    ((dry_run)) || die "SLURM_JOB_NODELIST is not set"
    nnodes=${nnodes:-$(_header_nodes "${LAUNCH_CALLER:-}")}
    nnodes=${nnodes:-1}
    local n
    for ((n = 0; n < nnodes; n++)); do hosts+=("node$n"); done
  fi
  nnodes=${nnodes:-${#hosts[@]}}
  [[ $nnodes == "${#hosts[@]}" ]] || die "SLURM_NNODES=$nnodes but the node list has ${#hosts[@]} hosts: ${hosts[*]}"

  local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  if [[ -z $gpus && -n ${SLURM_GPUS_PER_NODE:-} ]]; then
    gpus=${SLURM_GPUS_PER_NODE##*:}   # "h100:8" -> 8
  fi
  gpus=${gpus:-8}
  [[ $gpus =~ ^[0-9]+$ && $gpus -ge 1 ]] || die "cannot tell the GPUs per node (got '$gpus'): set GPUS_PER_NODE"

  local head=${RDZV_HOST:-${hosts[0]}} port=${RDZV_PORT:-29500}

  # One torchrun per node; identical on every node: c10d assigns the node ranks (the agent on the
  # rendezvous host serves the store), so no --node-rank is passed.
  local torchrun_cmd=(
    ${TORCHRUN:-torchrun}
    --nnodes "$nnodes" --nproc-per-node "$gpus"
    --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$job_id"
    --max-restarts 0
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    -m titan_recur.train --config "$CONFIG" --job.dump_folder "$dump"
    ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}   # (empty-array safe under set -u on bash < 4.4)
  )
  local srun_cmd=(srun --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1)
  # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05).
  [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && srun_cmd+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  # shellcheck disable=SC2206  # word splitting intended
  [[ -n ${SRUN_EXTRA_ARGS:-} ]] && srun_cmd+=(${SRUN_EXTRA_ARGS})

  log "job $job_id: $nnodes node(s) x $gpus GPU(s) = $((nnodes * gpus)) ranks; nodes: ${hosts[*]}"
  log "rendezvous: c10d at $head:$port, id $job_id (node ranks are assigned by the rendezvous)"
  log "run: $RUN_NAME, config $CONFIG, dump folder $dump (restart ${SLURM_RESTART_COUNT:-0})"
  log "command: $(_quote "${srun_cmd[@]}" "${torchrun_cmd[@]}")"
  local i
  for ((i = 0; i < nnodes; i++)); do
    log "node $i ${hosts[i]}: $(_quote "${torchrun_cmd[@]}")"
  done
  log "requeue: 'scontrol requeue $job_id' when the trainer exits $EXIT_PREEMPTED (checkpoint written) or SIGUSR1 arrived; 0 = done; 3 = non-finite loss, 2 = bad input: no requeue"
  if ((dry_run)); then
    preflight "$dump" "$((nnodes * gpus))" || return $?
    log "dry run: nothing was started"
    return 0
  fi

  # Runtime environment.
  if [[ -n ${VENV:-} ]]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate" || die "cannot activate VENV=$VENV"
  elif [[ -f $REPO/.venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    source "$REPO/.venv/bin/activate"
  fi
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-240}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
  export PYTHONUNBUFFERED=1
  # Collective-library knobs are site-specific and left to the user: see the table in
  # docs/cluster.md. Typical settings, exported before sbatch (the job inherits the environment):
  #   NVIDIA (NCCL): NCCL_SOCKET_IFNAME=^lo,docker0  NCCL_IB_HCA=mlx5  NCCL_IB_GID_INDEX=3 (RoCE)
  #                  NCCL_NVLS_ENABLE=0 (if NVLink SHARP misbehaves)  NCCL_DEBUG=WARN|INFO
  #                  TORCH_NCCL_ASYNC_ERROR_HANDLING=1  TORCH_NCCL_DUMP_ON_TIMEOUT=1
  #                  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  (AWS EFA: FI_PROVIDER=efa)
  #   AMD (RCCL reads the NCCL_* names): HSA_FORCE_FINE_GRAIN_PCIE=1  NCCL_IB_HCA=<rdma devices>
  #                  NCCL_IB_GID_INDEX=3  NCCL_SOCKET_IFNAME=<nic>  NCCL_MIN_NCHANNELS=112
  #                  HSA_NO_SCRATCH_RECLAIM=1  RCCL_MSCCL_ENABLE=0 (to rule MSCCL out)  NCCL_DEBUG=WARN|INFO
  mkdir -p logs "$dump"

  local quiet_dir=""
  if [[ -z ${TORCHRUN:-} ]] && quiet_torchrun "$REPO/.cache/launch/job-$job_id"; then
    quiet_dir=$REPO/.cache/launch/job-$job_id
  fi

  PREEMPT_SIGNALED=0
  SRUN_PID=""
  trap '_on_usr1' USR1
  trap '_on_term' TERM
  "${srun_cmd[@]}" "${torchrun_cmd[@]}" &
  SRUN_PID=$!
  local rc
  while :; do
    rc=0
    wait "$SRUN_PID" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while srun still runs: keep waiting.
    if ((rc > 128)) && kill -0 "$SRUN_PID" 2>/dev/null; then continue; fi
    break
  done
  log "srun exited with status $rc"
  [[ -n $quiet_dir ]] && rm -rf "$quiet_dir"
  if ((rc == 0)); then
    log "training finished"
    return 0
  fi
  if ((rc == EXIT_PREEMPTED || PREEMPT_SIGNALED)); then
    _requeue "$job_id"
    return $?
  fi
  log "not requeued (status $rc: see the trainer's error above)"
  return "$rc"
}

# The trainer's --check on this node, for the allocation's world size; its status on failure.
preflight() {
  local dump=$1 world=$2 python=${PYTHON:-}
  if [[ ${PREFLIGHT:-1} == 0 ]]; then
    log "preflight: skipped (PREFLIGHT=0)"
    return 0
  fi
  if [[ -z $python ]]; then
    if [[ -n ${VENV:-} ]]; then python=$VENV/bin/python
    elif [[ -x $REPO/.venv/bin/python ]]; then python=$REPO/.venv/bin/python
    else python=python3
    fi
  fi
  local check_cmd=("$python" -m titan_recur.train --config "$CONFIG" --job.dump_folder "$dump"
    ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} --check --world-size "$world")
  log "preflight: $(_quote "${check_cmd[@]}")"
  local rc=0
  "${check_cmd[@]}" || rc=$?
  if ((rc != 0)); then
    printf '[launch] error: preflight failed (status %s): fix the problems above before submitting\n' "$rc" >&2
    return "$rc"
  fi
  return 0
}

_on_usr1() {
  PREEMPT_SIGNALED=1
  log "SIGUSR1 (time limit near): forwarding to the job step; the trainers checkpoint and exit $EXIT_PREEMPTED"
  [[ -n $SRUN_PID ]] && kill -USR1 "$SRUN_PID" 2>/dev/null
  return 0
}

_on_term() {
  log "SIGTERM (cancelled or preempted by the scheduler): the trainers checkpoint; no self-requeue"
  return 0
}

_requeue() {
  local job_id=$1 restarts=${SLURM_RESTART_COUNT:-0} max=${MAX_REQUEUES:-100}
  if ((restarts >= max)); then
    log "not requeued: restart $restarts reached MAX_REQUEUES=$max; resubmit to continue (it resumes)"
    return "$EXIT_PREEMPTED"
  fi
  log "preempted: scontrol requeue $job_id (the requeued job resumes from the latest checkpoint)"
  if scontrol requeue "$job_id"; then
    return 0
  fi
  log "scontrol requeue failed (requeue disabled here?): resubmit the same script and RUN_NAME to resume"
  return "$EXIT_PREEMPTED"
}

# Sourced with LAUNCH_LIB_ONLY=1 (tests): define the functions only.
if [[ ${LAUNCH_LIB_ONLY:-0} != 1 ]]; then
  if [[ -z ${LAUNCH_CALLER:-} && -n ${BASH_SOURCE[1]:-} ]]; then
    LAUNCH_CALLER="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)/$(basename "${BASH_SOURCE[1]}")"
  fi
  launch_main "$@"
  _launch_rc=$?
  # Sourced by a batch script: end it with the launcher's status.
  exit "$_launch_rc"
fi
