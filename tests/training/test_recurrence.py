"""Recurrence sampler and curricula: exact schedule values, determinism, moments, input checks."""

import itertools
import math
import re

import pytest
import torch

from titan_recur.config import Recurrence
from titan_recur.models.args import CURRICULUM_KINDS
from titan_recur.training.recurrence import (
    Curriculum,
    RecurrenceSampler,
    RecurrenceSchedule,
    generator_seed,
)

N_DRAWS = 20_000


def expected_total(mean: int, mean_offset: bool = True) -> float:
    """E[n + k] of the Poisson-lognormal (the lognormal is mean-corrected: sigma does not enter)."""
    return (mean if mean_offset else mean - 1) + 1.0


def variance_total(mean: int, sigma: float = 0.5, mean_offset: bool = True) -> float:
    """Var[n + k]: E[tau] + Var[tau], Var[tau] = (e^(sigma^2) - 1) E[tau]^2."""
    tau_mean = mean if mean_offset else mean - 1
    return tau_mean + math.expm1(sigma**2) * tau_mean**2


def _draw_many(sampler: RecurrenceSampler, mean: int, depth: int, count: int = N_DRAWS) -> list[tuple[int, int]]:
    """`count` draws, one per step (each step seeds a fresh generator)."""
    return [sampler.sample(mean, depth, step=step) for step in range(count)]


def _fourth_central_moment(mean: int, sigma: float, mean_offset: bool) -> float:
    """mu4 of p = Poisson(tau) + 1: Poisson factorial moments are E[tau^j], mixed via Stirling numbers."""
    tau_mean = mean if mean_offset else mean - 1
    mu = math.log(tau_mean) - sigma**2 / 2

    def tau_moment(j: int) -> float:
        return math.exp(j * mu + j * j * sigma**2 / 2)

    stirling2 = {1: (1,), 2: (1, 1), 3: (1, 3, 1), 4: (1, 7, 6, 1)}
    raw = {j: sum(c * tau_moment(i + 1) for i, c in enumerate(row)) for j, row in stirling2.items()}
    m = raw[1]
    return raw[4] - 4 * m * raw[3] + 6 * m**2 * raw[2] - 3 * m**4


# ---------------------------------------------------------------- curriculum


def test_one_minus_sqrt_curriculum_exact_values():
    c = Curriculum("1-sqrt", max_value=32, total_steps=50_000, warmup_fraction=0.75)
    expected = {
        0: 1,
        2307: 1,
        2308: 2,
        4541: 2,
        4542: 3,
        6701: 3,
        6702: 4,
        37_463: 31,
        37_464: 32,
        37_499: 32,
        37_500: 32,
        49_999: 32,
        50_000: 32,
        60_000: 32,
    }
    assert {step: c.value(step) for step in expected} == expected


def test_one_minus_sqrt_curriculum_is_monotone_and_ends_at_max():
    c = Curriculum("1-sqrt", max_value=32, total_steps=50_000, warmup_fraction=0.75)
    values = [c.value(step) for step in range(0, 37_600, 7)]
    assert all(a <= b for a, b in itertools.pairwise(values))
    assert values[0] == 1 and values[-1] == 32


def test_curriculum_exact_at_integer_boundaries():
    # 10 * (1 - sqrt(1 - 255/500)) is exactly 3; float arithmetic gives 3.0000000000000004 -> 4.
    c = Curriculum("1-sqrt", max_value=10, total_steps=1000, warmup_fraction=0.5)
    assert c.value(255) == 3
    assert c.value(256) == 4


def test_linear_curriculum_exact_values():
    # W = 500; value = max(2, ceil(10 * step / 500)).
    c = Curriculum("linear", max_value=10, total_steps=1000, warmup_fraction=0.5, start=2)
    expected = {0: 2, 50: 2, 100: 2, 101: 3, 450: 9, 451: 10, 499: 10, 500: 10, 999: 10}
    assert {step: c.value(step) for step in expected} == expected


def test_none_curriculum_and_zero_warmup_are_constant():
    for c in (
        Curriculum("none", max_value=16, total_steps=1000, warmup_fraction=0.5),
        Curriculum("linear", max_value=16, total_steps=1000, warmup_fraction=0.0),
    ):
        assert {c.value(step) for step in range(0, 2000, 13)} == {16}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind="cosine"), re.escape(f"one of {CURRICULUM_KINDS}")),
        (dict(max_value=0, start=1), "max_value must be an integer >= 1"),
        (dict(max_value=4, start=8), r"max_value \(4\) must be >= start \(8\)"),
        (dict(start=0), "start must be an integer >= 1"),
        (dict(warmup_fraction=1.5), r"warmup_fraction must be in \[0, 1\]"),
        (dict(warmup_fraction=-0.1), r"warmup_fraction must be in \[0, 1\]"),
        (dict(total_steps=0), "total_steps must be an integer >= 1"),
    ],
)
def test_curriculum_rejects_bad_config(kwargs, match):
    config = dict(kind="linear", max_value=32, total_steps=1000, warmup_fraction=0.5) | kwargs
    with pytest.raises(ValueError, match=match):
        Curriculum(**config)


def test_curriculum_rejects_negative_step():
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        Curriculum("linear", max_value=32, total_steps=1000, warmup_fraction=0.5).value(-1)


# ---------------------------------------------------------------- sampler determinism


def test_same_draws_on_fresh_samplers():
    """Two ranks (or a restarted run) build their own sampler and must agree draw for draw."""
    a, b = RecurrenceSampler(), RecurrenceSampler()
    keys = [(step, micro) for step in (0, 1, 17, 123_456) for micro in range(4)]
    draws_a = [a.sample(32, 8, step, micro) for step, micro in keys]
    assert draws_a == [b.sample(32, 8, step, micro) for step, micro in keys]


def test_draws_vary_with_step_micro_step_and_seed():
    sampler = RecurrenceSampler()
    assert len({sampler.sample(32, 8, step) for step in range(50)}) > 5
    assert len({sampler.sample(32, 8, 7, micro) for micro in range(50)}) > 5
    other = RecurrenceSampler(seed=1)
    assert [sampler.sample(32, 8, step) for step in range(50)] != [other.sample(32, 8, step) for step in range(50)]


def test_generator_seed_mixing():
    assert generator_seed(514229, 0, 0) == 514229
    assert generator_seed(514229, 2, 3) == 514229 + 2 * 1_000_003 + 3
    assert generator_seed(2**64 - 1, 0, 1) == 0
    with pytest.raises(ValueError, match="micro_step"):
        generator_seed(0, 0, 1_000_003)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        generator_seed(0, -1, 0)


def test_sampler_ignores_and_preserves_global_rng():
    sampler = RecurrenceSampler()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = [sampler.sample(32, 8, step) for step in range(20)]
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(12345)
    assert [sampler.sample(32, 8, step) for step in range(20)] == first


def test_mean_offset_false_at_mean_one_is_deterministic():
    sampler = RecurrenceSampler(mean_offset=False)
    assert {sampler.sample(1, 8, step) for step in range(200)} == {(0, 1)}
    assert expected_total(1, mean_offset=False) == 1.0
    assert variance_total(1, mean_offset=False) == 0.0


# ---------------------------------------------------------------- sampler distribution


# Standard errors at N = 20,000 (sigma = 0.5), from the exact moments (_fourth_central_moment):
#   mean:     sqrt(Var[p] / N) / E[p]         ~ 0.4% for every r here -> 2% is > 4.5 SE, safe.
#   variance: sqrt((mu4 - Var^2) / N) / Var   ~ 1.6% (r = 2) .. 1.9% (r = 32): the lognormal
#             tail is heavy (excess kurtosis ~ 5.9), so 2% is only ~1.1 SE and would fail ~25%
#             of the time in expectation at any r. The 20k-draw test checks it to 4 SE (< 8%);
#             test_total_variance_within_two_percent checks 2% with 320k draws (2% >= 4 SE).
@pytest.mark.parametrize(
    ("mean", "mean_offset"),
    [(4, True), (8, True), (32, True), (2, False), (8, False), (32, False)],
)
def test_total_mean_and_variance_match_theory(mean, mean_offset):
    depth = 8
    sampler = RecurrenceSampler(mean_offset=mean_offset)
    draws = _draw_many(sampler, mean, depth)

    grad_window = min(depth, mean)
    for n, k in draws:
        p = n + k
        assert k == min(p, grad_window) and n == max(p - grad_window, 0)
        assert 1 <= k <= depth

    totals = torch.tensor([n + k for n, k in draws], dtype=torch.float64)
    want_mean = expected_total(mean, mean_offset=mean_offset)
    want_var = variance_total(mean, mean_offset=mean_offset)
    assert totals.mean().item() == pytest.approx(want_mean, rel=0.02)

    var_se = math.sqrt((_fourth_central_moment(mean, 0.5, mean_offset) - want_var**2) / N_DRAWS)
    assert abs(totals.var().item() - want_var) < 4 * var_se
    assert 4 * var_se / want_var < 0.08


@pytest.mark.parametrize(("mean", "mean_offset"), [(32, True)])  # the paper configs' setting
def test_total_variance_within_two_percent(mean, mean_offset):
    draws = 320_000
    totals = torch.tensor(
        [n + k for n, k in _draw_many(RecurrenceSampler(mean_offset=mean_offset), mean, 8, draws)],
        dtype=torch.float64,
    )
    want_var = variance_total(mean, mean_offset=mean_offset)
    var_se = math.sqrt((_fourth_central_moment(mean, 0.5, mean_offset) - want_var**2) / draws)
    assert 4 * var_se / want_var <= 0.02
    assert totals.var().item() == pytest.approx(want_var, rel=0.02)


def test_mean_offset_shifts_expected_total_by_one():
    assert expected_total(8) == 9.0
    assert expected_total(8, mean_offset=False) == 8.0
    assert variance_total(8) == pytest.approx(8 + math.expm1(0.25) * 64)
    assert variance_total(8, mean_offset=False) == pytest.approx(7 + math.expm1(0.25) * 49)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("mean", "depth", "match"),
    [(0, 8, "mean recurrence must be an integer >= 1"), (4, 0, "backprop_depth must be an integer >= 1")],
)
def test_sampler_rejects_bad_depths(mean, depth, match):
    with pytest.raises(ValueError, match=match):
        RecurrenceSampler().sample(mean, depth, step=0)


def test_sampler_rejects_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        RecurrenceSampler(sigma=-0.1)


# ---------------------------------------------------------------- schedule


def test_schedule_combines_curricula_and_sampler():
    mean = Curriculum("1-sqrt", max_value=32, total_steps=50_000, warmup_fraction=0.75)
    depth = Curriculum("linear", max_value=8, total_steps=50_000, warmup_fraction=0.5, start=2)
    schedule = RecurrenceSchedule(mean, backprop_depth=depth)
    assert (schedule.mean(1), schedule.backprop_depth(1)) == (1, 2)
    assert (schedule.mean(40_000), schedule.backprop_depth(40_000)) == (32, 8)
    for step in (1, 5000, 40_000):
        n, k = schedule.sample(step, micro_step=3)
        assert (n, k) == RecurrenceSampler().sample(schedule.mean(step), schedule.backprop_depth(step), step, 3)
        assert 1 <= k <= schedule.backprop_depth(step)


def test_schedule_default_depth_is_fixed_eight():
    mean = Curriculum("none", max_value=16, total_steps=100, warmup_fraction=0.0)
    assert {RecurrenceSchedule(mean).backprop_depth(step) for step in range(1, 100)} == {8}
    with pytest.raises(ValueError, match="backprop_depth"):
        RecurrenceSchedule(mean, backprop_depth=0)


def test_schedule_counts_updates_from_one():
    schedule = RecurrenceSchedule(Curriculum("linear", max_value=4, total_steps=10, warmup_fraction=0.5))
    for method in (schedule.mean, schedule.backprop_depth, schedule.sample):
        with pytest.raises(ValueError, match="update number"):
            method(0)


# ---------------------------------------------------------------- the paper's schedules (its train.py)


def paper_schedule(**recurrence) -> RecurrenceSchedule:
    """The trainer's schedule for a [recurrence] section (defaults + overrides) of a 50k-step run."""
    steps = recurrence.pop("steps", 50_000)
    return RecurrenceSchedule.from_config(Recurrence(**recurrence), steps)


def test_mean_curriculum_reaches_2_3_4_at_the_references_updates():
    """1-sqrt, R = 32, W = 0.75 * 50,000 = 37,500. The reference reads its mean scheduler before stepping
    it, so update u (1-based) runs r = ceil(32 (1 - sqrt(1 - (u - 1) / W))). r >= m + 1 once
    (u - 1) / W > 1 - ((32 - m) / 32)^2: u - 1 > 37,500 * 63/1024 = 2,307.1, * 124/1024 = 4,541.0,
    * 183/1024 = 6,701.7, i.e. r reaches 2, 3, 4 at updates 2,309, 4,543, 6,703."""
    schedule = paper_schedule()
    expected = {1: 1, 2308: 1, 2309: 2, 4542: 2, 4543: 3, 6702: 3, 6703: 4, 37_500: 32, 37_501: 32, 50_000: 32}
    assert {u: schedule.mean(u) for u in expected} == expected
    # The sampler draws at that mean: the trainer's logs, its (n, k) and tools/flops.py read one schedule.
    assert schedule.sample(2309, 1) == RecurrenceSampler().sample(2, 8, 2309, 1)
    assert schedule.sample(2308, 1) == RecurrenceSampler().sample(1, 8, 2308, 1)


BACKPROP_W = 3125  # backprop_warmup_fraction 0.125 of 25,000 updates


def test_backprop_depth_curriculum_is_the_references():
    """The reference's depth ramp: a warmup-stable-decay scheduler from min_lr_ratio = 1/8 to lr = 8, so
    after j scheduler steps it holds 8 (1/8 + 7/8 j / W) = 1 + 7 j / W, used as ceil(...). It is stepped
    once before training (train.py: "so we get 2 out of the scheduler and not 1") and after every
    update, so update u (1-based) trains at d(u) = ceil(1 + 7 u / W) for u < W and 8 from u = W on.

    u = 0 is never trained: the formula (and this curriculum at position 0) gives 1 there, and the
    first update already runs 2, which is what "starting at 2" means.
    """
    schedule = paper_schedule(steps=25_000, backprop_curriculum=True, backprop_warmup_fraction=0.125)
    depth = lambda u: 8 if u >= BACKPROP_W else math.ceil(1 + 7 * u / BACKPROP_W)  # noqa: E731
    # u = 1, W/7 (446.4: either side), W/2 (1562.5: either side), W - 1, W.
    updates = (1, 446, 447, 1562, 1563, BACKPROP_W - 1, BACKPROP_W)
    expected = {1: 2, 446: 2, 447: 3, 1562: 5, 1563: 5, BACKPROP_W - 1: 8, BACKPROP_W: 8}
    assert {u: depth(u) for u in updates} == expected
    assert {u: schedule.backprop_depth(u) for u in updates} == expected
    assert Curriculum("interpolate", 8, 25_000, 0.125).value(0) == depth(0) == 1
    assert all(schedule.backprop_depth(u) == depth(u) for u in range(1, 25_001))
    # The old ramp, max(start, ceil(8 u / W)), stays available as the "linear" kind; it differs at 1,562
    # of the 25k updates.
    linear = paper_schedule(
        steps=25_000, backprop_curriculum=True, backprop_warmup_fraction=0.125, backprop_curriculum_kind="linear"
    )
    assert all(linear.backprop_depth(u) == max(1, math.ceil(8 * u / BACKPROP_W)) for u in range(1, BACKPROP_W))
    assert sum(linear.backprop_depth(u) != depth(u) for u in range(1, 25_001)) == 1562


def test_backprop_depth_caps_the_grad_window_at_the_mean():
    """The reference trains k <= min(d, r): with r below the depth, all iterations carry grad."""
    schedule = paper_schedule(steps=25_000, backprop_curriculum=True, backprop_warmup_fraction=0.125)
    assert (schedule.mean(1), schedule.backprop_depth(1)) == (1, 2)
    assert schedule.sample(1) == (0, 1)


def test_warmup_rounds_up_to_whole_steps():
    """W = ceil(fraction * steps), as the reference's math.ceil(warmup * max_training_steps)."""
    c = Curriculum("linear", max_value=10, total_steps=1001, warmup_fraction=0.5)
    assert c.warmup_steps == 501
    assert (c.value(500), c.value(451), c.value(450)) == (10, 10, 9)  # ceil(10 * 450 / 501) = 9
