"""How many core iterations each micro-step runs: the depth sampler and its curricula.

Sampler. Given the scheduled mean recurrence ``r`` and backprop depth ``d``, with
``t = max(r - d, 0)`` and ``s = min(d, r)`` (so ``t + s == r``)::

    tau ~ LogNormal(mu = ln(t + s) - sigma**2 / 2, sigma)    # E[tau] = r
    p   = Poisson(tau) + 1
    n   = max(p - s, 0)    # iterations under no_grad
    k   = min(p, s)        # iterations with grad (truncated backprop), 1 <= k <= d

Mean offset. ``E[p] = r + 1`` in the reference, because the ``+ 1`` sits on top of a
Poisson whose rate already averages ``r``. ``mean_offset=True`` (default) keeps that, for
fidelity to the paper's runs: the configured "mean recurrence" means what it meant there.
Nothing downstream relies on ``E[p] == r``; FLOP and token accounting use the (n, k)
actually sampled. ``mean_offset=False`` centres the lognormal on ``r - 1`` so that
``E[n + k] == r``; at ``r == 1`` that rate is 0 and ``p == 1`` deterministically.

Randomness. Every draw uses its own CPU ``torch.Generator`` seeded with
``(seed + step * STEP_STRIDE + micro_step) mod 2**64`` (see ``generator_seed``), never the
global RNG. Every rank therefore draws the same (n, k) without communication, data or
dropout RNG streams are not perturbed, and a resumed run replays exactly the depths of
the original (given the same torch version, whose samplers define the stream).

Curricula. The mean recurrence, and optionally the backprop depth, ramp up over the first
``warmup_fraction`` of training (``Curriculum``). Everything is a pure function of the
optimizer step, so checkpoints need no extra state. ``RecurrenceSchedule`` is the one place
that maps the trainer's update number to a curriculum position (see its docstring), so the
trainer's logs, tools/flops.py's FLOP replay and the sampler read the same values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from titan_recur.models.args import CURRICULUM_KINDS, DEFAULT_BACKPROP_DEPTH, DEFAULT_SEED, DEFAULT_SIGMA

if TYPE_CHECKING:
    from titan_recur.config import Recurrence

# Prime seed distance between optimizer steps; micro_step stays below it, so no two
# (step, micro_step) pairs of a run share a generator seed.
STEP_STRIDE = 1_000_003


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_sigma(sigma: float) -> None:
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"recurrence sigma must be finite and >= 0, got {sigma!r}")


def _lognormal_mean(mean: int, mean_offset: bool) -> int:
    """E[tau]: ``mean`` as in the reference, or ``mean - 1`` so that E[n + k] == mean."""
    _check_positive("mean recurrence", mean)
    return mean if mean_offset else mean - 1


def generator_seed(seed: int, step: int, micro_step: int) -> int:
    """Seed of the generator for one draw: distinct per (step, micro_step), same on every rank."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if not isinstance(micro_step, int) or not 0 <= micro_step < STEP_STRIDE:
        raise ValueError(f"micro_step must be an integer in [0, {STEP_STRIDE}), got {micro_step!r}")
    return (seed + step * STEP_STRIDE + micro_step) % 2**64


class RecurrenceSampler:
    """Draws (n no-grad, k grad) iterations per micro-step; see the module docstring."""

    def __init__(self, sigma: float = DEFAULT_SIGMA, seed: int = DEFAULT_SEED, mean_offset: bool = True) -> None:
        _check_sigma(sigma)
        self.sigma = sigma
        self.seed = seed
        self.mean_offset = mean_offset

    def sample(self, mean: int, backprop_depth: int, step: int, micro_step: int = 0) -> tuple[int, int]:
        """Return (n, k) for this micro-step; a pure function of the arguments and the sampler's settings."""
        _check_positive("backprop_depth", backprop_depth)
        total = self._draw_total(mean, step, micro_step)
        grad_window = min(backprop_depth, mean)
        return max(total - grad_window, 0), min(total, grad_window)

    def _draw_total(self, mean: int, step: int, micro_step: int) -> int:
        """p = Poisson(tau) + 1, tau lognormal with mean E[tau], from a private generator."""
        tau_mean = _lognormal_mean(mean, self.mean_offset)
        gen_seed = generator_seed(self.seed, step, micro_step)  # validates step even when no draw is needed
        if tau_mean == 0:
            return 1
        gen = torch.Generator().manual_seed(gen_seed)
        mu = math.log(tau_mean) - self.sigma**2 / 2
        z = torch.randn((), generator=gen, dtype=torch.float64)
        tau = torch.exp(mu + self.sigma * z)
        return int(torch.poisson(tau, generator=gen).item()) + 1


@dataclass(frozen=True)
class Curriculum:
    """An integer ramping from ``start`` to ``max_value`` over W = ceil(warmup_fraction * total_steps) positions.

    value(p) for p < W, x = p / W, and max_value for p >= W:
      "linear"      max(start, ceil(max_value * x))
      "1-sqrt"      max(start, ceil(max_value * (1 - sqrt(1 - x))))  (slow start, most positions near the top)
      "interpolate" ceil(start + (max_value - start) * x)            (the reference's backprop-depth ramp)
      "none"        max_value throughout.
    W is rounded up to whole steps, as the reference rounds its warmup (math.ceil(warmup * max_steps)).

    Evaluated in exact rational arithmetic, with warmup_fraction read as the decimal it prints
    as: in floats, 10 * (1 - sqrt(1 - 255 / 500)) is 3.0000000000000004 and ceil would give 4.
    """

    kind: str
    max_value: int
    total_steps: int
    warmup_fraction: float
    start: int = 1

    def __post_init__(self) -> None:
        if self.kind not in CURRICULUM_KINDS:
            raise ValueError(f"curriculum kind must be one of {CURRICULUM_KINDS}, got {self.kind!r}")
        _check_positive("curriculum start", self.start)
        _check_positive("curriculum max_value", self.max_value)
        if self.max_value < self.start:
            raise ValueError(f"curriculum max_value ({self.max_value}) must be >= start ({self.start})")
        _check_positive("curriculum total_steps", self.total_steps)
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ValueError(f"curriculum warmup_fraction must be in [0, 1], got {self.warmup_fraction!r}")

    @functools.cached_property
    def warmup_steps(self) -> int:
        """W: the first position at max_value."""
        return math.ceil(Fraction(str(self.warmup_fraction)) * self.total_steps)

    def value(self, step: int) -> int:
        """The scheduled value at curriculum position ``step`` (0-based)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        warmup = self.warmup_steps
        if self.kind == "none" or step >= warmup:
            return self.max_value
        x = Fraction(step, warmup)
        top = self.max_value
        if self.kind == "interpolate":
            return math.ceil(self.start + (top - self.start) * x)
        if self.kind == "linear":
            ramp = math.ceil(top * x)
        else:
            # ceil(top - top * sqrt(1 - x)) = top - floor(sqrt(top^2 (1 - x))); floor(sqrt(q)) = isqrt(floor(q)).
            ramp = top - math.isqrt(math.floor(top * top * (1 - x)))
        return max(self.start, ramp)


class RecurrenceSchedule:
    """Mean-recurrence curriculum + backprop depth (fixed or curriculum) + sampler.

    Stateless: every answer is a function of (step, micro_step), so checkpoint/resume only
    needs the optimizer step to replay the same depths.

    ``step`` is the trainer's 1-based update number u (it also seeds the sampler). The curriculum
    positions it reads are the reference's (its train.py), fixed here and nowhere else:
    - the mean at position u - 1: the reference reads its mean scheduler before stepping it, so
      update u uses the value after u - 1 scheduler steps (update 1 runs the start value);
    - the backprop depth at position u: the reference steps its depth scheduler once before
      training ("so we get 2 out of the scheduler and not 1"), so update u reads u / W of the ramp.
    """

    def __init__(
        self,
        mean: Curriculum,
        backprop_depth: int | Curriculum = DEFAULT_BACKPROP_DEPTH,
        sampler: RecurrenceSampler | None = None,
    ) -> None:
        if isinstance(backprop_depth, int):
            _check_positive("backprop_depth", backprop_depth)
        self._mean = mean
        self._depth = backprop_depth
        self.sampler = sampler if sampler is not None else RecurrenceSampler()

    @classmethod
    def from_config(cls, cfg: Recurrence, total_steps: int) -> RecurrenceSchedule:
        """The schedule of a ``[recurrence]`` config section over a run of ``total_steps`` updates."""
        mean = Curriculum(cfg.curriculum, cfg.mean_recurrence, total_steps, cfg.warmup_fraction, start=cfg.start)
        depth: int | Curriculum = cfg.backprop_depth
        if cfg.backprop_curriculum:
            depth = Curriculum(
                cfg.backprop_curriculum_kind,
                cfg.backprop_depth,
                total_steps,
                cfg.backprop_warmup_fraction,
                start=cfg.backprop_start,
            )
        sampler = RecurrenceSampler(sigma=cfg.sigma, seed=cfg.seed, mean_offset=cfg.mean_offset)
        return cls(mean, depth, sampler)

    def mean(self, step: int) -> int:
        """Scheduled mean recurrence of update ``step`` (1-based)."""
        return self._mean.value(_update_index(step) - 1)

    def backprop_depth(self, step: int) -> int:
        """Backprop depth of update ``step`` (1-based)."""
        u = _update_index(step)
        return self._depth.value(u) if isinstance(self._depth, Curriculum) else self._depth

    def sample(self, step: int, micro_step: int = 0) -> tuple[int, int]:
        """(n, k) for one micro-step of update ``step`` (1-based)."""
        return self.sampler.sample(self.mean(step), self.backprop_depth(step), step, micro_step)


def _update_index(step: int) -> int:
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"update number (step) must be an integer >= 1, got {step!r}")
    return step
