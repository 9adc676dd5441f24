"""A private Slurm cluster on this machine, for tests: munged, slurmctld and two slurmd "nodes" n1, n2; and the
environment without Slurm variables that launcher tests start from (``clean_env``).

Everything lives in one temporary folder: its own munge key and socket, slurm.conf, state, spool,
logs and free ports, so a system Slurm or munge (and /etc) is neither read nor changed. Both nodes
are 127.0.0.1 (NodeAddr): no /etc/hosts entry is needed, but the names n1, n2 do not resolve, so a
job must be told to rendezvous at 127.0.0.1. Needs root (slurmd starts job steps as their user) and
Debian's slurm-wlm and munge (tools/setup_env.sh installs them when it runs as root with apt-get).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

NODES = ("n1", "n2")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
SBIN_PATH = os.pathsep.join((os.environ.get("PATH", ""), "/usr/sbin", "/sbin"))
START_TIMEOUT_S = 120.0  # hang guards only: every wait below polls for its event
STOP_TIMEOUT_S = 60.0
TERMINAL_JOB_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}

SLURM_CONF = """\
ClusterName=titan_recur_test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
# cred_expire (default 120 s) is also how long a requeued job waits before it may start again.
AuthInfo=socket={root}/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n1 NodeAddr=127.0.0.1 Port={n1_port} CPUs=1 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={n2_port} CPUs=1 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why no private cluster can start here (None: it can)."""
    absent = [name for name in PROGRAMS if shutil.which(name, path=SBIN_PATH) is None]
    if absent:
        return f"no {', '.join(absent)} here (apt-get install slurm-wlm munge; tools/setup_env.sh does it as root)"
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts job steps as their user)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def poll(done: Callable[[], bool], what: str, timeout: float, why_not: Callable[[], str] = lambda: "") -> None:
    """Until ``done()``; AssertionError naming ``what`` (and ``why_not()``) after ``timeout`` s, a hang guard."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s (a hang guard)\n{why_not()}")
        time.sleep(0.1)


def tail(path: Path, chars: int = 4000) -> str:
    return f"--- {path.name} ---\n{path.read_text(errors='replace')[-chars:]}" if path.is_file() else ""


class SlurmCluster:
    """The running cluster: :meth:`start` it, run clients with :meth:`client`, :meth:`stop` at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {**os.environ, "PATH": SBIN_PATH, "SLURM_CONF": str(root / "slurm.conf")}
        self.daemons: dict[str, subprocess.Popen] = {}

    @classmethod
    def start(cls) -> SlurmCluster:
        """munged, slurmctld and the two slurmd, until both nodes are idle; on failure all stopped again."""
        root = Path(tempfile.mkdtemp(prefix="titan_recur_slurm_"))
        root.chmod(0o755)  # munged wants its socket's folder searchable by everyone
        cluster = cls(root)
        try:
            cluster._write_config()
            cluster._start_munged()
            cluster._spawn("slurmctld", ["slurmctld", "-D"])
            for node in NODES:
                cluster._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
            poll(cluster._nodes_idle, "both nodes idle", START_TIMEOUT_S, cluster.logs)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_config(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for folder in ("state", *(f"spool/{node}" for node in NODES)):
            (self.root / folder).mkdir(parents=True)
        (self.root / "plugstack.conf").write_text("")  # no SPANK plugins of the system's Slurm
        ctld_port, n1_port, n2_port = free_ports(3)
        (self.root / "slurm.conf").write_text(
            SLURM_CONF.format(
                host=socket.gethostname().split(".")[0],
                user=getpass.getuser(),
                root=self.root,
                ctld_port=ctld_port,
                n1_port=n1_port,
                n2_port=n2_port,
            )
        )

    def _start_munged(self) -> None:
        r = self.root
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--key-file={r / 'munge.key'}",
                f"--socket={r / 'munge.socket'}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'munged.log'}",
                f"--seed-file={r / 'munged.seed'}",
            ],
        )
        poll(lambda: (r / "munge.socket").exists() or not self._alive(), "munged's socket", START_TIMEOUT_S, self.logs)
        assert self._alive(), self.logs()

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / f"{name}.out", "w") as out:
            self.daemons[name] = subprocess.Popen(
                argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _alive(self) -> bool:
        return all(p.poll() is None for p in self.daemons.values())

    def _nodes_idle(self) -> bool:
        if not self._alive():
            raise AssertionError(f"a Slurm daemon exited\n{self.logs()}")
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        return done.returncode == 0 and all(states.get(node) == "idle" for node in NODES)

    def logs(self) -> str:
        """The tails of every daemon's log and output, for failure messages."""
        names = sorted(p.name for p in self.root.glob("*.log")) + sorted(p.name for p in self.root.glob("*.out"))
        return "\n".join(tail(self.root / name, 2000) for name in names)

    def client(self, *argv: str) -> str:
        """A Slurm client command's stdout; AssertionError with its stderr when it fails."""
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
        return done.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ...)."""
        line = self.client("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def stop(self) -> None:
        """Cancel every job (the cluster is ours alone), stop the daemons we started, remove the folder."""
        ctld = self.daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            subprocess.run(["scancel", "--user", getpass.getuser()], env=self.env, capture_output=True)
            try:
                poll(self._no_jobs, "every job gone", STOP_TIMEOUT_S)
            except AssertionError:
                pass  # stop the daemons anyway
        for proc in reversed(self.daemons.values()):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.daemons.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def _no_jobs(self) -> bool:
        done = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return done.returncode != 0 or not done.stdout.strip()


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without Slurm/launcher variables, plus ``extra``."""
    drop = (
        "SLURM_",
        "SBATCH_",
        "DRY_RUN",
        "CONFIG",
        "RUN_NAME",
        "REPO",
        "GPUS_PER_NODE",
        "RDZV_",
        "VENV",
        "TORCHRUN",
        "SRUN_EXTRA_ARGS",
        "MAX_REQUEUES",
        "LAUNCH_",
        "PYTHON",
        "PREFLIGHT",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env
