"""Helpers shared by the torchrun worker scripts in this folder."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def finish() -> None:
    """Destroy the process groups and exit now, skipping interpreter teardown.

    A rank sometimes died with SIGABRT ("terminate called without an active exception") after all
    its work was done: 4 of ~130 launches, all while the machine was heavily loaded. That is the
    known teardown race of a gloo worker thread that releases a collective's tensors, and so needs
    the GIL, while the interpreter finalises. Call this last, after the worker's files are closed.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
