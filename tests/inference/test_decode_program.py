"""The decode step compiled (titan_recur/inference/decode_program.py) against the same step uncompiled.

Every test compiles with ``backend="aot_eager"``: dynamo's capture (fullgraph: no graph break, so no
host sync inside a piece), AOT functionalisation of the in-place cache, mask and position updates, and
the static shapes are what is tested here; inductor's code generation is run by
tools/bench_generate.py (``check``, ``speed --compile``), and the CUDA graph replay needs a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch._dynamo

from tests.tiny_models import tiny_args, tiny_model
from tests.torchrun_util import load_tool
from titan_recur.inference import decode_program
from titan_recur.inference.decode_program import batch_bucket, capacity_bucket, program_for, release_programs
from titan_recur.inference.engine import generate, left_pad
from titan_recur.inference.options import GenerationOptions
from titan_recur.inference.sampling import sample_by_uniforms
from titan_recur.models.blocks import RMSNorm
from titan_recur.models.model import RecurrentLM

VOCAB = 97
ATOL = 1e-5


def build(**overrides) -> RecurrentLM:
    args = tiny_args(**{"vocab_size": VOCAB, "max_seq_len": 128, "adapter_init": "random", **overrides})
    return tiny_model(args, 3, 0.1).eval()


def prompts(lengths: tuple[int, ...] = (3, 9, 6), seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths], 0)


class GraphCounter:
    """A torch.compile backend (aot_eager underneath) that counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **_: object):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.graphs += 1
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


@pytest.fixture
def counter(monkeypatch) -> GraphCounter:
    """torch.compile through a counting aot_eager backend; dynamo's caches and the programs start empty."""
    count = GraphCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=count))
    torch._dynamo.reset()
    decode_program._DECODE_PROGRAMS.clear()
    yield count
    torch._dynamo.reset()
    decode_program._DECODE_PROGRAMS.clear()


@pytest.fixture(scope="module")
def model() -> RecurrentLM:
    return build()


def assert_same(eager, fast, compare_logits: bool = True) -> None:
    assert fast.tokens.tolist() == eager.tokens.tolist()
    assert fast.steps.tolist() == eager.steps.tolist()
    assert fast.head_calls.tolist() == eager.head_calls.tolist()
    assert fast.lengths.tolist() == eager.lengths.tolist()
    if compare_logits:
        torch.testing.assert_close(fast.logits, eager.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("r", [1, 4, pytest.param(32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_eager_for_64_tokens(model, counter, r: int, batch: int) -> None:
    """fp32 greedy decoding of 64 tokens on the fast path: eager's tokens, depths and logits, left-padded
    rows included (batch 3 runs in bucket 4 with a padding row nobody reads)."""
    ids, mask = prompts((3, 9, 6)[:batch])
    options = GenerationOptions(max_new_tokens=64, num_steps=r)
    eager = generate(model, ids, options, attention_mask=mask, return_logits=True)
    fast = generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask, return_logits=True)
    assert_same(eager, fast)
    assert counter.graphs > 0  # the fast path ran compiled pieces


@pytest.mark.parametrize(
    "knobs",
    [
        # adaptive exit: checks after 3, 5, 7 of 8 iterations, a warm start, runs in pieces of 2
        dict(num_steps=8, exit_criterion="kl", exit_threshold=0.1, min_steps=3, check_every=2, state_init="previous"),
        pytest.param(
            dict(num_steps=8, exit_criterion="latent-diff", exit_threshold=0.8, iterations_per_call=3),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(num_steps=6, exit_criterion="entropy-diff", exit_threshold=0.01, kv_sharing="compress-2"),
            marks=pytest.mark.slow,
        ),
        pytest.param(dict(num_steps=8, exit_criterion="argmax", exit_threshold=2), marks=pytest.mark.slow),
        pytest.param(dict(num_steps=5, kv_sharing="latest"), marks=pytest.mark.slow),
        dict(num_steps=4, temperature=0.8, top_p=0.9, seed=3),  # the same draws: the same samples
        dict(num_steps=3, eos_id=5),
    ],
    ids=["kl-warm", "latent-diff", "entropy-diff-compress", "argmax", "latest", "sampling", "eos"],
)
def test_every_option_on_the_fast_path_equals_eager(model, counter, knobs: dict) -> None:
    ids, mask = prompts()
    options = GenerationOptions(max_new_tokens=12, **{"iterations_per_call": 2, **knobs})
    eager = generate(model, ids, options, attention_mask=mask, return_logits=True)
    fast = generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask, return_logits=True)
    assert_same(eager, fast, compare_logits="eos_id" not in knobs)  # finished rows' logits are nobody's
    if "exit_criterion" in knobs:
        assert len(set(eager.steps[:, 1:].flatten().tolist())) > 1  # rows exit at different checks


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        dict(num_steps=8, draft_steps=2, lookahead=3),
        dict(num_steps=6, draft_steps=1, lookahead=4, temperature=0.8, top_p=0.9, seed=3),
        pytest.param(dict(num_steps=4, draft_steps=1, lookahead=2, eos_id=5), marks=pytest.mark.slow),
    ],
    ids=["greedy", "sampling", "eos"],
)
def test_speculative_decoding_on_the_fast_path_equals_eager(model, counter, monkeypatch, knobs: dict) -> None:
    """Drafts and verifies run as programs (the model's forward serves the prompt only): eager's tokens, logits,
    acceptance and iterations, left-padded rows with their holes included; another token count in the same
    bucket compiles nothing new."""
    ids, mask = prompts()
    options = GenerationOptions(max_new_tokens=12, **knobs)
    eager = generate(model, ids, options, attention_mask=mask, return_logits=True)
    assert eager.speculation is not None and eager.speculation.acceptance_rate < 1  # drafts were rejected
    forwards = []
    model_forward = RecurrentLM.forward
    monkeypatch.setattr(RecurrentLM, "forward", lambda *a, **kw: forwards.append(1) or model_forward(*a, **kw))
    fast = generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask, return_logits=True)
    assert len(forwards) == 1, "drafts or verifies ran through the eager forward"
    assert_same(eager, fast, compare_logits="eos_id" not in knobs)
    assert [t.tolist() for t in vars(fast.speculation).values()] == [
        t.tolist() for t in vars(eager.speculation).values()
    ]
    compiled = counter.graphs
    shorter = dataclasses.replace(options, max_new_tokens=9)
    fast = generate(model, ids, dataclasses.replace(shorter, compile=True), attention_mask=mask)
    assert fast.tokens.tolist() == generate(model, ids, shorter, attention_mask=mask).tokens.tolist()
    assert counter.graphs == compiled, "another token count within the bucket recompiled"


def test_stop_forced_tokens_and_a_static_model_on_the_fast_path(counter) -> None:
    """A stop callback ends rows mid-run, teacher forcing feeds given tokens, and a static model (no core)
    decodes through the same program."""
    recurrent, static = build(), build(n_core=0, n_prelude=2)
    ids, mask = prompts()
    forced = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))

    def stop(tokens: torch.Tensor) -> torch.Tensor:
        return tokens[:, -1] % 3 == 0

    for model, kwargs in (
        (recurrent, dict(stop=stop)),
        (recurrent, dict(forced_tokens=forced)),
        (static, dict(stop=stop)),
    ):
        options = GenerationOptions(max_new_tokens=10, num_steps=3 if model.core is not None else None)
        eager = generate(model, ids, options, attention_mask=mask, return_logits=True, **kwargs)
        fast = generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask, **kwargs)
        assert_same(eager, fast, compare_logits=False)


def test_no_recompile_across_prompt_lengths_and_token_counts_within_a_bucket(model, counter) -> None:
    """One program per (batch bucket, options): other prompt lengths and token counts in the same bucket
    and capacity compile nothing new (the shapes are the capacity's, not the prompt's)."""
    options = GenerationOptions(num_steps=4, compile=True)
    ids, mask = prompts((3, 9, 6))
    generate(model, ids, dataclasses.replace(options, max_new_tokens=20), attention_mask=mask)
    compiled = counter.graphs
    for lengths, new_tokens in (((5, 2, 11), 7), ((1, 30, 4), 40), ((8, 8, 8, 8), 3)):
        ids, mask = prompts(lengths, seed=len(lengths) + new_tokens)
        eager = generate(
            model, ids, dataclasses.replace(options, max_new_tokens=new_tokens, compile=False), attention_mask=mask
        )
        fast = generate(model, ids, dataclasses.replace(options, max_new_tokens=new_tokens), attention_mask=mask)
        assert fast.tokens.tolist() == eager.tokens.tolist()
    assert counter.graphs == compiled, "a prompt length or token count within the bucket recompiled"
    assert len(decode_program._DECODE_PROGRAMS[model]) == 1


@pytest.mark.slow
def test_a_depth_sweep_builds_more_programs_than_dynamos_recompile_limit(model, counter) -> None:
    """Accuracy against r builds a program per depth: more than dynamo keeps graphs per function
    (``recompile_limit``, 8; with fullgraph the one past it is an error), so each program compiles its own
    copy of the pieces. The limit is lowered to 2 here: the same failure, at the third depth, in fewer compiles."""
    ids, mask = prompts()
    with torch._dynamo.config.patch(recompile_limit=2):
        for r in range(1, torch._dynamo.config.recompile_limit + 3):
            options = GenerationOptions(max_new_tokens=3, num_steps=r)
            fast = generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask)
            assert fast.tokens.tolist() == generate(model, ids, options, attention_mask=mask).tokens.tolist()


def test_a_host_sync_inside_the_token_step_fails_the_compile(model, counter, monkeypatch) -> None:
    """The pieces compile with fullgraph=True: a host sync (here ``bool(tensor)`` in every norm) is a graph
    break, which fails the fast path instead of silently splitting the token into many graphs."""
    ids, mask = prompts()
    options = GenerationOptions(max_new_tokens=4, num_steps=2)
    plain = RMSNorm.forward

    def syncing(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if bool(x.isnan().any()):  # a host sync
            raise ValueError("nan")
        return plain(self, x)

    monkeypatch.setattr(RMSNorm, "forward", syncing)
    generate(model, ids, options, attention_mask=mask)  # eager decoding syncs and runs
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask)


def test_sampling_by_uniforms_is_the_distribution() -> None:
    """Inverse-CDF sampling: over an even grid of draws each token's share is its probability (to the grid's
    resolution), and a token of probability 0 is never picked, not even at u = 0."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    n = 10_000
    uniforms = (torch.arange(n, dtype=torch.float64) / n).float()
    picks = sample_by_uniforms(probs.expand(n, -1), uniforms)
    shares = torch.bincount(picks, minlength=6).double() / n
    torch.testing.assert_close(shares, probs.double(), atol=2 / n, rtol=0)
    assert sample_by_uniforms(probs[None] * 7, torch.zeros(1)).item() == 1  # unnormalised, u = 0


@pytest.mark.slow
def test_buckets_and_the_program_cache(counter) -> None:
    """Rows pad up to a power of two (64 and beyond: multiples of 64); capacity to a multiple of 128 within
    max_seq_len; a program is reused while its capacity suffices, rebuilt larger when not, and at most
    MAX_PROGRAMS are kept per model."""
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65, 130)] == [1, 2, 4, 8, 64, 128, 192]
    assert [capacity_bucket(n, 512) for n in (1, 128, 129, 500)] == [128, 128, 256, 512]
    assert capacity_bucket(100, 64) == 100  # never less than needed (max_seq_len is checked elsewhere)
    model = build(max_seq_len=512)
    opts = GenerationOptions(num_steps=2, compile=True).resolve(model.args)  # compiled programs are the kept ones
    first = program_for(model, opts, 3, 40)
    assert program_for(model, opts, 4, 100) is first  # same bucket, capacity 128 suffices
    bigger = program_for(model, opts, 3, 129)
    assert bigger is not first and bigger.cache.capacity == 256
    for r in range(3, 3 + decode_program.MAX_PROGRAMS):
        program_for(model, dataclasses.replace(opts, num_steps=r), 1, 10)
    assert len(decode_program._DECODE_PROGRAMS[model]) == decode_program.MAX_PROGRAMS
    assert bigger not in decode_program._DECODE_PROGRAMS[model].values()  # the least recently used went first
    model.double()  # new weight tensors: a captured graph would read the old ones, so every program goes
    assert program_for(model, dataclasses.replace(opts, num_steps=3), 1, 10) is not None
    assert len(decode_program._DECODE_PROGRAMS[model]) == 1
    release_programs(model)
    assert model not in decode_program._DECODE_PROGRAMS


def test_bench_check_compares_the_fast_path_with_eager(counter, capsys) -> None:
    """tools/bench_generate.py check (the GPU script's closeness point) on a CPU in fp32: equal logits."""
    bench = load_tool("bench_generate")
    shape = ["--dim", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--vocab", "64"]
    bench.main(["check", *shape, "--dtype", "float32", "--recurrences", "3", "--prompt-len", "4", "--new-tokens", "6"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("r=3 batch 2 float32 cpu: fast vs eager over 6 teacher-forced tokens"), line
    assert float(line.split("max |logit difference| ")[1].split()[0]) < 1e-4
    assert line.endswith("argmax agreement 100.0%")


@pytest.mark.parametrize("compile", [False, True])
def test_a_cache_the_device_cannot_hold_is_refused_in_one_line_before_allocation(model, monkeypatch, compile) -> None:
    """Batch 64 at 2k columns and r = 32 is tens of GiB: the program is refused before its cache is allocated."""
    from titan_recur.models.cache import KVCache
    from titan_recur.utils import limits

    monkeypatch.setattr(limits, "available_memory", lambda device: 1000)
    allocated = []
    monkeypatch.setattr(KVCache, "__init__", lambda *a, **kw: allocated.append(1))
    ids, mask = prompts()
    with pytest.raises(ValueError) as err:
        generate(model, ids, GenerationOptions(max_new_tokens=40, num_steps=4, compile=compile), attention_mask=mask)
    message = str(err.value)
    rows, columns = (4, 128) if compile else (3, 49)  # compiled: the batch bucket and the capacity step
    assert message.startswith(
        f"the decode KV cache of {rows} rows x {columns} columns at r = 4 (kv_sharing full) needs"
    )
    assert message.endswith(
        "but cpu has 0.0 GiB free; use fewer rows or new tokens, or kv_sharing 'latest' / 'compress-N'"
    )
    assert "\n" not in message and allocated == []


def test_a_failed_cuda_graph_capture_falls_back_to_the_uncompiled_step(model, counter, monkeypatch, caplog) -> None:
    """Where capture fails (a GPU without graph support, an op that cannot be captured), the program warns once
    and decodes uncompiled, with the same tokens and logits; exercised here with the capture forced to fail."""

    def capture_fails(segments):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(decode_program.DecodeProgram, "_captures", lambda self: True)
    monkeypatch.setattr(decode_program, "_capture_graphs", capture_fails)
    ids, mask = prompts()
    options = GenerationOptions(max_new_tokens=8, num_steps=3)
    with caplog.at_level("WARNING", logger=decode_program.__name__):
        fast = generate(model, ids, dataclasses.replace(options, compile=True), attention_mask=mask, return_logits=True)
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graph capture failed (CUDA error: operation not permitted when stream is capturing); "
        "this program decodes uncompiled"
    ]
    (program,) = decode_program._DECODE_PROGRAMS[model].values()
    assert not program.compiled and not program.graphs and program.describe().endswith("uncompiled")
    assert_same(generate(model, ids, options, attention_mask=mask, return_logits=True), fast)


def test_another_temperature_top_p_or_eos_compiles_nothing_new(model, counter) -> None:
    """The sampling values and the EOS id are device tensors of the program: a second generation with other
    values reuses its graphs and gives the uncompiled step's tokens and logits."""
    ids, mask = prompts()
    first = GenerationOptions(max_new_tokens=10, num_steps=3, temperature=0.8, top_p=0.9, seed=3, eos_id=5)
    generate(model, ids, dataclasses.replace(first, compile=True), attention_mask=mask)
    compiled = counter.graphs
    second = dataclasses.replace(first, temperature=0.5, top_p=0.7, eos_id=7)
    fast = generate(model, ids, dataclasses.replace(second, compile=True), attention_mask=mask, return_logits=True)
    assert counter.graphs == compiled, "another sampling value or EOS id recompiled"
    assert len(decode_program._DECODE_PROGRAMS[model]) == 1
    assert_same(generate(model, ids, second, attention_mask=mask, return_logits=True), fast, compare_logits=False)
