"""Helpers of the HF export tests: loading an export with transformers, input batches, and the prelude that
hides titan_recur from a process (the export must run without it)."""

from __future__ import annotations

from pathlib import Path

import torch

EXPORT_MEAN = 3  # the mean recurrence of the tiny exports (tests/conftest.py's tiny_hf_export)


def load(folder: Path, **kwargs):
    """An export as transformers users load it (its shipped modeling code)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)


def batch(seed: int = 0, shape: tuple[int, int] = (2, 12)) -> torch.Tensor:
    """Random token ids above the special ones (0-2) of the tiny vocabulary of 512."""
    return torch.randint(3, 512, shape, generator=torch.Generator().manual_seed(seed))


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of three rows with 0, 4 and 7 pad positions on the left."""
    torch.manual_seed(0)
    ids = torch.randint(3, 512, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


BLOCK_TITAN_RECUR = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "titan_recur" or name.startswith("titan_recur."):
            raise ImportError("titan_recur is blocked in this process")
sys.meta_path.insert(0, Blocker())
"""
