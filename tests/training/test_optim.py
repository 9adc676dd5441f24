"""Muon vs torch.optim.Muon, parameter roles, fused matrices, WSD schedule, state round trip, clipping."""

import copy
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.utils.flop_counter import FlopCounterMode

from tests.tiny_models import tiny_args
from tests.tiny_models import tiny_model as shared_tiny_model
from titan_recur.config import LRScheduler, Optimizer
from titan_recur.models import RecurrentLM, cross_entropy_loss
from titan_recur.training.optim import (
    NS_COEFFICIENTS,
    NS_DTYPES,
    Muon,
    assign_owners,
    build_optimizers,
    clip_coefficient,
    fused_matrix_groups,
    grad_square_sum,
    newton_schulz_dtype,
    scale_grads_,
    shard_rows,
    split_params_for_muon,
    wsd_factor,
    zeropower_via_newtonschulz,
)

SHAPES = [(8, 5), (5, 8), (6, 6), (1, 4), (12, 3)]


def tiny_model(tie: bool = False, seed: int = 0) -> RecurrentLM:
    return shared_tiny_model(tiny_args(64, tie_embeddings=tie, state_init="zero"), seed)


def optimizer_cfg(**overrides) -> Optimizer:
    values = dict(
        name="muon",
        lr=1e-2,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        weight_decay=1e-4,
        fuse_qkv=False,
        adamw_lr=1e-3,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-8,
        adamw_weight_decay=1e-4,
    )
    return Optimizer(**{**values, **overrides})


def scheduler_cfg(**overrides) -> LRScheduler:
    values = dict(warmup_fraction=0.25, decay_fraction=0.5, decay_type="cosine", min_lr_factor=0.1)
    return LRScheduler(**{**values, **overrides})


def train_step(model: RecurrentLM, container, seed: int) -> None:
    ids = torch.randint(0, model.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = cross_entropy_loss(model(ids[:, :-1], (1, 2)), ids[:, 1:])
    loss.backward()
    container.step()
    container.step_schedulers()
    container.zero_grad()


# ---------------------------------------------------------------- Muon


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_bit_exact_with_torch_muon(nesterov: bool) -> None:
    """Same ops in the same order, so equality is exact (tolerance 0), not merely close (Newton-Schulz in
    bf16 as torch's; on CPU ours defaults to float32, below)."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    opt_ours = Muon(ours, ns_dtype=torch.bfloat16, **kwargs)
    opt_theirs = torch.optim.Muon(theirs, adjust_lr_fn="original", **kwargs)
    for _ in range(5):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt_ours.state[a]["momentum_buffer"], opt_theirs.state[b]["momentum_buffer"])


def test_muon_defaults_follow_spec() -> None:
    defaults = Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults
    assert (defaults["lr"], defaults["momentum"], defaults["nesterov"]) == (1e-3, 0.95, True)
    assert (defaults["weight_decay"], defaults["ns_steps"]) == (1e-4, 5)
    assert defaults["ns_coefficients"] == (3.4445, -4.7750, 2.0315)


def test_newton_schulz_in_float32_on_cpu_unless_configured() -> None:
    """bf16 matmuls are ~50x slower than float32 on CPUs without AVX512-BF16/AMX: CPU parameters get
    float32 (closer to the float64 iteration than bf16), accelerators bf16; the config can force either."""
    cpu = torch.nn.Parameter(torch.zeros(2, 2))
    assert Muon([cpu]).ns_dtype == torch.float32
    assert Muon([cpu], ns_dtype=torch.bfloat16).ns_dtype == torch.bfloat16
    assert newton_schulz_dtype(torch.device("cuda")) == torch.bfloat16
    torch.manual_seed(0)
    update = torch.randn(24, 40)
    exact = zeropower_via_newtonschulz(update, NS_COEFFICIENTS, 5, 1e-7, torch.float64)
    errors = {
        dtype: (zeropower_via_newtonschulz(update, NS_COEFFICIENTS, 5, 1e-7, dtype).double() - exact).abs().max()
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert errors[torch.float32] < 1e-5 < errors[torch.bfloat16]
    model = tiny_model()
    for name, dtype in NS_DTYPES.items():
        container = build_optimizers(model, optimizer_cfg(ns_dtype=name), scheduler_cfg(), 10)
        assert container.optimizers[container.names.index("muon")].ns_dtype == dtype
    auto = build_optimizers(model, optimizer_cfg(), scheduler_cfg(), 10)
    assert auto.optimizers[auto.names.index("muon")].ns_dtype == torch.float32


def test_muon_rejects_non_matrix_with_name_and_shape() -> None:
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(32,\)"):
        Muon([("a.weight", torch.nn.Parameter(torch.zeros(3, 3))), ("norm.weight", torch.nn.Parameter(torch.ones(32)))])
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\)"):
        Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])


def test_fused_group_equals_concatenated_matrix() -> None:
    """q, k, v fused = one (8, 6) parameter holding their rows, scale factor sqrt(8 / 6) included."""
    torch.manual_seed(1)
    q, k, v = (torch.nn.Parameter(torch.randn(rows, 6)) for rows in (4, 2, 2))
    other = torch.nn.Parameter(torch.randn(3, 6))
    fused = torch.nn.Parameter(torch.cat([q, k, v]).detach())
    other_ref = torch.nn.Parameter(other.detach().clone())
    opt = Muon([q, k, v, other], lr=0.05, fuse_groups=[[q, k, v]], ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([fused, other_ref], lr=0.05, weight_decay=1e-4, adjust_lr_fn="original")
    for _ in range(4):
        grads = [torch.randn(p.shape) for p in (q, k, v, other)]
        for p, g in zip((q, k, v, other), grads, strict=True):
            p.grad = g
        fused.grad, other_ref.grad = torch.cat(grads[:3]), grads[3].clone()
        opt.step()
        ref.step()
    assert torch.equal(torch.cat([q, k, v]), fused)
    assert torch.equal(other, other_ref)


def test_orthogonalisation_flops_equal_torchs_flop_counter() -> None:
    """The optimizer's FLOPs bench_step reports: every unit's Newton-Schulz matmuls, fused q,k,v counted
    as one matrix, as torch's FLOP counter counts the function itself."""
    q, k, v = (torch.nn.Parameter(torch.randn(rows, 6)) for rows in (4, 2, 2))
    tall, wide = torch.nn.Parameter(torch.randn(12, 3)), torch.nn.Parameter(torch.randn(3, 7))
    opt = Muon([q, k, v, tall, wide], ns_steps=3, fuse_groups=[[q, k, v]])
    with FlopCounterMode(display=False) as counter:
        for update in (torch.cat([q, k, v]), tall, wide):
            zeropower_via_newtonschulz(update.detach(), (3.4445, -4.7750, 2.0315), 3, 1e-7)
    assert opt.orthogonalisation_flops() == counter.get_total_flops() > 0


def test_fuse_group_validation() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="column counts"):
        Muon([a, b], fuse_groups=[[a, b]])
    with pytest.raises(ValueError, match="does not optimise"):
        Muon([a], fuse_groups=[[a, torch.nn.Parameter(torch.zeros(1, 3))]])


def test_shard_rows_and_owners() -> None:
    assert shard_rows(5, 4) == [2, 2, 1, 0]
    assert shard_rows(47, 2) == [24, 23]
    assert shard_rows(1, 2) == [1, 0]
    assert assign_owners([1, 9, 4, 4], 2) == [1, 0, 1, 1]


# ---------------------------------------------------------------- parameter roles


@pytest.mark.parametrize("tie", [False, True])
def test_split_params_by_role(tie: bool) -> None:
    model = tiny_model(tie)
    muon, adamw = split_params_for_muon(model)
    muon_names, adamw_names = [n for n, _ in muon], [n for n, _ in adamw]
    block_matrices = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    blocks = ["prelude.0", "core.blocks.0", "core.blocks.1", "coda.0"]
    assert sorted(muon_names) == sorted(["core.adapter.weight"] + [f"{b}.{m}" for b in blocks for m in block_matrices])
    norms = [f"{b}.{n}.weight" for b in blocks for n in ("input_layernorm", "post_attention_layernorm")]
    expected_adamw = ["embed_tokens.weight", "norm.weight", *norms] + ([] if tie else ["lm_head.weight"])
    assert sorted(adamw_names) == sorted(expected_adamw)
    all_ids = [id(p) for _, p in muon + adamw]
    assert len(all_ids) == len(set(all_ids)) == len({id(p) for p in model.parameters()})


def test_fused_matrix_groups_of_model() -> None:
    model = tiny_model()
    groups = fused_matrix_groups(model)
    assert len(groups) == 2 * 4
    assert [[tuple(p.shape) for p in g] for g in groups[:2]] == [[(32, 32), (16, 32), (16, 32)], [(48, 32), (48, 32)]]
    assert groups[2][0] is model.core.blocks[0].self_attn.q_proj.weight


# ---------------------------------------------------------------- schedule


def test_wsd_factor_boundaries() -> None:
    def f(step, decay_type="cosine", warmup=0.1, decay=0.5):
        return wsd_factor(step, 100, warmup, decay, decay_type, 0.01)

    assert f(0) == 0.01
    assert f(5) == pytest.approx(0.01 + 0.99 * 0.5)
    # transformers' get_wsd_schedule (the reference's): decay progress (step - 50) / 50 over steps 50..100.
    assert f(10) == 1.0 and f(49) == 1.0 and f(50) == 1.0
    assert f(51) == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi / 50)))
    assert f(75, "linear") == pytest.approx(0.01 + 0.99 * 0.5)
    assert f(99) == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 49 / 50)))
    assert f(99, "linear") == pytest.approx(0.01 + 0.99 / 50)
    assert f(100) == pytest.approx(0.01, abs=1e-15) and f(150) == pytest.approx(0.01, abs=1e-15)
    assert f(0, warmup=0.0) == 1.0 and f(99, decay=0.0) == 1.0
    assert f(7, warmup=0.07) == 1.0  # 0.07 * 100 = 7.000000000000001 must still mean 7 warmup steps
    assert f(5, warmup=0.6, decay=0.6) == pytest.approx(0.01 + 0.99 * 5 / 60)  # overlap: the smaller factor
    with pytest.raises(ValueError, match="decay_type"):
        wsd_factor(0, 10, 0.1, 0.1, "step", 0.0)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_schedulers_follow_wsd() -> None:
    model = tiny_model()
    cfg = scheduler_cfg(warmup_fraction=0.3, decay_fraction=0.3, min_lr_factor=0.1)
    container = build_optimizers(model, optimizer_cfg(), cfg, total_steps=10)
    for step in range(12):
        factor = wsd_factor(step, 10, 0.3, 0.3, "cosine", 0.1)
        assert container.current_lrs() == pytest.approx({"muon": 1e-2 * factor, "adamw": 1e-3 * factor})
        container.step_schedulers()


# ---------------------------------------------------------------- container


def test_build_optimizers_modes() -> None:
    model = tiny_model(tie=True)
    container = build_optimizers(model, optimizer_cfg(fuse_qkv=True), scheduler_cfg(), total_steps=10)
    assert container.names == ["muon", "adamw"]
    muon, adamw = container.optimizers
    assert isinstance(muon, Muon) and type(adamw) is torch.optim.AdamW
    assert len(muon.fuse_groups) == 8
    assert adamw.defaults["betas"] == (0.9, 0.95)
    covered = [id(p) for opt in container.optimizers for g in opt.param_groups for p in g["params"]]
    assert sorted(covered) == sorted(id(p) for p in model.parameters())

    only = build_optimizers(model, optimizer_cfg(name="adamw"), scheduler_cfg(), total_steps=10)
    assert only.names == ["adamw"] and only.current_lrs() == {"adamw": pytest.approx(1e-3 * 0.1)}
    assert len(only.optimizers[0].param_groups[0]["params"]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizers(model, optimizer_cfg(name="sgd"), scheduler_cfg(), total_steps=10)


def test_training_steps_run_and_decrease_loss() -> None:
    model = tiny_model()
    container = build_optimizers(model, optimizer_cfg(fuse_qkv=True), scheduler_cfg(), total_steps=20)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = cross_entropy_loss(model(ids[:, :-1], (1, 2)), ids[:, 1:])
        loss.backward()
        container.step()
        container.step_schedulers()
        container.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("fuse", [False, True])
def test_state_round_trip_through_dcp_state_dict(fuse: bool) -> None:
    """Saved after 2 steps and restored into fresh optimizers, step 3 matches exactly."""
    model = tiny_model()
    container = build_optimizers(model, optimizer_cfg(fuse_qkv=fuse), scheduler_cfg(), total_steps=10)
    for seed in range(2):
        train_step(model, container, seed)
    saved_optim = [copy.deepcopy(get_optimizer_state_dict(model, opt)) for opt in container.optimizers]
    saved_sched = copy.deepcopy(container.state_dict())
    muon_state = saved_optim[0]["state"]
    assert set(muon_state["core.adapter.weight"]) == {"momentum_buffer"}
    assert "prelude.0.self_attn.q_proj.weight" in muon_state and "embed_tokens.weight" not in muon_state

    restored = copy.deepcopy(model)
    fresh = build_optimizers(restored, optimizer_cfg(fuse_qkv=fuse), scheduler_cfg(), total_steps=10)
    for opt, state in zip(fresh.optimizers, saved_optim, strict=True):
        set_optimizer_state_dict(restored, opt, state)
    fresh.load_state_dict(saved_sched)
    assert fresh.current_lrs() == container.current_lrs()
    train_step(model, container, seed=2)
    train_step(restored, fresh, seed=2)
    for (name, a), b in zip(model.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------- clipping


def test_clipping_matches_torch() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref, strict=True):
        p.grad = torch.randn(p.shape)
        r.grad = p.grad.clone()
    norm = grad_square_sum(params).sqrt()
    scale_grads_(params, clip_coefficient(norm.item(), 1.0))
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref, 1.0), atol=0, rtol=1e-6)
    assert norm > 1.0
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=0, rtol=1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0


def test_grad_norm_of_non_finite_grads_is_non_finite() -> None:
    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.tensor([[1.0, float("inf")], [0.0, 1.0]])
    assert torch.isinf(grad_square_sum([p]))
    p.grad = torch.tensor([[1.0, float("nan")], [0.0, 1.0]])
    assert torch.isnan(grad_square_sum([p]))
