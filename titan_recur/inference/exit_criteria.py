"""Adaptive depth's exit criteria (docs/generation.md, "Adaptive exit"): whether a row may stop iterating.

One implementation for the eager engine and the static decode program: the criterion's memory of the
previous check lives in buffers updated in place, which a compiled or captured step can read.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

EXIT_CRITERIA = ("kl", "latent-diff", "entropy-diff", "argmax")
# Huginn's defaults (KL and entropy change in nats, relative latent change, argmax stable for 5 checks).
DEFAULT_EXIT_THRESHOLDS = {"kl": 1e-3, "latent-diff": 0.03, "entropy-diff": 1e-3, "argmax": 5.0}


def describe_criteria(separator: str = ", ", quote: str = "") -> str:
    """The criteria's names for help texts and docs, e.g. 'kl, latent-diff, entropy-diff, argmax'."""
    return separator.join(f"{quote}{name}{quote}" for name in EXIT_CRITERIA)


def describe_default_thresholds() -> str:
    """'kl 0.001, latent-diff 0.03, ...': Huginn's thresholds, the defaults."""
    return ", ".join(f"{name} {threshold:g}" for name, threshold in DEFAULT_EXIT_THRESHOLDS.items())


class ExitCriterion:
    """Per-row exit test of adaptive depth: each check compares with the previous check (Huginn's rules).

    kl: KL(p_prev || p_i) of the next-token distributions (p_prev uniform before the first check);
    latent-diff: ||s_i - s_prev|| / ||s_i|| (s_prev = the initial state before the first check);
    entropy-diff: |H(p_i) - H(p_prev)| (no exit at the first check); argmax: number of consecutive
    checks at which the argmax did not change. A row exits when its value is below the threshold
    (argmax: reaches it). All but latent-diff need the logits of the check: one coda + head call.
    """

    def __init__(self, name: str, threshold: float, initial_state: torch.Tensor, vocab_size: int) -> None:
        self.name, self.threshold = name, threshold
        self.needs_logits = name != "latent-diff"
        bsz, device = initial_state.shape[0], initial_state.device
        # What the next check compares with; updated in place, so a static decode program (whose graph
        # reads fixed buffers) and the eager engine run the same code.
        if name == "latent-diff":
            self.previous = initial_state[:, -1].float().clone()
        elif name == "kl":
            self.previous = torch.empty(bsz, vocab_size, device=device)
        elif name == "entropy-diff":
            self.previous = torch.empty(bsz, device=device)
        else:
            self.previous = torch.empty(bsz, dtype=torch.long, device=device)
            self.stable = torch.empty(bsz, dtype=torch.long, device=device)
        self.reset(initial_state)

    def reset(self, initial_state: torch.Tensor) -> None:
        """Back to the state before a token's first check (``initial_state``: the core's initial state)."""
        if self.name == "latent-diff":
            self.previous.copy_(initial_state[:, -1])
        elif self.name == "kl":
            self.previous.fill_(-math.log(self.previous.shape[-1]))
        elif self.name == "entropy-diff":
            self.previous.fill_(math.inf)
        else:
            self.previous.fill_(-1)
            self.stable.zero_()

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """(B,) bool: rows whose criterion is met at this check."""
        if self.name == "latent-diff":
            latent = state[:, -1].float()
            value = (latent - self.previous).norm(dim=-1) / latent.norm(dim=-1)
            self.previous.copy_(latent)
            return value < self.threshold
        logits = cast(torch.Tensor, logits)  # every criterion but latent-diff is given the check's logits
        if self.name == "argmax":
            argmax = logits.argmax(dim=-1)
            self.stable.copy_(torch.where(argmax == self.previous, self.stable + 1, torch.zeros_like(self.stable)))
            self.previous.copy_(argmax)
            return self.stable >= self.threshold
        log_probs = F.log_softmax(logits.float(), dim=-1)
        if self.name == "kl":
            value = (self.previous.exp() * (self.previous - log_probs)).sum(dim=-1)
            self.previous.copy_(log_probs)
        else:
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
            value = (entropy - self.previous).abs()
            self.previous.copy_(entropy)
        return value < self.threshold
