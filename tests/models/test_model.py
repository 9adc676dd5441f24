"""The depth-recurrent LM (docs/method.md): recurrence semantics, truncated backprop, checkpointing,
cached/padded generation, static and tied variants, save/load, num_steps and state init, and the
blocks against transformers' own Llama / OLMo-2 decoder layers.

Every model here is tiny and fp32 (CPU, whole file in a few seconds) and built inline.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.tiny_models import tiny_args as shared_tiny_args
from tests.tiny_models import tiny_model
from titan_recur.inference.engine import greedy_generate
from titan_recur.models.args import ModelArgs
from titan_recur.models.blocks import AttentionContext, TransformerBlock
from titan_recur.models.families import BLOCK_TYPES, FAMILIES
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.models.model import Decoding, RecurrentLM, resolve_num_steps
from titan_recur.models.rope import rope_cos_sin, rope_inverse_frequencies
from titan_recur.storage.manifest import seal_folder
from titan_recur.storage.model_io import WEIGHTS_NAME, load_model, save_model

VOCAB = 97
PAD = 0

GROUPS = {
    "prelude": ("embed_tokens.", "prelude."),
    "loop": ("core.",),
    "head": ("coda.", "norm.", "lm_head."),
}


def tiny_args(**overrides) -> ModelArgs:
    return shared_tiny_args(**{"vocab_size": VOCAB, "max_seq_len": 64, **overrides})


def build(seed: int = 0, std: float = 0.02, **overrides) -> RecurrentLM:
    return tiny_model(tiny_args(**overrides), seed, std)


def tokens(bsz: int = 2, seqlen: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (bsz, seqlen), generator=g)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def loss_and_grads(model: RecurrentLM, x: torch.Tensor, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = fn()
    loss = cross_entropy_loss(logits[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), grads(model)


def group_of(name: str) -> str:
    return next(g for g, prefixes in GROUPS.items() if name.startswith(prefixes))


def count_saved_tensors(fn):
    """Run fn with autograd's pack hook counting every tensor saved for backward."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return count, out


def manual_forward(model: RecurrentLM, x: torch.Tensor, n: int, k: int, prefix_mode: str) -> torch.Tensor:
    """The recurrent forward written out by hand; prefix_mode says how the first n iterations run.

    "no_grad": under torch.no_grad, then detached; "detach": with grad, output detached;
    "grad": with grad, nothing detached (full backprop through all n + k iterations).
    """
    ctx = model.attention_context(x, None, None, None)
    e = model.embed_tokens(x)
    for block in model.prelude:
        e = block(e, ctx)
    state = torch.zeros_like(e)

    def iterate(s: torch.Tensor) -> torch.Tensor:
        """s_i = Core(A [s_{i-1}; e]), straight from docs/method.md §1."""
        h = model.core.adapter(torch.cat([s, e], dim=-1))
        for block in model.core.blocks:
            h = block(h, ctx)
        return h

    if prefix_mode == "no_grad":
        with torch.no_grad():
            for _ in range(n):
                state = iterate(state)
        state = state.detach()
    else:
        for _ in range(n):
            state = iterate(state)
        if prefix_mode == "detach":
            state = state.detach()
    for _ in range(k):
        state = iterate(state)
    h = state
    for block in model.coda:
        h = block(h, ctx)
    return model.head(model.norm(h))


# --- 1. identity vs random adapter ------------------------------------------------------------


def test_identity_adapter_output_independent_of_depth_and_state_init():
    """A = [0 | I] multiplies the state by zero, so every iteration computes Core(e) from the same
    input e: s_r = Core(e) for every r and every s_0. The output therefore cannot depend on r or on
    the state init, and at r = 1 it is the plain block stack prelude -> core -> coda.
    """
    model = build(seed=0, std=0.1).eval()
    x = tokens()
    with torch.no_grad():
        reference = model(x, 1, state_init="zero")
        for r in (1, 2, 4, 8):
            for init in ("normal", "zero", "embed"):
                torch.testing.assert_close(model(x, r, state_init=init), reference, atol=1e-6, rtol=0)
        # r = 1 is the source model restricted to its kept layers, in order.
        ctx = model.attention_context(x, None, None, None)
        h = model.embed_tokens(x)
        for block in [*model.prelude, *model.core.blocks, *model.coda]:
            h = block(h, ctx)
        torch.testing.assert_close(model.head(model.norm(h)), reference, atol=1e-6, rtol=1e-5)


def test_random_adapter_output_depends_on_depth_and_state_init():
    """With a random A the state is fed back, so each extra iteration and each s_0 changes the output."""
    model = build(seed=0, std=0.1, adapter_init="random").eval()
    x = tokens()
    with torch.no_grad():
        by_r = {r: model(x, r, state_init="zero") for r in (1, 2, 4, 8)}
        for a in by_r:
            for b in by_r:
                if a < b:
                    assert (by_r[a] - by_r[b]).abs().max() > 1e-4, (a, b)
        for r in (1, 4):
            outs = {init: model(x, r, state_init=init) for init in ("normal", "zero", "embed")}
            assert (outs["normal"] - outs["zero"]).abs().max() > 1e-4
            assert (outs["zero"] - outs["embed"]).abs().max() > 1e-4
            assert (outs["normal"] - outs["embed"]).abs().max() > 1e-4


# --- 2. truncated backprop ---------------------------------------------------------------------


def test_truncated_backprop_matches_manual_loop():
    """(n, k): gradients of prelude, adapter and core come only from the last k iterations."""
    model = build(seed=0, std=0.1, adapter_init="random")
    x = tokens()
    n, k = 3, 2
    loss, got = loss_and_grads(model, x, lambda: model(x, (n, k), state_init="zero"))
    loss_m, manual = loss_and_grads(model, x, lambda: manual_forward(model, x, n, k, "no_grad"))
    _, detached = loss_and_grads(model, x, lambda: manual_forward(model, x, n, k, "detach"))
    _, full = loss_and_grads(model, x, lambda: manual_forward(model, x, n, k, "grad"))
    torch.testing.assert_close(loss, loss_m, atol=1e-6, rtol=0)
    for name in got:
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], manual[name], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(got[name], detached[name], atol=1e-6, rtol=0, msg=name)
    # The check discriminates: full backprop through all n + k iterations changes exactly the
    # gradients upstream of the loop's output (forward values are the same, so coda/head agree).
    for name in got:
        diff = (got[name] - full[name]).abs().max().item()
        if group_of(name) == "head":
            assert diff < 1e-6, name
        else:
            assert diff > 1e-4, name
    # And through the model itself: (0, n + k) is full backprop.
    _, model_full = loss_and_grads(model, x, lambda: model(x, (0, n + k), state_init="zero"))
    torch.testing.assert_close(model_full["core.adapter.weight"], full["core.adapter.weight"], atol=1e-6, rtol=0)


def test_no_grad_prefix_keeps_no_graph():
    model = build(seed=0, std=0.1, adapter_init="random")
    x = tokens()
    seen = []

    def spy(module, inputs, out):
        seen.append((len(seen), inputs[0], out, torch.is_grad_enabled()))

    hook = model.core.iteration.register_forward_hook(spy)
    n, k = 4, 2
    model(x, (n, k), state_init="embed")
    assert [i for i, *_ in seen] == list(range(n + k))
    for i, _state_in, out, grad_on in seen:
        if i < n:
            assert not grad_on and not out.requires_grad and out.grad_fn is None, i
        else:
            assert grad_on and out.grad_fn is not None, i
    # the state entering the first grad iteration carries no graph
    first_grad_input = seen[n][1]
    assert not first_grad_input.requires_grad and first_grad_input.grad_fn is None
    hook.remove()

    # Saved activations depend on k only, not on the no-grad prefix n.
    def saved(steps):
        return count_saved_tensors(lambda: model(x, steps, state_init="zero"))[0]

    base = saved((1, 2))
    assert saved((6, 2)) == base
    assert saved((0, 2)) == base
    assert saved((1, 4)) > base  # the counter does see grad iterations


def test_eval_int_steps_runs_without_grad_through_the_loop():
    model = build(seed=0, adapter_init="random").eval()
    x = tokens()
    logits = model(x, 3, state_init="zero")
    cross_entropy_loss(logits[:, :-1], x[:, 1:]).backward()
    for name, p in model.named_parameters():
        if group_of(name) == "head":
            assert p.grad is not None, name
        else:
            assert p.grad is None, name


def test_train_mode_int_steps_train_every_part_with_truncated_backprop():
    """In train mode with grad, r means r iterations whose last min(r, 8) carry grad: (n, k) = (r - 8, 8) for r > 8."""
    model = build(seed=0, adapter_init="random")
    x = tokens()
    for r, expected in ((3, (0, 3)), (10, (2, 8))):
        model.zero_grad()
        logits = model(x, r, state_init="zero")
        cross_entropy_loss(logits[:, :-1], x[:, 1:]).backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        cross_entropy_loss(model(x, expected, state_init="zero")[:, :-1], x[:, 1:]).backward()
        for grad, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(grad, p.grad, atol=0, rtol=0)
        with torch.no_grad():
            torch.testing.assert_close(logits, model(x, r, state_init="zero"), atol=0, rtol=0)


# --- 3. per-iteration activation checkpointing -------------------------------------------------


@pytest.mark.parametrize("steps", [(0, 3), (2, 3)])
def test_checkpoint_iterations_exact_and_saves_less(steps):
    model = build(seed=0, std=0.1, adapter_init="random")
    x = tokens()

    def run():
        return count_saved_tensors(lambda: model(x, steps, state_init="embed"))

    model.zero_grad(set_to_none=True)
    saved_plain, logits = run()
    loss_plain = cross_entropy_loss(logits[:, :-1], x[:, 1:])
    loss_plain.backward()
    g_plain = grads(model)

    model.core.iteration = checkpoint_wrapper(model.core.iteration, preserve_rng_state=False)
    model.zero_grad(set_to_none=True)
    saved_ckpt, logits = run()
    loss_ckpt = cross_entropy_loss(logits[:, :-1], x[:, 1:])
    loss_ckpt.backward()
    g_ckpt = grads(model)

    torch.testing.assert_close(loss_ckpt, loss_plain, atol=1e-6, rtol=0)
    for name in g_plain:
        assert g_plain[name] is not None and g_ckpt[name] is not None, name
        torch.testing.assert_close(g_ckpt[name], g_plain[name], atol=1e-6, rtol=0, msg=name)
    assert saved_ckpt < saved_plain


# --- 4. cached and left-padded generation ------------------------------------------------------


# Logits here reach |4| after up to 4 iterations of std-0.2 blocks; padded/cached vs plain fp32
# forwards differ by <= 9e-6 (different matmul shapes), a wrong mask or cache slot by > 1e-1.
TOL = 3e-5


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    return ids, mask


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (length,), generator=g) for length in (3, 9, 6)]


@pytest.mark.parametrize("block_type", ["llama", "olmo2"])
@pytest.mark.parametrize("r", [1, 4])
def test_batched_left_padded_generation_equals_single(r, block_type):
    model = build(seed=3, std=0.2, adapter_init="random", block_type=block_type).eval()
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    batched = greedy_generate(model, ids, 8, attention_mask=mask, num_steps=r)
    singles = [greedy_generate(model, p[None], 8, num_steps=r)[0] for p in prompts]
    for row, single in enumerate(singles):
        assert batched[row].tolist() == single.tolist(), row
    assert len({tuple(s.tolist()) for s in singles}) > 1  # the prompts matter

    # Full (uncached) padded forward: each row's real positions equal that row alone.
    with torch.no_grad():
        logits = model(ids, r, attention_mask=mask, state_init="zero")
        for row, p in enumerate(prompts):
            alone = model(p[None], r, state_init="zero")[0]
            torch.testing.assert_close(logits[row, -len(p) :], alone, atol=TOL, rtol=0)


@pytest.mark.parametrize("block_type", ["llama", "olmo2"])
def test_incremental_decoding_matches_full_forward(block_type):
    model = build(seed=4, std=0.2, adapter_init="random", block_type=block_type).eval()
    r = 3
    seq = tokens(bsz=2, seqlen=11, seed=9)
    prefill = 4
    with torch.no_grad():
        full = model(seq, r, state_init="zero")
        cache = model.new_cache(2, prefill, num_steps=r)  # too small: it grows as decoding goes
        out = model(seq[:, :prefill], r, state_init="zero", decoding=Decoding(cache=cache))
        torch.testing.assert_close(out, full[:, :prefill], atol=TOL, rtol=0)
        for t in range(prefill, seq.shape[1]):
            out = model(seq[:, t : t + 1], r, state_init="zero", decoding=Decoding(cache=cache))
            torch.testing.assert_close(out[:, 0], full[:, t], atol=TOL, rtol=0, msg=f"step {t}")
        assert cache.length == seq.shape[1]
        # one KV slot per prelude block, per (core block, iteration), per coda block
        assert cache.num_layer_slots == model.args.n_prelude + model.args.n_core * r + model.args.n_coda


# --- 5. static model ---------------------------------------------------------------------------


def test_static_model():
    static = build(seed=0, n_core=0, n_prelude=2, n_coda=1)
    assert static.core is None and not static.args.is_recurrent
    names = [n for n, _ in static.named_parameters()]
    assert not any("core" in n or "adapter" in n for n in names)
    total = sum(p.numel() for p in static.parameters())
    parts = [static.embed_tokens, *static.prelude, *static.coda, static.norm, static.lm_head]
    assert total == sum(p.numel() for m in parts for p in m.parameters())
    recurrent = build(seed=0, n_core=2, n_prelude=2, n_coda=1)
    block = sum(p.numel() for p in static.prelude[0].parameters())
    adapter = 2 * 32 * 32
    assert sum(p.numel() for p in recurrent.parameters()) == total + 2 * block + adapter

    x = tokens()
    with torch.no_grad():
        out = static(x)
        assert out.shape == (2, 12, VOCAB)
        for steps in (1, 5, (2, 3)):
            torch.testing.assert_close(static(x, steps), out, atol=0, rtol=0)
        ctx = static.attention_context(x, None, None, None)
        h = static.embed_tokens(x)
        for blk in [*static.prelude, *static.coda]:
            h = blk(h, ctx)
        torch.testing.assert_close(static.head(static.norm(h)), out, atol=1e-6, rtol=1e-5)
    # it trains: all params get grads
    cross_entropy_loss(static(x)[:, :-1], x[:, 1:]).backward()
    assert all(p.grad is not None for p in static.parameters())


# --- 6. tied embeddings, save / load -----------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path, tied):
    model = build(seed=2, std=0.1, adapter_init="random", tie_embeddings=tied).eval()
    if tied:  # tying is structural: no head of its own, logits come from the embedding matrix
        assert model.lm_head is None
        h = torch.randn(3, 32)
        torch.testing.assert_close(model.head(h), h @ model.embed_tokens.weight.T, atol=0, rtol=0)
    else:
        assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
        assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    save_model(model, tmp_path / "m")
    stored = load_file(str(tmp_path / "m" / WEIGHTS_NAME))
    assert ("lm_head.weight" in stored) == (not tied)
    loaded = load_model(tmp_path / "m")
    assert loaded.args == model.args
    assert (loaded.lm_head is None) == tied
    x = tokens()
    with torch.no_grad():
        for r in (1, 3):
            assert torch.equal(loaded(x, r, state_init="zero"), model(x, r, state_init="zero"))


def test_load_model_names_mismatched_tensor(tmp_path):
    model = build(seed=0)
    save_model(model, tmp_path / "m")
    path = tmp_path / "m" / WEIGHTS_NAME
    state = load_file(str(path))
    state["core.blocks.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(state, str(path))
    seal_folder(tmp_path / "m", "trained")  # consistent files (the manifest would catch a hand edit first)
    with pytest.raises(ValueError, match=re.escape("core.blocks.1.self_attn.k_proj.weight")):
        load_model(tmp_path / "m")

    # a config that disagrees with the weights: named too
    save_model(model, tmp_path / "n")
    config_path = tmp_path / "n" / "config.json"
    config = json.loads(config_path.read_text())
    config["titan_recur"]["vocab_size"] = VOCAB + 1
    config_path.write_text(json.dumps(config))
    seal_folder(tmp_path / "n", "trained")
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        load_model(tmp_path / "n")

    # a missing tensor is named
    save_model(model, tmp_path / "o")
    path = tmp_path / "o" / WEIGHTS_NAME
    state = load_file(str(path))
    del state["coda.0.mlp.up_proj.weight"]
    save_file(state, str(path))
    seal_folder(tmp_path / "o", "trained")
    with pytest.raises(ValueError, match=re.escape("coda.0.mlp.up_proj.weight")):
        load_model(tmp_path / "o")


def test_load_model_low_precision_keeps_fp32_rope(tmp_path):
    """Module.to(dtype) casts float buffers too; RoPE frequencies rounded to bf16 put the phase off
    by up to ~1 rad per 1000 positions. transformers keeps them fp32; so must we."""
    model = build(seed=0, head_dim=16, rope_theta=500000.0)
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m", dtype=torch.bfloat16)
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.rope_inv_freq("cpu").dtype == torch.float32
    assert torch.equal(loaded.rope_inv_freq("cpu"), model.rope_inv_freq("cpu"))


# --- 7. num_steps ------------------------------------------------------------------------------


def test_resolve_num_steps():
    args = tiny_args(mean_recurrence=5)
    assert resolve_num_steps(None, args) == (5, 0)
    assert resolve_num_steps(3, args) == (3, 0)
    assert resolve_num_steps((2, 4), args) == (2, 4)
    assert resolve_num_steps((0, 1), args) == (0, 1)
    assert resolve_num_steps([1, 0], args) == (1, 0)
    for bad in ((0, 0), 0, -1, (-1, 2), (2, -1)):
        with pytest.raises(ValueError):
            resolve_num_steps(bad, args)


def test_forward_default_depth_is_mean_recurrence():
    model = build(seed=0, std=0.1, adapter_init="random", mean_recurrence=3).eval()
    x = tokens()
    calls = []
    model.core.iteration.register_forward_hook(lambda module, inputs, out: calls.append(len(calls)))
    with torch.no_grad():
        default = model(x, state_init="zero")
        assert calls == [0, 1, 2]
        torch.testing.assert_close(default, model(x, 3, state_init="zero"), atol=0, rtol=0)
        assert (default - model(x, 1, state_init="zero")).abs().max() > 1e-4
        calls.clear()
        model(x, (2, 5), state_init="zero")
        assert calls == list(range(7))


# --- 8. state init -----------------------------------------------------------------------------


def _truncated_std(sigma: float, bound: float = 3.0) -> float:
    phi = math.exp(-(bound**2) / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(bound / math.sqrt(2))
    return sigma * math.sqrt(1 - 2 * bound * phi / mass)


@pytest.mark.parametrize("state_std", [None, 0.5])
def test_normal_state_init(state_std):
    model = build(seed=0, state_std=state_std)
    sigma = model.args.effective_state_std
    expected = math.sqrt(2 / (5 * 32)) if state_std is None else state_std
    assert sigma == pytest.approx(expected)
    embedded = torch.randn(16, 128, 32) * 7.0
    torch.manual_seed(11)
    state = model.core.initial_state(embedded, "normal")
    assert state.shape == embedded.shape and state.dtype == embedded.dtype
    assert abs(state.mean().item()) < 0.02 * sigma
    # truncated at +-3 sigma: std is 0.9866 sigma (sampling error ~0.3% at 65k draws)
    assert state.std().item() == pytest.approx(_truncated_std(sigma), rel=0.01)
    assert state.abs().max().item() <= 3 * sigma + 1e-7
    assert state.abs().max().item() > 2.8 * sigma
    # fresh draws each call
    assert not torch.equal(state, model.core.initial_state(embedded, "normal"))


def test_zero_and_embed_state_init_and_default_from_args():
    model = build(seed=0)
    embedded = torch.randn(2, 5, 32)
    assert torch.equal(model.core.initial_state(embedded, "zero"), torch.zeros_like(embedded))
    assert torch.equal(model.core.initial_state(embedded, "embed"), embedded)

    model = build(seed=0, std=0.1, adapter_init="random", state_init="embed").eval()
    x = tokens()
    with torch.no_grad():
        default = model(x, 2)
        torch.testing.assert_close(default, model(x, 2, state_init="embed"), atol=0, rtol=0)
        assert (default - model(x, 2, state_init="zero")).abs().max() > 1e-4
    with pytest.raises(ValueError):
        tiny_args(state_init="uniform")


# --- 10. blocks vs transformers ----------------------------------------------------------------


def _causal_additive_mask(seqlen: int) -> torch.Tensor:
    mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
    return mask[None, None]


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_block_matches_transformers_decoder_layer(block_type):
    """One block against the family's own transformers decoder layer (LlamaDecoderLayer, ...) with the same
    weights, biases and norms randomised.

    head_dim 16 with dim 32 and 4 heads makes n_heads*head_dim (64) differ from dim, so OLMo-2's
    QK-norm over the full projected q (64) and k (32) and Qwen3's per-head one (16) are told apart.
    """
    import importlib

    import transformers

    family = FAMILIES[block_type]
    prefix = family.config_class.removesuffix("Config")
    modeling = importlib.import_module(f"transformers.models.{block_type}.modeling_{block_type}")
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    eps = 1e-6
    args = tiny_args(head_dim=16, block_type=block_type, norm_eps=eps, rope_theta=500.0, rope_scaling=scaling)
    config = getattr(transformers, family.config_class)(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=eps,
        max_position_embeddings=256,
        attn_implementation="eager",
        rope_parameters={**scaling, "rope_theta": 500.0},
    )
    config.head_dim = 16
    layer = getattr(modeling, f"{prefix}DecoderLayer")(config, layer_idx=0)
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config)
    torch.manual_seed(0)
    block = TransformerBlock(args, ("prelude", 0))
    block.init_weights(0.2)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    layer.load_state_dict(block.state_dict(), strict=True)
    norm_sizes = {"none": None, "full": (64, 32), "per_head": (16, 16)}[family.qk_norm]
    if norm_sizes:
        assert (block.self_attn.q_norm.weight.numel(), block.self_attn.k_norm.weight.numel()) == norm_sizes

    x = torch.randn(2, 10, 32)
    position_ids = torch.arange(20, 30).expand(2, -1)
    inv_freq = rope_inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    cos, sin = rope_cos_sin(position_ids, inv_freq, torch.float32)
    hf_cos, hf_sin = rotary(x, position_ids)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0)
    with torch.no_grad():
        ours = block(x, AttentionContext(cos=cos, sin=sin))
        theirs = layer(x, attention_mask=_causal_additive_mask(10), position_embeddings=(hf_cos, hf_sin))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_meta_build_then_to_empty_keeps_the_head_tied():
    """The trainer builds on the meta device; materialising must not untie head and embedding."""
    with torch.device("meta"):
        model = RecurrentLM(tiny_args(tie_embeddings=True))
    model.to_empty(device="cpu")
    assert model.lm_head is None and [n for n, _ in model.named_parameters()].count("embed_tokens.weight") == 1
    assert model.rope_inv_freq("cpu").device.type == "cpu" and model.rope_inv_freq("cpu").dtype == torch.float32
