"""Memory of one benchmark point, measured in a fresh child process: the benchmarks' one way to do it.

CUDA: ``torch.cuda`` allocated bytes. CPU: resident memory, with glibc's mmap threshold fixed at
64 KiB in the child so that tensors get their own mappings, returned to the OS when freed, and peak
RSS tracks peak live memory instead of the heap's high-water mark.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def current_bytes(device: str) -> int:
    """Memory held now (before a step: model, optimizer, inputs); the step's own use is measured above it."""
    import torch

    if device == "cuda":
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_bytes(device: str) -> int:
    """The process's peak so far: max allocated on CUDA, max RSS on CPU."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(script: str, argv: list[str]) -> object:
    """Run ``script argv`` in a fresh interpreter with the fixed mmap threshold; its last stdout line as JSON."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, script, *argv], check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])
