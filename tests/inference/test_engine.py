"""The generation engine (docs/generation.md): the preallocated cache against an uncached forward, K/V
sharing against a list-based reference, adaptive exit against the criteria computed from full forwards,
batched == single for every mode and criterion, cache sizes, warm start, sampling, the lm-eval model and the
HF export's generate. The generate command: tests/cli/test_generate.py.

Every model is tiny and fp32, built inline.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import tiny_args, tiny_model
from tests.torchrun_util import load_tool
from titan_recur.inference.engine import generate, left_pad
from titan_recur.inference.exit_criteria import EXIT_CRITERIA
from titan_recur.inference.options import GenerationOptions
from titan_recur.models.cache import KVCache
from titan_recur.models.model import Decoding, RecurrentLM

REPO = Path(__file__).resolve().parents[2]
VOCAB = 97
# Logits here stay below |2| (std-0.1 blocks): cached vs uncached fp32 differ by ~1e-6 (matmul shapes).
ATOL = 1e-5


def build(seed: int = 3, std: float = 0.1, **overrides) -> RecurrentLM:
    args = tiny_args(**{"vocab_size": VOCAB, "max_seq_len": 64, "adapter_init": "random", **overrides})
    return tiny_model(args, seed, std).eval()


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
    out = generate(
        model,
        seq[:, :prompt],
        GenerationOptions(max_new_tokens=8, num_steps=r),
        forced_tokens=seq[:, prompt:],
        return_logits=True,
    )
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

    def advance(self, seqlen: int) -> None:
        self.length += seqlen

    def iteration_view(self, iteration: int) -> SimpleNamespace:
        return SimpleNamespace(update=lambda slot, k, v: self.update(slot, k, v, iteration))

    def update(self, slot, k, v, iteration=0):
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
    out = generate(
        model,
        seq[:, :4],
        GenerationOptions(max_new_tokens=6, num_steps=r, kv_sharing=kv_sharing),
        forced_tokens=seq[:, 4:],
        return_logits=True,
    )
    cache, expected = ListCache(slots), []
    with torch.no_grad():
        for start, end in [(0, 4), *((t, t + 1) for t in range(4, 9))]:
            expected.append(model(seq[:, start:end], r, state_init="zero", decoding=Decoding(cache=cache))[:, -1])
    torch.testing.assert_close(out.logits, torch.stack(expected, dim=1), atol=ATOL, rtol=0)
    full = generate(
        model,
        seq[:, :4],
        GenerationOptions(max_new_tokens=6, num_steps=r),
        forced_tokens=seq[:, 4:],
        return_logits=True,
    )
    torch.testing.assert_close(out.logits[:, 0], full.logits[:, 0], atol=ATOL, rtol=0)  # the prompt is exact
    assert not torch.allclose(out.logits[:, 1:], full.logits[:, 1:], atol=1e-3)  # decoding is not


def test_every_sharing_mode_is_exact_at_one_iteration_and_compress_r_is_full(model: RecurrentLM) -> None:
    ids, mask = left_pad(prompts(), 0)

    def run(r, mode):
        return generate(
            model,
            ids,
            GenerationOptions(max_new_tokens=6, num_steps=r, kv_sharing=mode),
            attention_mask=mask,
            return_logits=True,
        )

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
    [
        ("kl", 1, 1),
        ("latent-diff", 1, 1),
        ("entropy-diff", 2, 1),
        ("argmax", 1, 1),
        ("kl", 3, 2),
        ("latent-diff", 2, 3),
    ],
)
def test_exit_step_equals_the_criterion_of_full_forwards(criterion: str, min_steps: int, every: int) -> None:
    model = build(seed=7)
    r = 12
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    first = generate(model, prompt, GenerationOptions(max_new_tokens=1, num_steps=r)).tokens
    values = check_values(
        reference_criterion(model, torch.cat([prompt, first], dim=1), r, criterion), criterion, r, min_steps, every
    )
    if criterion == "argmax":
        threshold = 2.0
        exit_at = next((i for i, stable in values if stable >= threshold), r)
    else:  # between the smallest check value and every earlier one: the exit is at that check
        best = min(range(len(values)), key=lambda k: values[k][1])
        threshold = (values[best][1] + min((v for _, v in values[:best]), default=3 * values[best][1])) / 2
        exit_at = values[best][0]
    checks_run = sum(i <= exit_at for i, _ in values)
    calls = 1 if criterion == "latent-diff" else checks_run + (exit_at == r)
    options = GenerationOptions(
        max_new_tokens=2,
        num_steps=r,
        exit_criterion=criterion,
        exit_threshold=threshold,
        min_steps=min_steps,
        check_every=every,
    )
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
    options = GenerationOptions(
        max_new_tokens=10,
        num_steps=8,
        kv_sharing=kv_sharing,
        exit_criterion=criterion,
        exit_threshold=threshold,
        state_init="previous" if criterion == "kl" else None,
    )
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
        ("full", 4, [1, 2, 3, 4], [1, 2, 2, 2]),
        ("compress-2", 2, [3, 4], [1, 2]),
        ("latest", 1, [4], [2]),
    ]:
        cache = KVCache(
            batch_size=2,
            capacity=3,
            n_prelude=0,
            n_core=1,
            n_coda=0,
            n_kv_heads=1,
            head_dim=1,
            num_steps=4,
            kv_sharing=kv_sharing,
        )
        cache.begin(1)
        for i in range(4):
            value = torch.full((2, 1, 1, 1), float(i + 1))
            with cache.writes_only(torch.tensor([True, i < 2])):
                cache.iteration_view(i).update(("core", 0), value, -value)
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

    measured = {mode: cache_bytes(recurrent, num_steps=r, kv_sharing=mode) for mode in ("full", "latest", "compress-4")}
    latest = measured["latest"]
    a = recurrent.args
    assert latest == cache_bytes(static) == (P + R + C) * 2 * bsz * a.n_kv_heads * (5 + 3) * a.head_dim * 4
    assert measured["full"] * (P + R + C) == latest * (P + R * r + C)
    assert measured["compress-4"] * (P + R + C) == latest * (P + R * 4 + C)
    for mode, nbytes in measured.items():
        assert KVCache.planned_bytes(a, bsz, 5 + 3, r, mode, 4) == nbytes


def test_bench_memory_quotes_the_llama_retrofit_cache(capsys) -> None:
    """The docs' figure: Llama-3.2-1B as (4,6,4), 2048 bf16 tokens, r = 32: 200 slots x 2 x 8 heads x 64 dims."""
    bench = load_tool("bench_generate")
    bench.main(["memory", "--recurrences", "32", "--kv-sharing-modes", "full,latest"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 ")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["32", "full", "200", f"{200 * 2 * 8 * 2048 * 64 * 2 / 2**20:.1f}", "14.29"],
        ["32", "latest", "14", f"{14 * 2 * 8 * 2048 * 64 * 2 / 2**20:.1f}", "1.00"],
    ]


def test_bench_speed_times_every_engine_in_interleaved_rounds(capsys) -> None:
    """The speed table docs/benchmarks.md quotes: one row per engine, ratios to ``cat`` from the same rounds."""
    bench = load_tool("bench_generate")
    bench.main(
        [
            "speed",
            "--dim",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--ffn",
            "64",
            "--vocab",
            "64",
            "--batch-sizes",
            "2",
            "--recurrences",
            "3",
            "--prompt-len",
            "4",
            "--new-tokens",
            "6",
            "--rounds",
            "2",
        ]
    )
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 2 ")
    ]
    assert [row[2] for row in rows] == ["cat", "full", "latest"]
    assert rows[0][5:7] == ["1.00", "1.00"] and all(float(row[5]) > 0 for row in rows)
    assert float(rows[2][7]) < float(rows[1][7])  # latest holds fewer slots than full at r = 3
    # the bandwidth bound and the share of it reached, and the warm-up seconds
    assert all(float(row[8]) > 0 and 0 < float(row[9]) and float(row[10]) >= 0 for row in rows)
    # decode-only tokens/s (the new tokens after the first over the time beyond a one-token run) and that run
    assert all(float(row[11]) > 0 and float(row[12]) > 0 for row in rows if row[11] != "nan")


def test_bench_attention_backends_are_torchs_own_choice_for_each_call() -> None:
    """The backend the speed bench names for prefill and decode is what torch's SDPA chooser returns for each
    call's own arguments (grouped heads folded over the cache: a mask and G x T query rows, no enable_gqa)."""
    bench = load_tool("bench_generate")
    model = tiny_model(tiny_args()).eval()  # 4 query heads over 2 KV heads
    prompt = torch.randint(0, 97, (2, 5))
    seen: list[tuple] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        seen.append((k.shape[-2], torch.nn.attention.SDPBackend(choice).name.lower()))  # keys: the prompt's 5, then 6
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa)

    run = bench.engine_run(model, prompt, 3, "full", False, 1)
    backends = bench.attention_backends(run)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", spy):
        run(2, 2)
    prefill = {name for keys, name in seen if keys == 5}
    decode = {name for keys, name in seen if keys != 5}
    assert decode and backends == {"prefill": "+".join(sorted(prefill)), "decode": "+".join(sorted(decode))}
    assert set(backends.values()) <= {"flash_attention", "efficient_attention", "cudnn_attention", "math"}


def test_bench_speed_and_check_write_their_figures_as_json_lines(tmp_path: Path, capsys, monkeypatch) -> None:
    """--jsonl: each speed row and each check r as one JSON line (tools/bench_gpu.sh collects them), the printed
    figures; the check's fast path compiled with aot_eager here."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    bench = load_tool("bench_generate")
    shape = ["--dim", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--vocab", "64", "--prompt-len", "4"]
    out = tmp_path / "points.jsonl"
    bench.main(
        ["speed", *shape, "--batch-sizes", "2", "--recurrences", "3", "--new-tokens", "5", "--rounds", "1"]
        + ["--engines", "full,latest", "--jsonl", str(out)]
    )
    bench.main(["check", *shape, "--dtype", "float32", "--recurrences", "3", "--new-tokens", "4", "--jsonl", str(out)])
    printed = capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in printed if line.startswith("| 2 ")]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["bench"], r.get("engine")) for r in records] == [
        ("decode_speed", "full"),
        ("decode_speed", "latest"),
        ("decode_check", None),
    ]
    for row, record in zip(rows, records[:2], strict=True):
        assert record["batch"] == 2 and record["r"] == 3 and record["device"] == "cpu" and record["dim"] == 32
        assert row[3] == f"{record['tokens_per_sec']:.1f}" and row[7] == f"{record['kv_cache_mib']:.2f}"
        assert row[9] == f"{100 * record['share_of_bound']:.1f}" and row[10] == f"{record['warmup_seconds']:.1f}"
        assert row[11] == f"{record['decode_tokens_per_sec']:.1f}" and row[12] == f"{record['prefill_seconds']:.3f}"
        assert row[13] == f"{record['attention_backends']['prefill']} / {record['attention_backends']['decode']}"
    for line, record in zip([line for line in printed if line.startswith("r=")], records[2:], strict=True):
        assert f"max |logit difference| {record['max_logit_difference']:.4f}" in line
        assert line.endswith(f"argmax agreement {100 * record['argmax_agreement']:.1f}%")
        assert record["host_sync_checked"] is False  # a GPU's check only


# --- warm start and sampling --------------------------------------------------------------------


def test_warm_start_continues_from_the_previous_tokens_state(model: RecurrentLM) -> None:
    """state_init="previous" equals model.forward with the core's initial state replaced by the previous
    token's final state (the prompt starts from zeros)."""
    r, seq = 5, torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    out = generate(
        model,
        seq[:, :4],
        GenerationOptions(max_new_tokens=5, num_steps=r, state_init="previous"),
        forced_tokens=seq[:, 4:],
        return_logits=True,
    )
    finals, expected = [], []
    hook = model.core.register_forward_hook(lambda module, args, output: finals.append(output[:, -1:]))
    cache = model.new_cache(2, 9, num_steps=r)
    original = model.core.initial_state
    try:
        with torch.no_grad():
            expected.append(model(seq[:, :4], r, state_init="zero", decoding=Decoding(cache=cache))[:, -1])
            for t in range(4, 8):
                model.core.initial_state = lambda embedded, init, previous=finals[-1]: previous
                expected.append(model(seq[:, t : t + 1], r, decoding=Decoding(cache=cache))[:, -1])
    finally:
        model.core.initial_state = original
        hook.remove()
    torch.testing.assert_close(out.logits, torch.stack(expected, dim=1), atol=ATOL, rtol=0)
    cold = generate(
        model,
        seq[:, :4],
        GenerationOptions(max_new_tokens=5, num_steps=r),
        forced_tokens=seq[:, 4:],
        return_logits=True,
    )
    assert not torch.allclose(out.logits[:, 1:], cold.logits[:, 1:], atol=1e-3)


def test_warm_start_on_a_static_model_decodes_as_a_cold_start() -> None:
    """A static model has no recurrent state: state_init="previous" has nothing to carry over (it used to
    fail indexing the missing state)."""
    static, prompt = build(n_core=0), torch.tensor([[5, 7, 11]])
    warm = generate(static, prompt, GenerationOptions(max_new_tokens=4, state_init="previous"))
    cold = generate(static, prompt, GenerationOptions(max_new_tokens=4))
    assert torch.equal(warm.tokens, cold.tokens)


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
        (dict(iterations_per_call=0), "iterations_per_call"),
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
        generate(
            model,
            torch.ones(2, 3, dtype=torch.long),
            GenerationOptions(),
            attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
        )
    with pytest.raises(
        ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(5\) exceeds the model's max_seq_len \(64\)"
    ):
        generate(model, torch.ones(1, 60, dtype=torch.long), GenerationOptions(max_new_tokens=5))
    static = build(n_core=0)
    with pytest.raises(ValueError, match="static model"):
        generate(static, torch.ones(1, 3, dtype=torch.long), GenerationOptions(exit_criterion="kl"))


# --- lm-eval, HF export ----------------------------------------------------------------------------


def test_lm_eval_model_and_harness_sweep_exit_thresholds(
    generation_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """generate_until through the engine with adaptive exit: batch size changes nothing, depth is counted per
    task, and the harness table and compute curve carry it."""
    import lm_eval.evaluator
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from titan_recur.eval.harness import CURVE_PNG, ITERATIONS, harness_sweep, results_table, write_results
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    monkeypatch.chdir(REPO)  # the tiny task names its data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # lm_eval's environment report runs pip in subprocesses (~5 s per evaluation); not what is tested.
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    manager = TaskManager(include_path=str(REPO / "tests" / "assets_lm_eval"), include_defaults=False)
    args = dict(
        pretrained=str(generation_model_dir),
        num_steps=6,
        kv_sharing="compress-2",
        exit_criterion="argmax",
        max_gen_toks=8,
    )
    lm = TitanRecurLM(**args, batch_size=4)
    results = harness_sweep(
        lm,
        ["titan_recur_tiny_gen", "titan_recur_tiny_choice"],
        [6],
        manager,
        exit_thresholds=[1, 3],
        limit=3,
        log_samples=True,
    )
    assert list(results) == ["6@1", "6@3"]
    rows = {(row["task"], row["metric"]): row for row in results_table(results)}
    gen = rows[("titan_recur_tiny_gen", ITERATIONS)]
    assert gen["6@1"] < gen["6@3"] <= 6  # tokens exit early, more so at the lower threshold
    assert rows[("titan_recur_tiny_choice", ITERATIONS)] == {
        "task": "titan_recur_tiny_choice",
        "metric": ITERATIONS,
        "6@1": 6.0,
        "6@3": 6.0,
    }  # scoring runs r
    alone = TitanRecurLM(**args, exit_threshold=1, batch_size=1)
    single = simple_evaluate(
        model=alone, tasks=["titan_recur_tiny_gen"], task_manager=manager, limit=3, log_samples=True
    )

    def responses(result):
        return [s["resps"] for s in result["samples"]["titan_recur_tiny_gen"]]

    assert responses(single) == responses(results["6@1"])
    tokens, iterations = alone.depth_stats["titan_recur_tiny_gen"]
    assert iterations / tokens == gen["6@1"]
    write_results(results, tmp_path)
    assert (tmp_path / CURVE_PNG).stat().st_size > 1000 and (tmp_path / "results_r6@3.json").is_file()
    with pytest.raises(ValueError, match="min_steps"):
        TitanRecurLM(**{**args, "min_steps": 7})


def test_lm_eval_model_decodes_speculatively_with_the_same_answers(generation_model_dir: Path, monkeypatch) -> None:
    """model_args draft_steps/lookahead: the plain run's responses; the depth stats count drafts and verifies."""
    import lm_eval.evaluator
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string

    from titan_recur.eval.lm_eval_model import TitanRecurLM

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    manager = TaskManager(include_path=str(REPO / "tests" / "assets_lm_eval"), include_defaults=False)
    common = f"pretrained={generation_model_dir},num_steps=6,max_gen_toks=8,batch_size=2"
    responses, stats = [], []
    for extra in ("", ",draft_steps=1,lookahead=4"):
        lm = TitanRecurLM(**simple_parse_args_string(common + extra))
        result = simple_evaluate(
            model=lm, tasks=["titan_recur_tiny_gen"], task_manager=manager, limit=3, log_samples=True
        )
        responses.append([s["resps"] for s in result["samples"]["titan_recur_tiny_gen"]])
        stats.append(lm.depth_stats["titan_recur_tiny_gen"])
    assert responses[0] == responses[1]
    (tokens, plain_iterations), (spec_tokens, spec_iterations) = stats
    assert tokens == spec_tokens and plain_iterations == 6 * tokens
    assert spec_iterations != plain_iterations  # drafts at 1 and verifies at 6, not 6 per token
    with pytest.raises(ValueError, match="lookahead must be an integer >= 1"):
        TitanRecurLM(**simple_parse_args_string(common + ",draft_steps=1,lookahead=0"))


@pytest.mark.slow
def test_hf_export_generate_takes_the_depth_knobs(generation_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    from titan_recur.hf.export import export_hf
    from titan_recur.storage.model_io import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    export_hf(load_model(generation_model_dir), tmp_path / "hf", tokenizer_folder=generation_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12]], 0)
    knobs = dict(
        num_steps=6, kv_sharing="latest", exit_criterion="kl", exit_threshold=1e-2, min_steps=2, state_init="previous"
    )
    expected = generate(
        load_model(generation_model_dir), ids, GenerationOptions(max_new_tokens=10, **knobs), attention_mask=mask
    )
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, **knobs)
    assert torch.equal(out[:, ids.shape[1] :], expected.tokens)
    assert expected.steps[:, 1:].float().mean() < 6
    # the fast path inside the export's own (inlined) engine: the same tokens (aot_eager: see test_decode_program)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    fast = hf.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, compile=True, **knobs
    )
    assert torch.equal(fast, out)
    speculative = dict(num_steps=6, draft_steps=2, lookahead=3)  # drafts and verifies as programs
    plain = generate(
        load_model(generation_model_dir), ids, GenerationOptions(max_new_tokens=10, num_steps=6), attention_mask=mask
    )
    fast = hf.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, compile=True, **speculative
    )
    assert torch.equal(fast[:, ids.shape[1] :], plain.tokens)
    with pytest.raises(ValueError, match="cannot serve beam_search decoding"):
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, kv_sharing="latest")


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 50, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.8), (1.0, 1, 0.5)])
def test_sampling_distribution_is_transformers(temperature: float, top_k: int, top_p: float) -> None:
    """The engine's sampling distribution is transformers' warpers' (temperature, then top_k, then top_p)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from titan_recur.inference.sampling import token_probs

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
    if top_k:
        warpers.insert(1, TopKLogitsWarper(top_k))
    expected = torch.softmax(warpers(None, logits.clone()), dim=-1)
    probs = token_probs(logits, temperature, top_p, top_k)
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), expected, rtol=1e-5, atol=1e-7)


def test_top_k_one_samples_the_argmax(model: RecurrentLM) -> None:
    """top_k=1 leaves the most likely token only: sampling decodes greedily, speculatively too."""
    ids, mask = left_pad(prompts(), 0)
    for knobs in (dict(num_steps=4), dict(num_steps=4, draft_steps=2)):
        greedy = generate(model, ids, GenerationOptions(max_new_tokens=8, **knobs), attention_mask=mask)
        options = GenerationOptions(max_new_tokens=8, temperature=1.5, top_k=1, seed=3, **knobs)
        assert torch.equal(generate(model, ids, options, attention_mask=mask).tokens, greedy.tokens)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        generate(model, ids, GenerationOptions(num_steps=4, top_k=-1), attention_mask=mask)


def test_bench_speed_times_the_hf_source_beside_the_engine(capsys) -> None:
    """--hf-source adds transformers' own generate of the plain source model: one row per batch size, no r."""
    bench = load_tool("bench_generate")
    argv = ["speed", "--dim", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--vocab", "512"]
    argv += ["--batch-sizes", "2", "--recurrences", "1,3", "--prompt-len", "4", "--new-tokens", "5", "--rounds", "1"]
    bench.main([*argv, "--engines", "full", "--hf-source", str(REPO / "assets" / "tiny_llama")])
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 2 ")
    ]
    assert [(row[1], row[2]) for row in rows] == [("-", "hf source"), ("1", "full"), ("3", "full")]
    assert float(rows[0][3]) > 0 and rows[0][9] == "-"


# --- the stop mask's device ---------------------------------------------------------------------


class OtherDeviceMask(torch.Tensor):
    """A stop mask standing for one on another device than the decoding's (a CPU mask while decoding on a GPU): any
    use before ``.to(device)`` fails, as combining a CPU mask with CUDA tensors does. A CPU-only stand-in."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is not torch.Tensor.to:
            raise RuntimeError(f"{func.__name__}: the stop mask is on another device")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {})).as_subclass(torch.Tensor)


@pytest.mark.parametrize("compile", [False, True])
def test_the_engine_moves_a_stop_mask_to_the_decoding_device(monkeypatch, compile: bool) -> None:
    """P0-10 item 4: ``stop``'s mask was combined with the decoding's tensors where it was made, so a mask made on
    the CPU failed a GPU's first token; the engine moves it (eagerly and on the fast path, aot_eager here)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    def stop(tokens: torch.Tensor) -> torch.Tensor:
        return torch.full((tokens.shape[0],), tokens.shape[1] >= 3).as_subclass(OtherDeviceMask)

    ids, mask = left_pad(prompts(), 0)
    options = GenerationOptions(max_new_tokens=6, num_steps=2, compile=compile)
    out = generate(build(), ids, options, attention_mask=mask, stop=stop)
    assert out.tokens.shape == (3, 3) and out.lengths.tolist() == [3, 3, 3]


def test_bench_speed_builds_its_stop_mask_on_the_tokens_device(monkeypatch) -> None:
    """P0-10 item 4: tools/bench_generate.py speed made its stop mask on the CPU whatever the tokens' device (the
    first CUDA token failed); the meta device stands in for a GPU."""
    bench = load_tool("bench_generate")
    masks = []

    def fake_generate(model, input_ids, options, stop):
        masks.append(stop(torch.zeros(2, 5, dtype=torch.long, device="meta")))
        return SimpleNamespace(kv_cache_bytes=0)

    monkeypatch.setattr(bench, "generate", fake_generate)
    bench.engine_run(build(), torch.zeros(2, 3, dtype=torch.long), 2, "full", False, 1)(6, 4)
    assert masks[0].device == torch.device("meta") and masks[0].shape == (2,) and masks[0].dtype == torch.bool
