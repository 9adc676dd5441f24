"""In-loop validation: held-out loss at each configured test recurrence, summed over ranks."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from titan_recur.config import JobConfig
from titan_recur.data import build_dataloader
from titan_recur.eval.loss import mean_losses, validation_loss_sums
from titan_recur.tokenizer import Tokenizer


class Validator:
    """Owns the validation split's loader; every rank calls :meth:`run` together.

    Each validation reads the split from its start (the same documents every time, so the curve
    over training compares like with like), on this run's seq_len and local batch size.
    """

    def __init__(
        self, cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_world: int, device: torch.device
    ) -> None:
        self.cfg = cfg.validation
        t = cfg.training
        self._loader_args = dict(
            cfg_data=cfg.data, tokenizer=tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            rows_per_step=t.local_batch_size, dp_rank=dp_rank, dp_world=dp_world, seed=cfg.job.seed,
            split="validation",
        )
        self.device = device
        self.loss_chunk_tokens = t.loss_chunk_tokens

    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[int, float]:
        """{r: token-weighted mean loss} over ``validation.steps`` batches of every rank."""
        with torch.random.fork_rng(devices=[]):  # the loader's seed draw must not shift the training RNG
            batches = itertools.islice(iter(build_dataloader(**self._loader_args)), self.cfg.steps)
            sums = validation_loss_sums(
                model, batches, self.cfg.recurrences, self.device, loss_chunk_tokens=self.loss_chunk_tokens
            )
        totals = torch.tensor([[total, count] for total, count in sums.values()], dtype=torch.float64)
        if dist.is_initialized():
            totals = totals.to(self.device)
            dist.all_reduce(totals)
        return mean_losses({r: (float(row[0]), int(row[1])) for r, row in zip(sums, totals.tolist())})
