"""What to generate and at which depth: the options of the generation engine (inference/engine.py), checked
once, read by the engine, the fast path's programs, the command line, lm-eval and HF generate."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import torch

from titan_recur.inference.exit_criteria import DEFAULT_EXIT_THRESHOLDS, EXIT_CRITERIA
from titan_recur.models.args import STATE_INITS, WARM_START, ModelArgs
from titan_recur.models.cache import core_slots_per_block


@dataclass
class GenerationOptions:
    """What to generate and at which depth; ``resolve`` fills the defaults and checks every knob.

    num_steps: r, the core iterations per token (max_steps when exiting early); None = the model's
    mean_recurrence. kv_sharing: "full" | "latest" | "compress-N" (models/cache.py).
    exit_criterion: None (always r) or one of EXIT_CRITERIA; exit_threshold (None = Huginn's default),
    min_steps, check_every: a token may stop after iteration i when i >= min_steps, (i - min_steps) is
    a multiple of check_every, and its criterion, compared with the previous check, is below the
    threshold ("argmax": unchanged for >= threshold checks). The prompt always runs r iterations.
    state_init: a STATE_INITS name, or "previous" (decoded tokens start from the previous token's
    final state; the prompt from the deterministic eval init); None = the eval init.
    temperature 0 is greedy; otherwise sampling with top_k (0: off), then top_p, as transformers' warpers
    (inference/sampling.py), drawing from ``generator`` (None: torch's
    global RNG, so ``torch.manual_seed`` governs it, as in transformers), or from a generator seeded
    with ``seed`` where one is given (give at most one of the two).
    draft_steps, lookahead: speculative decoding over depth (docs/generation.md): each round drafts
    ``lookahead`` tokens at ``draft_steps`` iterations, verifies them at num_steps in one forward over
    the block, and keeps the longest prefix the target agrees with (greedy: the same tokens as plain
    decoding at num_steps; sampling: the same distribution). None = plain decoding.
    compile: decode on the fast path (inference/decode_program.py): each token a static-shape program
    compiled once per batch bucket and cache capacity, replayed as one CUDA graph per token on a GPU;
    None = on a GPU yes, on a CPU no (its first compile takes a minute there); speculative decoding's
    drafts and verifies run on it too. iterations_per_call: core iterations per compiled piece (None: 1 on
    a GPU, 8 on a CPU; see ``default_iterations_per_call``).
    """

    max_new_tokens: int = 32
    num_steps: int | None = None
    kv_sharing: str = "full"
    exit_criterion: str | None = None
    exit_threshold: float | None = None
    min_steps: int = 1
    check_every: int = 1
    state_init: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    generator: torch.Generator | None = None
    eos_id: int | None = None
    compile: bool | None = None
    iterations_per_call: int | None = None
    draft_steps: int | None = None
    lookahead: int = 4

    @classmethod
    def from_values(cls, values: Mapping[str, Any], **given: Any) -> GenerationOptions:
        """The options among ``values`` (a command's parsed flags: other keys are ignored) and ``given`` (each
        an option: a TypeError for any other name); a None value (a flag not given) leaves the option at its
        default."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"GenerationOptions has no option {', '.join(map(repr, unknown))}")
        return cls(**{k: v for k, v in {**values, **given}.items() if k in names and v is not None})

    def resolve(self, args: ModelArgs) -> ResolvedOptions:
        """The options with the model's defaults filled in (``ResolvedOptions``); a one-line ValueError for any
        bad knob."""
        num_steps = args.mean_recurrence if self.num_steps is None else self.num_steps
        threshold = self.exit_threshold
        if self.exit_criterion is not None and threshold is None:
            threshold = DEFAULT_EXIT_THRESHOLDS.get(self.exit_criterion)
        filled = dataclasses.replace(
            self, num_steps=num_steps, exit_threshold=threshold, state_init=self.state_init or args.eval_state_init
        )
        filled._check(args)
        exit_rule = None
        if self.exit_criterion is not None:
            exit_rule = ExitRule(self.exit_criterion, cast(float, threshold), self.min_steps, self.check_every)
        values = {f.name: getattr(filled, f.name) for f in dataclasses.fields(ResolvedOptions) if f.name != "exit"}
        return ResolvedOptions(**values, exit=exit_rule)

    def _check(self, args: ModelArgs) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_int(self.num_steps) or self.num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1, got {self.num_steps!r}")
        core_slots_per_block(self.kv_sharing, self.num_steps)
        if self.exit_criterion is not None and self.exit_criterion not in EXIT_CRITERIA:
            raise ValueError(f"exit_criterion must be one of {', '.join(EXIT_CRITERIA)}, got {self.exit_criterion!r}")
        if self.exit_criterion is None and self.exit_threshold is not None:
            raise ValueError("exit_threshold needs an exit_criterion")
        if self.exit_threshold is not None and not self.exit_threshold > 0:
            raise ValueError(f"exit_threshold must be > 0, got {self.exit_threshold!r}")
        if self.exit_criterion is not None and not args.is_recurrent:
            raise ValueError("exit_criterion needs a recurrent model; a static model has no iterations to exit from")
        if not _is_int(self.min_steps) or not 1 <= self.min_steps <= self.num_steps:
            raise ValueError(
                f"min_steps must be an integer in [1, max_steps = num_steps = {self.num_steps}], got {self.min_steps!r}"
            )
        if not _is_int(self.check_every) or self.check_every < 1:
            raise ValueError(f"check_every must be an integer >= 1, got {self.check_every!r}")
        if self.iterations_per_call is not None and (
            not _is_int(self.iterations_per_call) or self.iterations_per_call < 1
        ):
            raise ValueError(f"iterations_per_call must be an integer >= 1, got {self.iterations_per_call!r}")
        if self.state_init not in (*STATE_INITS, WARM_START):
            raise ValueError(
                f"state_init must be one of {', '.join((*STATE_INITS, WARM_START))}, got {self.state_init!r}"
            )
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and self.generator is not None:
            raise ValueError("give seed or generator, not both")
        if not _is_int(self.lookahead) or self.lookahead < 1:
            raise ValueError(f"lookahead must be an integer >= 1, got {self.lookahead!r}")
        if self.draft_steps is not None:
            self._check_speculative(args)

    def _check_speculative(self, args: ModelArgs) -> None:
        """Speculative decoding: a draft shallower than the target, where a block verify is exact."""
        num_steps = cast(int, self.num_steps)  # _check checked it before calling
        if not _is_int(self.draft_steps) or not 1 <= self.draft_steps < num_steps:
            raise ValueError(
                f"draft_steps must be an integer in [1, num_steps - 1 = {num_steps - 1}] (a draft shallower "
                f"than the target), got {self.draft_steps!r}"
            )
        if not args.is_recurrent:
            raise ValueError("draft_steps needs a recurrent model; a static model has one depth")
        if core_slots_per_block(self.kv_sharing, num_steps) < num_steps:
            raise ValueError(
                f"draft_steps needs kv_sharing 'full' (or compress-N with N >= num_steps), got {self.kv_sharing!r}: "
                "with shared slots a verified block sees other iterations' K/V than token-by-token decoding"
            )
        if self.exit_criterion is not None:
            raise ValueError("draft_steps does not combine with exit_criterion: the target verifies at a fixed depth")
        if self.state_init == WARM_START:
            raise ValueError(
                "draft_steps does not combine with state_init='previous': a warm start chains "
                "positions, which a block verify computes together"
            )


@dataclass(frozen=True)
class ExitRule:
    """Adaptive exit, resolved: the criterion, its threshold, and where the checks fall."""

    criterion: str
    threshold: float
    min_steps: int
    check_every: int

    def is_check(self, iteration: int) -> bool:
        """Whether a token may exit after ``iteration`` (1-based) core iterations."""
        return iteration >= self.min_steps and (iteration - self.min_steps) % self.check_every == 0

    def next_check(self, done: int, num_steps: int) -> int:
        """The iteration count after ``done`` at which the next exit check falls, or num_steps if none does."""
        return next((i for i in range(done + 1, num_steps) if self.is_check(i)), num_steps)


@dataclass(frozen=True)
class ResolvedOptions:
    """``GenerationOptions`` after ``resolve``: the depth, the initial state and, with an exit criterion, its
    threshold are filled in (``exit``: None = every token runs num_steps); what decoding reads."""

    max_new_tokens: int
    num_steps: int
    kv_sharing: str
    exit: ExitRule | None
    state_init: str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    generator: torch.Generator | None
    eos_id: int | None
    compile: bool | None
    iterations_per_call: int | None
    draft_steps: int | None
    lookahead: int

    def resolve(self, args: ModelArgs) -> ResolvedOptions:
        """Already resolved (``generate`` takes either kind)."""
        return self

    def settings(self) -> dict[str, Any]:
        """The options under GenerationOptions' names, in its order (a report's settings)."""
        rule = self.exit or ExitRule(None, None, 1, 1)  # type: ignore[arg-type]  # no criterion: no threshold
        exit_fields = {
            "exit_criterion": rule.criterion,
            "exit_threshold": rule.threshold,
            "min_steps": rule.min_steps,
            "check_every": rule.check_every,
        }
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "exit"} | exit_fields
        return {f.name: flat[f.name] for f in dataclasses.fields(GenerationOptions)}

    def compiled_on(self, device: torch.device) -> bool:
        """Whether decoding compiles its step: ``compile``, or by default on a GPU only (a CPU's first compile
        takes a minute)."""
        return self.compile if self.compile is not None else torch.device(device).type == "cuda"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
