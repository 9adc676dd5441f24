"""Bounds on what a command line may ask for, checked before any work (docs/cluster.md, "Bounds, overwrites, one run per folder, integrity").

One helper for every tool: a count must be >= 1, a sequence length fit the model's positions, a
recurrence stay below ``MAX_RECURRENCE``, and the memory a tool is about to allocate (a KV cache, a
batch's activations) fit what the device has free. Each check raises ``ValueError`` with one line
naming the flag, the value and the limit; the tools print it as ``error: ...`` and exit 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Core iterations per token a tool accepts. The paper tests r <= 32 (Huginn up to 64); 1024 leaves room for
# studies while a typo (1000000000) is refused instead of running until killed.
MAX_RECURRENCE = 1024
_GIB = 2**30


def check_at_least(value: int | None, flag: str, minimum: int = 1) -> None:
    """``value`` (None = not given) is an integer >= ``minimum``."""
    if value is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def check_seq_len(seq_len: int, max_seq_len: int, flag: str = "--seq-len") -> None:
    """A row fits the model's positions (its max_seq_len / max_position_embeddings), as training requires."""
    check_at_least(seq_len, flag)
    if seq_len > max_seq_len:
        raise ValueError(f"{flag} {seq_len} exceeds the model's max_seq_len {max_seq_len}")


def check_recurrences(recurrences: Sequence[int], flag: str = "--recurrences") -> list[int]:
    """The recurrences a command, the validation or the lm-eval model runs, as a list: at least one, each an
    integer in [1, MAX_RECURRENCE]."""
    if not recurrences:
        raise ValueError(f"{flag}: recurrences must be a non-empty list of integers")
    for r in recurrences:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_RECURRENCE:
            raise ValueError(
                f"{flag} {r!r} is outside [1, {MAX_RECURRENCE}]: recurrences must be integers in that range (core "
                "iterations per token)"
            )
    return list(recurrences)


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_allocation(nbytes: int, device: torch.device, what: str, hint: str = "", tolerance: float = 1.0) -> None:
    """Refuse to start when ``what`` needs more than ``tolerance`` x the memory ``device`` has free (a
    tolerance above 1 for estimates, so that a run near the limit is never refused by the estimate's error)."""
    free = available_memory(device)
    if nbytes > tolerance * free:
        advice = f"; {hint}" if hint else ""
        raise ValueError(f"{what} needs {nbytes / _GIB:,.1f} GiB but {device} has {free / _GIB:,.1f} GiB free{advice}")


def kv_cache_bytes(
    batch_size: int, capacity: int, attention_slots: int, n_kv_heads: int, head_dim: int, element_bytes: int
) -> int:
    """Keys and values of ``attention_slots`` slots for ``batch_size`` rows of ``capacity`` tokens."""
    return 2 * attention_slots * batch_size * capacity * n_kv_heads * head_dim * element_bytes


def forward_bytes(batch_size: int, seq_len: int, dim: int, ffn_dim: int, element_bytes: int) -> int:
    """A no-grad forward's live activations, roughly: residual stream, norms, q/k/v/o and the MLP's hidden."""
    return batch_size * seq_len * (6 * dim + 3 * ffn_dim) * element_bytes
