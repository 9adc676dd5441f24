"""Held-out loss at several test recurrences: the trainer's in-loop validation and the offline sweep.

Evaluation is deterministic: the recurrent state starts from ``ModelArgs.eval_state_init`` (zeros,
or the embedding for 'embed' models), not from the training-time random draw, so a row's loss
depends neither on the RNG nor on the rest of its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from titan_recur.config import JobConfig
from titan_recur.data.loader import LoaderGeometry, build_dataloader
from titan_recur.data.tokenizer import Tokenizer
from titan_recur.models.loss import count_labels
from titan_recur.models.model import RecurrentLM
from titan_recur.utils.limits import check_recurrences


@torch.no_grad()
def validation_loss_sums(
    model: RecurrentLM,
    batches: Iterable[dict[str, torch.Tensor]],
    recurrences: Sequence[int],
    device: torch.device | str,
    state_init: str | None = None,
    loss_chunk_tokens: int = 1024,
) -> dict[int, tuple[float, int]]:
    """Per-rank {r: (summed next-token CE, number of labelled tokens)} over ``batches``, read once.

    The loss is chunked over tokens (no full logits held; without grad that costs nothing extra).

    ``batches`` yield {"input_ids", "labels"} (labels already shifted, -100 ignored) and, under document
    masking, "document_ids", as the data loader does. Works on a plain or FSDP-sharded model (every rank must call it: it only calls
    ``model(...)``); all-reduce the sums and counts across ranks, then ``mean_losses``.
    """
    recurrences = check_recurrences(recurrences)
    state_init = state_init or str(model.args.eval_state_init)
    sums = {r: torch.zeros((), dtype=torch.float64, device=device) for r in recurrences}
    tokens = 0
    for batch in batches:
        tokens += int(count_labels(batch["labels"]))
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        documents = batch_document_ids(batch, device)
        for r in recurrences:
            loss = model(
                input_ids,
                r,
                state_init=state_init,
                labels=labels,
                loss_chunk_tokens=loss_chunk_tokens,
                document_ids=documents,
            )
            sums[r] += loss.double()
    return {r: (float(total), tokens) for r, total in sums.items()}


def batch_document_ids(batch: dict[str, torch.Tensor], device: torch.device | str) -> torch.Tensor | None:
    """A batch's document ids on ``device``; None where the loader gave none (causal attention)."""
    documents = batch.get("document_ids")
    return None if documents is None else documents.to(device, non_blocking=True)


def mean_losses(sums: dict[int, tuple[float, int]]) -> dict[int, float]:
    """Token-weighted mean loss per recurrence from (sum, count) pairs (after any all-reduce)."""
    if any(count <= 0 for _, count in sums.values()):
        raise ValueError("no labelled tokens in the validation batches")
    return {r: total / count for r, (total, count) in sums.items()}


class Validator:
    """Owns the validation split's loader; every rank calls :meth:`run` together.

    Each validation reads the split from its start (the same documents every time, so the curve
    over training compares like with like), on this run's seq_len and local batch size.
    """

    def __init__(self, cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_world: int, device: torch.device) -> None:
        self.cfg = cfg.validation
        t = cfg.training
        self.data, self.tokenizer = cfg.data, tokenizer
        self.geometry = LoaderGeometry.of_run(cfg, dp_rank, dp_world)
        self.device = device
        self.loss_chunk_tokens = t.loss_chunk_tokens
        self.attention_mask = t.attention_mask

    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    @torch.no_grad()
    def run(self, model: RecurrentLM) -> dict[int, float] | None:
        """{r: token-weighted mean loss} over ``validation.steps`` batches of every rank; None when they hold
        no labelled token (prompts only): the same at every validation, so not an error that stops training."""
        with torch.random.fork_rng(devices=[]):  # the loader's seed draw must not shift the training RNG
            batches = itertools.islice(
                iter(
                    build_dataloader(
                        self.data, self.tokenizer, self.geometry, split="validation", attention_mask=self.attention_mask
                    )
                ),
                self.cfg.steps,
            )
            sums = validation_loss_sums(
                model, batches, self.cfg.recurrences, self.device, loss_chunk_tokens=self.loss_chunk_tokens
            )
        totals = torch.tensor([[total, count] for total, count in sums.values()], dtype=torch.float64)
        if dist.is_initialized():
            totals = totals.to(self.device)
            dist.all_reduce(totals)
        reduced = {r: (float(row[0]), int(row[1])) for r, row in zip(sums, totals.tolist(), strict=True)}
        if any(count == 0 for _, count in reduced.values()):
            return None
        return mean_losses(reduced)
