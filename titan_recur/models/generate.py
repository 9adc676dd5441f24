"""Greedy decoding with a KV cache, correct for left-padded batches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_recur.models.blocks import KVCache
from titan_recur.models.model import NumSteps, RecurrentLM


@torch.no_grad()
def greedy_generate(
    model: RecurrentLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    num_steps: NumSteps = None,
    eos_id: int | None = None,
    state_init: str = "zero",
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Append up to max_new_tokens greedy tokens to each (left-padded) row; returns only the new tokens.

    The state defaults to zero so that generation is deterministic and a row's tokens do not depend
    on what else is in the batch; finished rows keep emitting ``eos_id``. ``stop(new_tokens)`` -> (B,)
    bool marks more rows finished (e.g. a stop string was generated); decoding ends once all rows are.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = KVCache()
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    step_input, new_tokens = input_ids, []
    for _ in range(max_new_tokens):
        logits = model(
            step_input, num_steps, attention_mask=attention_mask, cache=cache, state_init=state_init
        )
        next_token = logits[:, -1].argmax(dim=-1)
        if eos_id is not None:
            next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
            finished |= next_token == eos_id
        new_tokens.append(next_token)
        if stop is not None:
            finished |= stop(torch.stack(new_tokens, dim=1))
        if (eos_id is not None or stop is not None) and bool(finished.all()):
            break
        step_input = next_token[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(step_input)], dim=1)
    return torch.stack(new_tokens, dim=1)
