"""The generation engine (docs/generation.md): the preallocated cache against an uncached forward, K/V
sharing against a list-based reference, adaptive exit against the criteria computed from full forwards,
batched == single for every mode and criterion, cache sizes, warm start, sampling, the CLI, the
lm-eval model and the HF export's generate.

Every model is tiny and fp32, built inline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titan_recur.generate import main as generate_main
from titan_recur.models.args import ModelArgs
from titan_recur.models.cache import KVCache
from titan_recur.models.generate import EXIT_CRITERIA, GenerationOptions, generate, left_pad
from titan_recur.models.io import save_model
from titan_recur.models.model import RecurrentLM

REPO = Path(__file__).resolve().parents[1]
VOCAB = 97
# Logits here stay below |2| (std-0.1 blocks): cached vs uncached fp32 differ by ~1e-6 (matmul shapes).
ATOL = 1e-5


def build(seed: int = 3, std: float = 0.1, **overrides) -> RecurrentLM:
    values = dict(vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_prelude=1,
                  n_core=2, n_coda=1, max_seq_len=64, adapter_init="random")
    torch.manual_seed(seed)
    model = RecurrentLM(ModelArgs(**{**values, **overrides}))
    model.init_weights(std)
    return model.eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 6)]


@pytest.fixture(scope="module")
def model() -> RecurrentLM:
    return build()


# --- exactness of the preallocated cache --------------------------------------------------------


@pytest.mark.parametrize("r", [1, 4, 32])
def test_full_cache_equals_uncached_forward(model: RecurrentLM, r: int) -> None:
    """Teacher-forced decoding through the cache gives the uncached forward's logits; greedy decoding
    gives the tokens of re-running the whole sequence without a cache at every step."""
    seq = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    prompt = 4
    out = generate(model, seq[:, :prompt], GenerationOptions(max_new_tokens=8, num_steps=r),
                   forced_tokens=seq[:, prompt:], return_logits=True)
    with torch.no_grad():
        full = model(seq, r, state_init="zero")
    torch.testing.assert_close(out.logits, full[:, prompt - 1 : -1], atol=ATOL, rtol=0)
    assert out.steps.eq(r).all()

    greedy = generate(model, seq[:, :prompt], GenerationOptions(max_new_tokens=8, num_steps=r)).tokens
    ids = seq[:, :prompt]
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids, r, state_init="zero")[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert greedy.tolist() == ids[:, prompt:].tolist()
    if r > 1:  # depth matters for this model
        assert not torch.allclose(full, model(seq, 1, state_init="zero"), atol=1e-2)


class ListCache:
    """Reference of the K/V sharing rules: per (block, slot index) a Python list of per-position K/V."""

    def __init__(self, slots_per_block: int) -> None:
        self.slots_per_block, self.lists, self.length = slots_per_block, {}, 0

    def begin(self, seqlen: int) -> int:
        self.columns = range(self.length, self.length + seqlen)
        return self.length + seqlen

    def update(self, slot, iteration, k, v):
        key = (*slot, iteration % self.slots_per_block if slot[0] == "core" else 0)
        keys, values = self.lists.setdefault(key, ([], []))
        for t, column in enumerate(self.columns):
            if column == len(keys):
                keys.append(None), values.append(None)
            keys[column], values[column] = k[:, :, t], v[:, :, t]  # a later iteration overwrites
        return torch.stack(keys, dim=2), torch.stack(values, dim=2)


@pytest.mark.parametrize("kv_sharing, slots", [("latest", 1), ("compress-2", 2), ("compress-3", 3)])
def test_kv_sharing_equals_list_reference(model: RecurrentLM, kv_sharing: str, slots: int) -> None:
    r = 6
    seq = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    out = generate(model, seq[:, :4], GenerationOptions(max_new_tokens=6, num_steps=r, kv_sharing=kv_sharing),
                   forced_tokens=seq[:, 4:], return_logits=True)
    cache, expected = ListCache(slots), []
    with torch.no_grad():
        for start, end in [(0, 4), *((t, t + 1) for t in range(4, 9))]:
            expected.append(model(seq[:, start:end], r, cache=cache, state_init="zero")[:, -1])
    torch.testing.assert_close(out.logits, torch.stack(expected, dim=1), atol=ATOL, rtol=0)
    full = generate(model, seq[:, :4], GenerationOptions(max_new_tokens=6, num_steps=r),
                    forced_tokens=seq[:, 4:], return_logits=True)
    torch.testing.assert_close(out.logits[:, 0], full.logits[:, 0], atol=ATOL, rtol=0)  # the prompt is exact
    assert not torch.allclose(out.logits[:, 1:], full.logits[:, 1:], atol=1e-3)  # decoding is not


def test_every_sharing_mode_is_exact_at_one_iteration_and_compress_r_is_full(model: RecurrentLM) -> None:
    ids, mask = left_pad(prompts(), 0)
    def run(r, mode):
        return generate(model, ids, GenerationOptions(max_new_tokens=6, num_steps=r, kv_sharing=mode),
                        attention_mask=mask, return_logits=True)
    for mode in ("latest", "compress-2"):
        torch.testing.assert_close(run(1, mode).logits, run(1, "full").logits, atol=0, rtol=0)
    torch.testing.assert_close(run(4, "compress-4").logits, run(4, "full").logits, atol=0, rtol=0)


# --- adaptive exit ------------------------------------------------------------------------------


def reference_criterion(model: RecurrentLM, seq: torch.Tensor, r: int, criterion: str) -> list[float]:
    """The criterion after each iteration i = 1..r of the last token, from uncached forwards at depth i.

    Valid for the first decoded token: every earlier position ran r iterations, so iteration i of
    the new token sees iteration i of them, which is what an uncached forward at depth i computes.
    Returns the per-iteration quantity (log-probs, entropy, argmax or last-position state).
    """
    states = []
    hook = model.core.register_forward_hook(lambda module, args, output: states.append(output[0, -1]))
    with torch.no_grad():
        logits = [model(seq, i, state_init="zero")[0, -1] for i in range(1, r + 1)]
    hook.remove()
    if criterion == "latent-diff":
        return [torch.zeros_like(states[0]), *states]  # s_0 = zero init
    if criterion == "argmax":
        return [int(x.argmax()) for x in logits]
    return [F.log_softmax(x, dim=-1) for x in logits]


def check_values(quantities, criterion: str, r: int, min_steps: int, every: int) -> list[tuple[int, float]]:
    """(iteration, value) at every check before r, by Huginn's rules: each check against the previous
    check (before the first: the initial state, a uniform distribution, nothing); argmax's value is
    the number of consecutive checks with an unchanged argmax."""
    if criterion == "latent-diff":
        previous, quantities = quantities[0], quantities[1:]
    elif criterion == "kl":
        previous = torch.full((VOCAB,), -torch.log(torch.tensor(float(VOCAB))))
    else:
        previous = None
    stable, values = 0, []
    for i in range(min_steps, r, every):
        q = quantities[i - 1]
        if criterion == "latent-diff":
            value = float((q - previous).norm() / q.norm())
        elif criterion == "kl":
            value = float((previous.exp() * (previous - q)).sum())
        elif criterion == "entropy-diff":
            q = float(-(q.exp() * q).sum())
            value = abs(q - previous) if previous is not None else float("inf")
        else:
            stable = stable + 1 if q == previous else 0
            value = stable
        previous = q
        values.append((i, value))
    return values


@pytest.mark.parametrize(
    "criterion, min_steps, every",
    [("kl", 1, 1), ("latent-diff", 1, 1), ("entropy-diff", 2, 1), ("argmax", 1, 1), ("kl", 3, 2), ("latent-diff", 2, 3)],
)
def test_exit_step_equals_the_criterion_of_full_forwards(criterion: str, min_steps: int, every: int) -> None:
    model = build(seed=7)
    r = 12
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    first = generate(model, prompt, GenerationOptions(max_new_tokens=1, num_steps=r)).tokens
    values = check_values(reference_criterion(model, torch.cat([prompt, first], dim=1), r, criterion),
                          criterion, r, min_steps, every)
    if criterion == "argmax":
        threshold = 2.0
        exit_at = next((i for i, stable in values if stable >= threshold), r)
    else:  # between the smallest check value and every earlier one: the exit is at that check
        best = min(range(len(values)), key=lambda k: values[k][1])
        threshold = (values[best][1] + min((v for _, v in values[:best]), default=3 * values[best][1])) / 2
        exit_at = values[best][0]
    checks_run = sum(i <= exit_at for i, _ in values)
    calls = 1 if criterion == "latent-diff" else checks_run + (exit_at == r)
    options = GenerationOptions(max_new_tokens=2, num_steps=r, exit_criterion=criterion, exit_threshold=threshold,
                                min_steps=min_steps, check_every=every)
    out = generate(model, prompt, options, forced_tokens=torch.cat([first, first], dim=1))
    assert out.tokens[0, 0] == first[0, 0]
    assert (int(out.steps[0, 1]), int(out.head_calls[0, 1])) == (exit_at, calls)
    assert min_steps <= exit_at < r


# Per (sharing mode, criterion), a threshold at which this model's tokens exit at several depths
# (the test checks that they do); full-mode dynamics of a random model settle slowly, and kl runs
# with the warm start, which settles fast.
THRESHOLDS = {
    "full": {"kl": 0.1, "latent-diff": 0.9, "entropy-diff": 1e-2, "argmax": 2},
    "latest": {"kl": 1e-4, "latent-diff": 0.3, "entropy-diff": 1e-3, "argmax": 2},
    "compress-3": {"kl": 0.03, "latent-diff": 0.5, "entropy-diff": 1e-2, "argmax": 2},
}


@pytest.mark.parametrize("kv_sharing", list(THRESHOLDS))
@pytest.mark.parametrize("criterion", [None, *EXIT_CRITERIA])
def test_batched_equals_single(model: RecurrentLM, kv_sharing: str, criterion: str | None) -> None:
    """A left-padded batch gives each row exactly its own tokens and per-token depths (Huginn's cannot)."""
    threshold = THRESHOLDS[kv_sharing][criterion] if criterion else None
    options = GenerationOptions(max_new_tokens=10, num_steps=8, kv_sharing=kv_sharing, exit_criterion=criterion,
                                exit_threshold=threshold, state_init="previous" if criterion == "kl" else None)
    rows = prompts()
    ids, mask = left_pad(rows, 0)
    batched = generate(model, ids, options, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generate(model, torch.tensor([row]), options)
        assert batched.tokens[i].tolist() == alone.tokens[0].tolist(), i
        assert batched.steps[i].tolist() == alone.steps[0].tolist(), i
        assert batched.head_calls[i].tolist() == alone.head_calls[0].tolist(), i
    assert len({tuple(t) for t in batched.tokens.tolist()}) > 1
    if criterion is not None:  # rows exit at different depths, so frozen rows really sit beside running ones
        per_token = [set(column.tolist()) for column in batched.steps[:, 1:].T]
        assert any(len(depths) > 1 for depths in per_token), batched.steps


def test_exited_rows_do_not_write_and_skipped_slots_hold_the_last_kv() -> None:
    """Row 1 exits after 2 of 4 iterations: later iterations leave its K/V alone, then its slots 2, 3 get slot 1's."""
    for kv_sharing, slots, expected_row0, expected_row1 in [
        ("full", 4, [1, 2, 3, 4], [1, 2, 2, 2]), ("compress-2", 2, [3, 4], [1, 2]), ("latest", 1, [4], [2])
    ]:
        cache = KVCache(batch_size=2, capacity=3, n_prelude=0, n_core=1, n_coda=0, n_kv_heads=1, head_dim=1,
                        num_steps=4, kv_sharing=kv_sharing)
        cache.begin(1)
        for i in range(4):
            cache.write_rows = torch.tensor([True, i < 2])
            value = torch.full((2, 1, 1, 1), float(i + 1))
            cache.update(("core", 0), i, value, -value)
        cache.write_rows = None
        cache.fill_skipped(torch.tensor([4, 2]))
        keys, values = cache.buffers[("core", 0)]
        assert keys.shape[0] == slots
        assert keys[:, 0, 0, 0, 0].tolist() == expected_row0, kv_sharing
        assert keys[:, 1, 0, 0, 0].tolist() == expected_row1, kv_sharing
        assert values[:, 1, 0, 0, 0].tolist() == [-v for v in expected_row1]
        assert keys[:, :, 0, 1:].abs().sum() == 0  # other columns untouched


# --- memory -------------------------------------------------------------------------------------


def test_cache_bytes_latest_is_the_static_models_and_full_grows_with_r() -> None:
    """Measured from the allocated buffers: "latest" at r = 32 is a static P+R+C-layer model's cache."""
    P, R, C, r, bsz = 2, 3, 1, 32, 2
    recurrent = build(n_prelude=P, n_core=R, n_coda=C)
    static = build(n_prelude=P + R, n_core=0, n_coda=C)
    ids = torch.randint(1, VOCAB, (bsz, 5))

    def cache_bytes(model, **options):
        return generate(model, ids, GenerationOptions(max_new_tokens=3, **options)).kv_cache_bytes

    latest = cache_bytes(recurrent, num_steps=r, kv_sharing="latest")
    static_bytes = cache_bytes(static)
    a = recurrent.args
    assert latest == static_bytes == (P + R + C) * 2 * bsz * a.n_kv_heads * (5 + 3) * a.head_dim * 4
    assert cache_bytes(recurrent, num_steps=r) * (P + R + C) == latest * (P + R * r + C)
    assert cache_bytes(recurrent, num_steps=r, kv_sharing="compress-4") * (P + R + C) == latest * (P + R * 4 + C)


# --- warm start and sampling --------------------------------------------------------------------


def test_warm_start_continues_from_the_previous_tokens_state(model: RecurrentLM) -> None:
    """state_init="previous" equals model.forward with the core's initial state replaced by the previous
    token's final state (the prompt starts from zeros)."""
    r, seq = 5, torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    out = generate(model, seq[:, :4], GenerationOptions(max_new_tokens=5, num_steps=r, state_init="previous"),
                   forced_tokens=seq[:, 4:], return_logits=True)
    finals, expected = [], []
    hook = model.core.register_forward_hook(lambda module, args, output: finals.append(output[:, -1:]))
    cache = KVCache.for_model(model, 2, 9, num_steps=r)
    original = model.core.initial_state
    try:
        with torch.no_grad():
            expected.append(model(seq[:, :4], r, cache=cache, state_init="zero")[:, -1])
            for t in range(4, 8):
                model.core.initial_state = lambda embedded, init, previous=finals[-1]: previous
                expected.append(model(seq[:, t : t + 1], r, cache=cache)[:, -1])
    finally:
        model.core.initial_state = original
        hook.remove()
    torch.testing.assert_close(out.logits, torch.stack(expected, dim=1), atol=ATOL, rtol=0)
    cold = generate(model, seq[:, :4], GenerationOptions(max_new_tokens=5, num_steps=r),
                    forced_tokens=seq[:, 4:], return_logits=True)
    assert not torch.allclose(out.logits[:, 1:], cold.logits[:, 1:], atol=1e-3)


def test_sampling_is_seeded(model: RecurrentLM) -> None:
    ids, mask = left_pad(prompts(), 0)

    def sample(**options):
        opts = GenerationOptions(max_new_tokens=12, num_steps=3, **options)
        return generate(model, ids, opts, attention_mask=mask).tokens.tolist()

    assert sample(temperature=1.0, seed=1) == sample(temperature=1.0, seed=1)
    assert sample(temperature=1.0, seed=1) != sample(temperature=1.0, seed=2)
    assert sample(temperature=1.0, top_p=1e-6, seed=3) == sample()  # only the most likely token is left
    assert sample(temperature=1e-4, seed=4) == sample()


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(exit_criterion="confidence"), "exit_criterion must be one of kl, latent-diff, entropy-diff, argmax"),
        (dict(kv_sharing="compress-0"), "kv_sharing must be 'full', 'latest' or 'compress-N'"),
        (dict(kv_sharing="shared"), "kv_sharing must be"),
        (dict(exit_criterion="kl", exit_threshold=0.0), "exit_threshold must be > 0"),
        (dict(exit_criterion="kl", exit_threshold=-1.0), "exit_threshold must be > 0"),
        (dict(exit_threshold=0.1), "exit_threshold needs an exit_criterion"),
        (dict(min_steps=5), r"min_steps must be an integer in \[1, max_steps = num_steps = 4\]"),
        (dict(check_every=0), "check_every"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(state_init="warm"), "state_init must be one of"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_options_are_one_line_errors(model: RecurrentLM, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        generate(model, torch.ones(1, 3, dtype=torch.long), GenerationOptions(num_steps=4, **options))
    assert "\n" not in str(err.value)


def test_bad_prompts_are_one_line_errors(model: RecurrentLM) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, torch.ones(2, 3, dtype=torch.long), GenerationOptions(),
                 attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(5\) exceeds the model's max_seq_len \(64\)"):
        generate(model, torch.ones(1, 60, dtype=torch.long), GenerationOptions(max_new_tokens=5))
    static = build(n_core=0)
    with pytest.raises(ValueError, match="static model"):
        generate(static, torch.ones(1, 3, dtype=torch.long), GenerationOptions(exit_criterion="kl"))
