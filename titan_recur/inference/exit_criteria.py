"""Adaptive depth's exit criteria (docs/generation.md, "Adaptive exit"): whether a row may stop iterating.

One class per criterion, each carrying its name, Huginn's default threshold, whether it needs the
check's logits, its buffers and its rule; ``EXIT_CRITERION_CLASSES`` lists them, and the names,
defaults and help texts are derived from it. One implementation for the eager engine and the static
decode program: the criterion's memory of the previous check lives in buffers updated in place, which
a compiled or captured step can read.
"""

from __future__ import annotations

import math
from typing import ClassVar, cast

import torch
import torch.nn.functional as F


class ExitCriterion:
    """Per-row exit test of adaptive depth: each check compares with the previous check (Huginn's rules).

    A row exits when the check's value is below the threshold (argmax: reaches it). A subclass is one
    criterion: ``allocate`` makes its buffers (what the next check compares with), ``reset`` puts them
    back to the state before a token's first check, ``exits`` runs one check. Buffers are updated in
    place only, so a static decode program (whose graph reads fixed buffers) and the eager engine run
    the same code. Build one with ``ExitCriterion.create(name, ...)``.
    """

    name: ClassVar[str]
    default_threshold: ClassVar[float]  # Huginn's
    needs_logits: ClassVar[bool] = True  # the check's logits: one coda + head call per check

    def __init__(self, threshold: float, initial_state: torch.Tensor, vocab_size: int) -> None:
        self.threshold = threshold
        self.allocate(initial_state, vocab_size)
        self.reset(initial_state)

    @staticmethod
    def create(name: str, threshold: float, initial_state: torch.Tensor, vocab_size: int) -> ExitCriterion:
        """The criterion ``name`` (one of EXIT_CRITERIA) for a batch whose core starts at ``initial_state``."""
        return EXIT_CRITERION_CLASSES[name](threshold, initial_state, vocab_size)

    def allocate(self, initial_state: torch.Tensor, vocab_size: int) -> None:
        """The buffers, one row per batch row (their values are set by ``reset``)."""
        raise NotImplementedError

    def reset(self, initial_state: torch.Tensor) -> None:
        """Back to the state before a token's first check (``initial_state``: the core's initial state)."""
        raise NotImplementedError

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """(B,) bool: rows whose criterion is met at this check (``logits``: (B, V) where needs_logits)."""
        raise NotImplementedError


class KLCriterion(ExitCriterion):
    """KL(p_prev || p_i) of the next-token distributions, in nats (p_prev uniform before the first check)."""

    name = "kl"
    default_threshold = 1e-3

    def allocate(self, initial_state: torch.Tensor, vocab_size: int) -> None:
        self.previous = torch.empty(initial_state.shape[0], vocab_size, device=initial_state.device)

    def reset(self, initial_state: torch.Tensor) -> None:
        self.previous.fill_(-math.log(self.previous.shape[-1]))

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        log_probs = F.log_softmax(cast(torch.Tensor, logits).float(), dim=-1)
        value = (self.previous.exp() * (self.previous - log_probs)).sum(dim=-1)
        self.previous.copy_(log_probs)
        return value < self.threshold


class LatentDiffCriterion(ExitCriterion):
    """||s_i - s_prev|| / ||s_i|| of the last position's state (s_prev = the initial state before the
    first check); needs no logits."""

    name = "latent-diff"
    default_threshold = 0.03
    needs_logits = False

    def allocate(self, initial_state: torch.Tensor, vocab_size: int) -> None:
        self.previous = initial_state[:, -1].float().clone()

    def reset(self, initial_state: torch.Tensor) -> None:
        self.previous.copy_(initial_state[:, -1])

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        latent = state[:, -1].float()
        value = (latent - self.previous).norm(dim=-1) / latent.norm(dim=-1)
        self.previous.copy_(latent)
        return value < self.threshold


class EntropyDiffCriterion(ExitCriterion):
    """|H(p_i) - H(p_prev)| of the next-token distributions, in nats (no exit at the first check)."""

    name = "entropy-diff"
    default_threshold = 1e-3

    def allocate(self, initial_state: torch.Tensor, vocab_size: int) -> None:
        self.previous = torch.empty(initial_state.shape[0], device=initial_state.device)

    def reset(self, initial_state: torch.Tensor) -> None:
        self.previous.fill_(math.inf)

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        log_probs = F.log_softmax(cast(torch.Tensor, logits).float(), dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
        value = (entropy - self.previous).abs()
        self.previous.copy_(entropy)
        return value < self.threshold


class ArgmaxCriterion(ExitCriterion):
    """The number of consecutive checks at which the argmax did not change; a row exits when it reaches
    the threshold."""

    name = "argmax"
    default_threshold = 5.0

    def allocate(self, initial_state: torch.Tensor, vocab_size: int) -> None:
        bsz, device = initial_state.shape[0], initial_state.device
        self.previous = torch.empty(bsz, dtype=torch.long, device=device)
        self.stable = torch.empty(bsz, dtype=torch.long, device=device)

    def reset(self, initial_state: torch.Tensor) -> None:
        self.previous.fill_(-1)
        self.stable.zero_()

    def exits(self, state: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        argmax = cast(torch.Tensor, logits).argmax(dim=-1)
        self.stable.copy_(torch.where(argmax == self.previous, self.stable + 1, torch.zeros_like(self.stable)))
        self.previous.copy_(argmax)
        return self.stable >= self.threshold


# The one list of criteria: name -> class, in the order help texts and docs give them.
EXIT_CRITERION_CLASSES: dict[str, type[ExitCriterion]] = {
    criterion.name: criterion for criterion in (KLCriterion, LatentDiffCriterion, EntropyDiffCriterion, ArgmaxCriterion)
}
EXIT_CRITERIA = tuple(EXIT_CRITERION_CLASSES)
# Huginn's defaults (KL and entropy change in nats, relative latent change, argmax stable for 5 checks).
DEFAULT_EXIT_THRESHOLDS = {name: criterion.default_threshold for name, criterion in EXIT_CRITERION_CLASSES.items()}


def describe_criteria(separator: str = ", ", quote: str = "") -> str:
    """The criteria's names for help texts and docs, e.g. 'kl, latent-diff, entropy-diff, argmax'."""
    return separator.join(f"{quote}{name}{quote}" for name in EXIT_CRITERIA)


def describe_default_thresholds() -> str:
    """'kl 0.001, latent-diff 0.03, ...': Huginn's thresholds, the defaults."""
    return ", ".join(f"{name} {threshold:g}" for name, threshold in DEFAULT_EXIT_THRESHOLDS.items())
