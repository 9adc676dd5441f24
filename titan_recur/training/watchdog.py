"""Step watchdog: ends a job whose training step stalls on some rank, with one line saying where.

A daemon thread per rank. The trainer marks each step's start and end; when a step has run past its
deadline, the thread prints one line and exits the process with EXIT_STALLED, so that the launcher
(torchrun, srun) tears the other ranks down instead of every rank waiting in a collective.

Each rank's thread also publishes a heartbeat (its current and last completed step) to the job's
c10d store at each step's start and end and once per poll. The line then names the ranks that went silent: a rank frozen by SIGSTOP
or a dead node stops beating, while a rank stuck inside a call (a wedged GPU, a hung file system)
still beats and its own watchdog reports it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from titan_recur.utils.exit_codes import EXIT_STALLED

# The first step of a launch compiles and warms up: it gets this multiple of the step timeout.
FIRST_STEP_FACTOR = 3
_STORE_TIMEOUT_S = 5.0
_SHOWN_RANKS = 8


def heartbeat_store() -> dist.Store | None:
    """A client of the job's rendezvous store (torchrun's agent, or rank 0 under srun), or None."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port and dist.is_initialized()):
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    return dist.PrefixStore("titan_recur_heartbeat/", store)


class StepWatchdog:
    """:meth:`start` it, arm with :meth:`step_started`, disarm with :meth:`step_finished`; a missed deadline
    ends the process. ``timeout_s`` 0: off."""

    def __init__(self, timeout_s: float, rank: int, world_size: int) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.store: dist.Store | None = None
        self.poll_s = min(1.0, timeout_s / 10)
        self._current: tuple[int, float, float] | None = None  # (step, start, deadline in s)
        self._last_done: int | None = None
        self._first = True
        self._stop = threading.Event()
        self._wake = threading.Event()  # a step started or ended: beat now, not at the next poll
        self._thread = threading.Thread(target=self._run, name="titan_recur-watchdog", daemon=True)

    def start(self, store: dist.Store | None = None) -> None:
        """Start watching (and sending heartbeats to ``store``, if given)."""
        if self.timeout_s > 0:
            self.store = store
            self._thread.start()

    def step_started(self, step: int) -> None:
        limit = self.timeout_s * (FIRST_STEP_FACTOR if self._first else 1)
        self._current = (step, time.monotonic(), limit)
        self._wake.set()

    def step_finished(self, step: int) -> None:
        self._current, self._last_done, self._first = None, step, False
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        """Beat at every step start and end (so a rank frozen mid-step is seen in that step, not in one a poll
        behind, as with steps shorter than the poll) and at least every poll; fire on a missed deadline."""
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._beat()
            current = self._current
            if current is not None and time.monotonic() - current[1] > current[2]:
                self._fire(*current)

    def _beat(self) -> None:
        if self.store is None:
            return
        current = self._current
        beat = {"step": None if current is None else current[0], "done": self._last_done, "time": time.time()}
        try:
            self.store.set(f"rank_{self.rank}", json.dumps(beat))
        except Exception:  # the store's host may be the rank that stalled: keep watching
            pass

    def _fire(self, step: int, start: float, limit: float) -> None:
        elapsed = time.monotonic() - start
        first = f" x{FIRST_STEP_FACTOR} for the first step of a launch" if limit != self.timeout_s else ""
        line = (
            f"[rank {self.rank}] step {step} has not finished after {elapsed:.1f} s (training.step_timeout_s = "
            f"{self.timeout_s:g}{first}; last completed step {self._last_done}){self._silent_ranks()}; "
            f"exiting with {EXIT_STALLED}"
        )
        os.write(2, (line + "\n").encode())
        os._exit(EXIT_STALLED)

    def _silent_ranks(self) -> str:
        """'; no heartbeat from rank 1 for 19 s (in step 7, last completed step 6)' for the silent ranks."""
        if self.store is None:
            return ""
        silent = []  # type: ignore[var-annotated]
        for rank in range(self.world_size):
            if rank == self.rank or len(silent) >= _SHOWN_RANKS:
                continue
            try:
                beat = json.loads(self.store.get(f"rank_{rank}")) if self.store.check([f"rank_{rank}"]) else None
            except Exception:
                return "; the heartbeat store is unreachable (its host may be the rank that stalled)"
            if beat is None:
                silent.append(f"rank {rank} (never)")
            elif (age := time.time() - beat["time"]) > 3 * self.poll_s + 1:
                where = f"in step {beat['step']}, " if beat["step"] is not None else ""
                silent.append(f"rank {rank} for {age:.0f} s ({where}last completed step {beat['done']})")
        if not silent:
            return "; every other rank still sends heartbeats"
        return "; no heartbeat from " + ", ".join(silent)
