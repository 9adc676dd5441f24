"""Depth-speculative decoding: drafts at few iterations, one verify at the target depth, exact.

Oracle: plain decoding at the target depth (greedy: token for token; sampling: the distribution).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import SMALL, tiny_args, tiny_model
from titan_recur.inference.engine import generate
from titan_recur.inference.options import GenerationOptions
from titan_recur.models.model import RecurrentLM

VOCAB = 48


@pytest.fixture(scope="module")
def model() -> RecurrentLM:
    model = tiny_model(tiny_args(VOCAB, SMALL, max_seq_len=256))
    with torch.no_grad():  # a random adapter (not the identity init, which ignores the state): depth matters
        model.core.adapter.weight.normal_(0, 0.05)
    return model.eval()


def prompts(batch: int = 3, length: int = 6) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def run(model, input_ids, **options):
    return generate(model, input_ids, GenerationOptions(max_new_tokens=16, **options))


@pytest.mark.parametrize("num_steps", [4, 16, 32])
def test_greedy_speculation_equals_greedy_at_the_target_depth(model, num_steps):
    ids = prompts()
    plain = run(model, ids, num_steps=num_steps).tokens
    accepted = []
    for lookahead in range(1, 9):
        out = run(model, ids, num_steps=num_steps, draft_steps=1, lookahead=lookahead)
        assert torch.equal(out.tokens, plain), (num_steps, lookahead)
        accepted.append(out.speculation.acceptance_rate)
    assert min(accepted) < 1.0, "the draft never disagreed: the test could not fail"


def test_batched_rows_accept_independently_and_equal_their_solo_runs(model):
    ids = prompts(batch=4)
    batched = run(model, ids, num_steps=8, draft_steps=2, lookahead=4).tokens
    for row in range(ids.shape[0]):
        solo = run(model, ids[row : row + 1], num_steps=8, draft_steps=2, lookahead=4).tokens
        assert torch.equal(solo[0], batched[row])


@pytest.mark.slow
def test_sampled_speculation_has_the_target_depths_distribution(model):
    """The 2nd and 3rd sampled tokens (drafted, then accepted or resampled) over 8,000 draws: their total
    variation to plain sampling at r = 8 is within the noise of two plain samplers, while sampling at the
    draft depth alone is clearly farther (so the test can tell the depths apart)."""
    ids = prompts(batch=1, length=4).expand(8000, -1).contiguous()

    def marginals(seed: int, **options) -> torch.Tensor:
        out = generate(
            model, ids, GenerationOptions(max_new_tokens=3, temperature=0.4, top_p=1.0, seed=seed, **options)
        ).tokens
        return torch.stack([torch.bincount(out[:, i], minlength=VOCAB).double() / len(out) for i in (1, 2)])

    def tv(a, b) -> float:
        return 0.5 * float((a - b).abs().sum(dim=1).max())

    plain_a, plain_b = marginals(10, num_steps=8), marginals(11, num_steps=8)
    speculative = marginals(12, num_steps=8, draft_steps=1, lookahead=3)
    draft_only = marginals(13, num_steps=1)
    noise = tv(plain_a, plain_b)
    assert tv(speculative, plain_a) < 1.5 * noise + 0.02, (tv(speculative, plain_a), noise)
    assert tv(draft_only, plain_a) > 2 * tv(speculative, plain_a), (tv(draft_only, plain_a), tv(speculative, plain_a))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_steps": 8, "draft_steps": 1, "lookahead": 0}, "lookahead must be an integer >= 1"),
        ({"num_steps": 8, "draft_steps": 8}, "draft_steps must be an integer in \\[1, num_steps - 1"),
        ({"num_steps": 8, "draft_steps": 2, "kv_sharing": "latest"}, "draft_steps needs kv_sharing 'full'"),
        ({"num_steps": 8, "draft_steps": 2, "exit_criterion": "kl"}, "does not combine with exit_criterion"),
        ({"num_steps": 8, "draft_steps": 2, "state_init": "previous"}, "does not combine with state_init='previous'"),
    ],
)
def test_bad_knobs_are_refused_in_one_line(model, options, message):
    with pytest.raises(ValueError, match=message):
        run(model, prompts(), **options)


def test_crop_rolls_the_cache_back(model):
    """Decoding after a crop equals decoding that never wrote the cropped columns."""

    cache = model.new_cache(1, 32, num_steps=4)
    cache.length = 10
    cache.crop(7)
    assert cache.length == 7
    cache.crop(-2)
    assert cache.length == 5
    cache.crop(100)
    assert cache.length == 5


def test_the_cli_decodes_speculatively_and_reports_acceptance(capsys):
    """--draft-steps/--lookahead: the plain command's tokens, plus the acceptance rate and iterations per token."""
    import json

    from titan_recur.cli.generate import main

    common = [
        "--checkpoint",
        "assets/tiny_llama_recurrent",
        "--prompt",
        "The sum of",
        "--num-steps",
        "8",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--draft-steps", "2", "--lookahead", "4"]) == 0
    speculative = json.loads(capsys.readouterr().out)
    assert speculative["prompts"][0]["tokens"] == plain["prompts"][0]["tokens"]
    assert 0 <= speculative["speculation"]["acceptance_rate"] <= 1
    assert speculative["speculation"]["core_iterations_per_token"] > 0
    assert main([*common, "--draft-steps", "8"]) == 2
    assert "draft_steps must be an integer in [1, num_steps - 1" in capsys.readouterr().err
