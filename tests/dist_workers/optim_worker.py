"""torchrun worker (2 ranks, gloo): distributed Muon + AdamW on an FSDP2 RecurrentLM vs one process.

Every rank also runs two unsharded copies on the full batch: `ref`, an independent single-process
run, and `synced`, fed the sharded run's (clipped) gradients so it isolates the optimizer. Rank 0
writes the measurements as JSON; the pytest side asserts on them.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from worker_util import finish

from titan_recur.config import LRScheduler, Optimizer
from titan_recur.models import ModelArgs, RecurrentLM, cross_entropy_loss
from titan_recur.training.optim import Muon, build_optimizers, clip_coefficient, grad_square_sum, scale_grads_

# (n_no_grad, k_grad) per step; the same on every rank.
NUM_STEPS = [(0, 1), (1, 2), (2, 1)]
GLOBAL_BATCH, SEQ_LEN = 4, 8
OPTIMIZER = dict(
    name="muon",
    lr=1e-2,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    weight_decay=1e-4,
    adamw_lr=1e-3,
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8,
    adamw_weight_decay=1e-4,
)
SCHEDULER = LRScheduler(warmup_fraction=0.0, decay_fraction=0.0, decay_type="cosine", min_lr_factor=0.1)


def build_model(tie: bool) -> RecurrentLM:
    """ffn_dim 47 and vocab 61 are odd: gate/up/down and the embedding shard unevenly over 2 ranks."""
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=61,
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=47,
        n_prelude=1,
        n_core=2,
        n_coda=1,
        tie_embeddings=tie,
        state_init="zero",
    )
    model = RecurrentLM(args)
    model.init_weights()
    return model


def shard_model(model: RecurrentLM, mesh: DeviceMesh) -> None:
    for block in model.once_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model.core, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    return max((full(a[n]) - b[n]).abs().max().item() for n in names)


@torch.no_grad()
def frobenius(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    return math.sqrt(sum((a[n] - b[n]).double().pow(2).sum().item() for n in names))


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op): n for op, n in mode.get_comm_counts().items() if n}


def loss_of(model: RecurrentLM, ids: torch.Tensor, num_steps: tuple[int, int]) -> torch.Tensor:
    return cross_entropy_loss(model(ids[:, :-1], num_steps), ids[:, 1:])


def clip_grads(model: RecurrentLM, max_norm: float, sharded: bool) -> torch.Tensor:
    """The trainer's clipping: squared shard norms summed over ranks (there with the step's other scalars)."""
    params = list(model.parameters())
    square_sum = grad_square_sum(params)
    if sharded:
        dist.all_reduce(square_sum)
    norm = square_sum.sqrt()
    scale_grads_(params, clip_coefficient(norm.item(), max_norm))
    return norm


def fsdp_scenario(mesh: DeviceMesh, tie: bool, fuse: bool) -> dict:
    """Three steps of the sharded model against `ref` and `synced`; grads, norms, params, collectives."""
    model = build_model(tie)
    ref, synced = copy.deepcopy(model), copy.deepcopy(model)
    shard_model(model, mesh)
    cfg = Optimizer(**OPTIMIZER, fuse_qkv=fuse)
    opts = {
        name: build_optimizers(m, cfg, SCHEDULER, len(NUM_STEPS))
        for name, m in (("sharded", model), ("ref", ref), ("synced", synced))
    }
    muon_names = list(opts["ref"].optimizers[0].param_groups[0]["param_names"])
    all_names = [n for n, _ in ref.named_parameters()]
    adamw_names = [n for n in all_names if n not in muon_names]
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    muon_comms, adamw_comms, steps = Counter(), Counter(), []
    for step, num_steps in enumerate(NUM_STEPS):
        ids = torch.randint(0, 61, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(100 + step))
        # Local mean loss; FSDP2 averages grads over ranks, giving the global mean's gradient.
        loss_of(model, ids[rank * per_rank : (rank + 1) * per_rank], num_steps).backward()
        loss_of(synced, ids, num_steps).backward()
        loss_of(ref, ids, num_steps).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        grad_diff = max_diff(grads, {n: p.grad for n, p in synced.named_parameters()}, all_names)
        norm, synced_norm = clip_grads(model, 1.0, sharded=True), clip_grads(synced, 1.0, sharded=False)
        clip_grads(ref, 1.0, sharded=False)
        clipped_grad_diff = max_diff(grads, {n: p.grad for n, p in synced.named_parameters()}, all_names)
        for n, p in synced.named_parameters():
            p.grad = full(grads[n]).clone()
        with CommDebugMode() as muon_mode:
            opts["sharded"].optimizers[0].step()
        with CommDebugMode() as adamw_mode:
            opts["sharded"].optimizers[1].step()
        muon_comms.update(comm_counts(muon_mode))
        adamw_comms.update(comm_counts(adamw_mode))
        for name in ("ref", "synced"):
            opts[name].step()
        for container in opts.values():
            container.step_schedulers()
            container.zero_grad()
        params = {n: full(p) for n, p in model.named_parameters()}
        ref_params = dict(ref.named_parameters())
        steps.append(
            dict(
                grad_diff=grad_diff,
                clipped_grad_diff=clipped_grad_diff,
                norm=norm.item(),
                norm_diff=abs(norm.item() - synced_norm.item()),
                synced_diff=max_diff(params, dict(synced.named_parameters()), all_names),
                ref_muon_diff=max_diff(params, ref_params, muon_names),
                ref_muon_rel_drift=frobenius(params, ref_params, muon_names)
                / frobenius(ref_params, initial, muon_names),
                ref_adamw_diff=max_diff(params, ref_params, adamw_names),
            )
        )
    return dict(
        steps=steps,
        n_muon_matrices=len(muon_names),
        muon_comms=dict(muon_comms),
        adamw_comms=dict(adamw_comms),
        state_round_trip_diff=state_round_trip(model, opts["sharded"].optimizers[0], cfg),
        placements=str(model.core.adapter.weight.placements),
    )


def state_round_trip(model: RecurrentLM, muon: Muon, cfg: Optimizer) -> float:
    """Sharded Muon state out through get_optimizer_state_dict and into a fresh Muon (whose init steps)."""
    saved = get_optimizer_state_dict(model, muon)
    fresh = build_optimizers(model, cfg, SCHEDULER, len(NUM_STEPS)).optimizers[0]
    before = {n: full(p).clone() for n, p in model.named_parameters()}
    set_optimizer_state_dict(model, fresh, saved)
    moved = max((full(p) - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved == 0.0, f"loading optimizer state changed parameters by {moved}"
    old = {id(p): s["momentum_buffer"] for p, s in muon.state.items()}
    assert len(fresh.state) == len(old)
    return max((full(s["momentum_buffer"]) - full(old[id(p)])).abs().max().item() for p, s in fresh.state.items())


def edge_shapes_scenario(mesh: DeviceMesh, placements: list, ns_dtype: torch.dtype | None = None) -> dict:
    """Hand-sharded DTensors with empty and uneven shards (and a fused pair) vs plain Muon, 4 steps;
    Newton-Schulz in `ns_dtype` (None: the automatic float32 of CPU)."""
    shapes = [(1, 6), (5, 3), (3, 7), (1, 7), (2, 2)]
    torch.manual_seed(1)
    plain = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements)) for p in plain]
    opt_plain = Muon(plain, lr=0.05, fuse_groups=[plain[2:4]], ns_dtype=ns_dtype)
    opt_sharded = Muon(sharded, lr=0.05, fuse_groups=[sharded[2:4]], ns_dtype=ns_dtype)
    comms = Counter()
    for _ in range(4):
        for p, s in zip(plain, sharded, strict=True):
            p.grad = torch.randn(p.shape)
            s.grad = distribute_tensor(p.grad.clone(), mesh, placements)
        opt_plain.step()
        with CommDebugMode() as mode:
            opt_sharded.step()
        comms.update(comm_counts(mode))
    diff = max((s.full_tensor() - p).abs().max().item() for p, s in zip(plain, sharded, strict=True))
    return dict(diff=diff, comms=dict(comms), local_rows=[s.to_local().shape[0] for s in sharded])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    hsdp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    replicas_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    report = dict(
        fsdp=fsdp_scenario(mesh, tie=False, fuse=False),
        hsdp_tied_fused=fsdp_scenario(hsdp_mesh, tie=True, fuse=True),
        edge_1d=edge_shapes_scenario(mesh, [Shard(0)]),
        edge_1d_bf16=edge_shapes_scenario(mesh, [Shard(0)], torch.bfloat16),
        edge_replicas=edge_shapes_scenario(replicas_mesh, [Replicate(), Shard(0)]),
    )
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(reports, f, indent=1)
    finish()


if __name__ == "__main__":
    main()
