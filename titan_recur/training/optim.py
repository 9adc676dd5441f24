"""Optimizers (docs/method.md §3): Muon for block and adapter matrices, AdamW for the rest, one WSD schedule.

Muon orthogonalises whole matrices, but FSDP2 shards every parameter on dim 0. `Muon` keeps the
momentum buffer sharded (its update is elementwise) and hands each matrix's Nesterov update to one
owner rank, which orthogonalises it whole and sends every rank back its rows. All matrices of a
step travel in one all-to-all there and one back, so a step costs 2 collectives per shard group
(2 / n_matrices per matrix), each rank sends and receives ~1/W of the Muon parameters (in
Newton-Schulz's dtype), and each rank runs Newton-Schulz on ~1/W of the matrices. Owners hold exactly
the input a single process would orthogonalise, so the update is bit-identical to single-process Muon.
(torch.optim.Muon on the same DTensors is also correct but issued ~15 hidden collectives per matrix
per step here.)

Newton-Schulz runs in bf16 on accelerators, as torch.optim.Muon and the reference do, and in float32
on CPU, where a bf16 matmul without AVX512-BF16 or AMX is ~50x slower than a float32 one
(docs/benchmarks.md); `optimizer.ns_dtype` chooses either explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titan_recur.config import DECAY_TYPES, LRScheduler, Optimizer
from titan_recur.models.blocks import TransformerBlock
from titan_recur.models.model import RecurrentLM

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

NamedParams = list[tuple[str, nn.Parameter]]


# ---------------------------------------------------------------- Muon


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """The automatic choice: bf16 on accelerators (torch.optim.Muon's), float32 on CPU (bf16 is slow there)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def zeropower_via_newtonschulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalise a 2-D update in `dtype`; in bf16 operation for operation as torch.optim.Muon."""
    a, b, c = coefficients
    x = update.to(dtype)
    transposed = update.size(0) > update.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul FLOPs of ``zeropower_via_newtonschulz`` on a (rows x cols) update, m the smaller side: per
    iteration X X^T (2 m^2 n), the quintic's A A (2 m^3) and its product with X (2 m^2 n)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass
class _Unit:
    """Parameters orthogonalised as one matrix (their rows concatenated), plus their Nesterov updates."""

    params: list[torch.Tensor]
    updates: list[torch.Tensor]  # local shards for DTensors
    group: dict[str, Any]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.params), self.params[0].shape[1]

    def apply(self, orthogonalised: Sequence[torch.Tensor]) -> None:
        """Decoupled weight decay, then the update scaled by sqrt(max(1, rows/cols)) of the fused shape."""
        lr, weight_decay = self.group["lr"], self.group["weight_decay"]
        rows, cols = self.shape
        adjusted_lr = lr * math.sqrt(max(1, rows / cols))
        for p, o in zip(self.params, orthogonalised, strict=True):
            local = local_tensor(p)
            local.mul_(1 - lr * weight_decay)
            local.add_(o, alpha=-adjusted_lr)


class Muon(torch.optim.Optimizer):
    """Muon (momentum, Nesterov, Newton-Schulz) for 2-D parameters, plain or FSDP2-sharded on dim 0.

    Same semantics and defaults-by-spec as torch.optim.Muon with adjust_lr_fn="original"; on plain
    tensors the parameters match it bit for bit. `fuse_groups` lists parameters (e.g. q, k, v) that
    are orthogonalised as one matrix concatenated on dim 0, as the reference does with its fused
    projections; their members must share a param group and a column count. Params may be given
    named (``model.named_parameters()``-style pairs) so errors name them. `ns_dtype` None picks
    `newton_schulz_dtype` of the parameters' device (bf16 gives torch.optim.Muon's bits on any device).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        fuse_groups: Sequence[Sequence[torch.Tensor]] = (),
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum, weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
        )
        super().__init__(params, defaults)
        self.fuse_groups = [list(members) for members in fuse_groups]
        self._check_fuse_groups()
        device = self.param_groups[0]["params"][0].device if self.param_groups else torch.device("cpu")
        self.ns_dtype = ns_dtype or newton_schulz_dtype(device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names", [None] * len(group["params"]))
        for name, p in zip(names, group["params"], strict=True):
            if p.ndim != 2:
                self.param_groups.pop()
                label = f"parameter {name!r}" if name else "a parameter"
                raise ValueError(
                    f"Muon only optimises 2-D parameters; {label} has shape {tuple(p.shape)} (give it to AdamW)"
                )

    def _check_fuse_groups(self) -> None:
        group_of = {id(p): i for i, group in enumerate(self.param_groups) for p in group["params"]}
        seen: set[int] = set()
        for members in self.fuse_groups:
            shapes = [tuple(p.shape) for p in members]
            if any(id(p) not in group_of for p in members):
                raise ValueError(f"fuse group with shapes {shapes} has parameters this Muon does not optimise")
            if len({group_of[id(p)] for p in members}) != 1:
                raise ValueError(f"fuse group with shapes {shapes} spans several param groups")
            if len({p.shape[1] for p in members}) != 1:
                raise ValueError(f"fuse group members must have equal column counts, got shapes {shapes}")
            if seen & {id(p) for p in members}:
                raise ValueError(f"a parameter appears in more than one fuse group (shapes {shapes})")
            seen |= {id(p) for p in members}

    def _group_units(self, group: dict[str, Any]) -> list[list[torch.Tensor]]:
        """The group's parameters as units: a fuse group where one applies, else the parameter alone."""
        fused = {id(p): members for members in self.fuse_groups for p in members}
        units, emitted = [], set()
        for p in group["params"]:
            members = fused.get(id(p), [p])
            if id(members[0]) not in emitted:
                emitted.add(id(members[0]))
                units.append(members)
        return units

    def orthogonalisation_flops(self) -> int:
        """Newton-Schulz FLOPs of one step, every unit counted once: summed over the ranks of a shard group,
        each of which orthogonalises only the units it owns."""
        return sum(
            newton_schulz_flops(sum(p.shape[0] for p in members), members[0].shape[1], group["ns_steps"])
            for group in self.param_groups
            for members in self._group_units(group)
        )

    def _nesterov_update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the (sharded) momentum buffer; return the local shard of the Nesterov update."""
        state = self.state[p]
        grad = cast(torch.Tensor, p.grad)  # step updates parameters with a gradient only
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        grad, buf, momentum = local_tensor(grad), local_tensor(state["momentum_buffer"]), group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        local_units: list[_Unit] = []
        sharded_units: dict[tuple[DeviceMesh, int], list[_Unit]] = {}
        for group in self.param_groups:
            for members in self._group_units(group):
                with_grad = [p.grad is not None for p in members]
                if not any(with_grad):
                    continue
                if not all(with_grad):
                    raise RuntimeError("Muon: some members of a fuse group have gradients and some do not")
                unit = _Unit(members, [self._nesterov_update(p, group) for p in members], group)
                key = _shard_key(members)
                if key is None:
                    local_units.append(unit)
                else:
                    sharded_units.setdefault(key, []).append(unit)
        for unit in local_units:
            group = unit.group
            ortho = zeropower_via_newtonschulz(
                torch.cat(unit.updates), group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
            )
            unit.apply(ortho.split([p.shape[0] for p in unit.params]))
        for (mesh, mesh_dim), units in sharded_units.items():
            _orthogonalise_on_owners(units, mesh, mesh_dim, self.ns_dtype)
        return loss


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard (a view sharing storage) of a DTensor; plain tensors unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_key(members: Sequence[torch.Tensor]) -> tuple[DeviceMesh, int] | None:
    """(mesh, mesh dim sharding dim 0) of FSDP2/HSDP DTensors; None when each rank holds whole matrices."""
    keys: set[tuple[DeviceMesh, int] | None] = set()
    for p in members:
        if not isinstance(p, DTensor):
            keys.add(None)
            continue
        shard_dims = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
        if any(not (pl.is_shard(0) or pl.is_replicate()) for pl in p.placements) or len(shard_dims) > 1:
            raise ValueError(f"Muon supports DTensors sharded on dim 0 only, got placements {p.placements}")
        sharded = bool(shard_dims) and p.device_mesh.size(shard_dims[0]) > 1
        keys.add((p.device_mesh, shard_dims[0]) if sharded else None)
    if len(keys) != 1:
        raise ValueError("members of a Muon fuse group must be sharded the same way")
    return keys.pop()


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank under Shard(0): torch.chunk semantics (ceil-sized chunks, trailing ranks may get 0)."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """Longest-first greedy: each unit goes to the least-loaded rank; deterministic on every rank."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(world), key=lambda r: load[r])
        load[owners[i]] += costs[i]
    return owners


def _orthogonalise_on_owners(units: list[_Unit], mesh: DeviceMesh, mesh_dim: int, ns_dtype: torch.dtype) -> None:
    """Gather each unit's update on its owner, orthogonalise it there, send each rank back its rows.

    Two all_to_all_single calls over the shard group carry every unit of the step. Pieces travel
    in `ns_dtype`: Newton-Schulz casts its input to it first and returns it, so nothing is lost.
    """
    group, world, rank = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    owners = assign_owners([u.shape[0] * u.shape[1] * min(u.shape) for u in units], world)
    rows = [[shard_rows(p.shape[0], world) for p in u.params] for u in units]
    cols = [u.shape[1] for u in units]
    for u, unit_rows in zip(units, rows, strict=True):
        for p, update, member_rows in zip(u.params, u.updates, unit_rows, strict=True):
            if update.shape[0] != member_rows[rank]:
                raise RuntimeError(f"unexpected Shard(0) rows on rank {rank}: {tuple(update.shape)} of {p.shape}")
    mine = [i for i in range(len(units)) if owners[i] == rank]
    like = units[0].updates[0]

    # Forward: every rank's rows of each unit go to the unit's owner.
    to_owners = [
        [upd.to(ns_dtype).flatten() for i, u in enumerate(units) if owners[i] == peer for upd in u.updates]
        for peer in range(world)
    ]
    from_ranks = _exchange(
        to_owners, [[r[peer] * cols[i] for i in mine for r in rows[i]] for peer in range(world)], group, like, ns_dtype
    )
    incoming = [iter(pieces) for pieces in from_ranks]
    replies: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for i in mine:
        unit, cfg = units[i], units[i].group
        full = torch.cat(
            [torch.cat([next(incoming[peer]).view(-1, cols[i]) for peer in range(world)]) for _ in unit.params]
        )
        ortho = zeropower_via_newtonschulz(full, cfg["ns_coefficients"], cfg["ns_steps"], cfg["eps"], ns_dtype)
        for member, member_rows in zip(ortho.split([p.shape[0] for p in unit.params]), rows[i], strict=True):
            for peer, shard in enumerate(member.split(member_rows)):
                replies[peer].append(shard.flatten())

    # Backward: each owner returns every rank its rows of the orthogonalised units.
    from_owners = _exchange(
        replies,
        [[r[rank] * cols[i] for i in range(len(units)) if owners[i] == peer for r in rows[i]] for peer in range(world)],
        group,
        like,
        ns_dtype,
    )
    returned = [iter(pieces) for pieces in from_owners]
    for i, unit in enumerate(units):
        unit.apply([next(returned[owners[i]]).view(-1, cols[i]) for _ in unit.params])


def _exchange(
    send: list[list[torch.Tensor]],
    recv_numels: list[list[int]],
    group: dist.ProcessGroup,
    like: torch.Tensor,
    dtype: torch.dtype,
) -> list[list[torch.Tensor]]:
    """One all_to_all_single: send[peer]'s pieces to each peer; return each peer's pieces split by recv_numels."""
    flat = [piece for pieces in send for piece in pieces]
    send_buf = torch.cat(flat) if flat else like.new_empty(0, dtype=dtype)
    recv_sizes = [sum(numels) for numels in recv_numels]
    recv_buf = send_buf.new_empty(sum(recv_sizes))
    dist.all_to_all_single(
        recv_buf, send_buf, recv_sizes, [sum(p.numel() for p in pieces) for pieces in send], group=group
    )
    return [list(part.split(numels)) for part, numels in zip(recv_buf.split(recv_sizes), recv_numels, strict=True)]


# ---------------------------------------------------------------- parameter roles


def split_params_for_muon(model: RecurrentLM) -> tuple[NamedParams, NamedParams]:
    """(Muon, AdamW) named trainable params: Muon takes every 2-D weight of the blocks and the adapter.

    AdamW takes embeddings, LM head, norms and biases (a tied head is the embedding).
    """
    hidden_matrices = {id(p) for _, p in model.parameters_by_role()["hidden_matrix"]}
    muon: NamedParams = []
    adamw: NamedParams = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if id(p) in hidden_matrices else adamw).append((name, p))
    return muon, adamw


def fused_matrix_groups(model: RecurrentLM) -> list[list[torch.Tensor]]:
    """[q, k, v] and [gate, up] weights of every block: the reference's fused projections."""
    groups: list[list[torch.Tensor]] = []
    for block in model.blocks():
        # A TransformerBlock, or a wrapper (activation checkpointing) that forwards attribute access to one.
        transformer_block = cast(TransformerBlock, block)
        attn, mlp = transformer_block.self_attn, transformer_block.mlp
        groups.append([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        groups.append([mlp.gate_proj.weight, mlp.up_proj.weight])
    return groups


# ---------------------------------------------------------------- LR schedule


def _fraction_steps(fraction: float, total_steps: int) -> int:
    """ceil(fraction * total_steps), immune to float noise such as 0.07 * 100 = 7.000000000000001."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"schedule fractions must lie in [0, 1], got {fraction}")
    return math.ceil(round(fraction * total_steps, 6))


def wsd_factor(
    step: int,
    total_steps: int,
    warmup_fraction: float,
    decay_fraction: float,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """LR multiplier of optimizer step `step` (0-based: the factor the step-th optimizer.step() uses).

    The reference's warmup-stable-decay (transformers' ``get_wsd_schedule``). Warmup: W =
    ceil(warmup_fraction * total) steps, factor min + (1 - min) * step / W, so step 0 uses
    min_lr_factor and step W the full LR. Decay: the last D = ceil(decay_fraction * total) steps,
    progress (step - (total - D)) / D, so the first decay step still uses the full LR and the factor
    reaches min_lr_factor at step total (after the last update); later steps keep it. If the two
    phases overlap the smaller factor wins.
    """
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"decay_type must be one of {DECAY_TYPES}, got {decay_type!r}")
    warmup = _fraction_steps(warmup_fraction, total_steps)
    decay = _fraction_steps(decay_fraction, total_steps)
    factor = 1.0
    if step < warmup:
        factor = min_lr_factor + (1.0 - min_lr_factor) * step / warmup
    if decay > 0 and step >= total_steps - decay:
        progress = min(1.0, (step - (total_steps - decay)) / decay)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay_type == "cosine" else 1.0 - progress
        factor = min(factor, min_lr_factor + (1.0 - min_lr_factor) * shape)
    return factor


# ---------------------------------------------------------------- container


class OptimizersContainer:
    """The step's optimizers, driven as one, each with a LambdaLR on the same WSD factor.

    Call order per step: step(), step_schedulers(), zero_grad(); optimizer step s (0-based) then
    runs at factor lr_lambda(s), the first one at lr_lambda(0). Checkpoint the optimizers with
    torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer) per
    optimizer; state_dict()/load_state_dict() here cover the LR schedulers only.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], lr_lambda: Callable[[int], float]) -> None:
        self.names = list(optimizers)
        self.optimizers = list(optimizers.values())
        self.lr_schedulers = [LambdaLR(opt, lr_lambda) for opt in self.optimizers]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step_schedulers(self) -> None:
        for scheduler in self.lr_schedulers:
            scheduler.step()

    def current_lrs(self) -> dict[str, float]:
        """LR of each optimizer's first param group, for logging."""
        return {name: float(opt.param_groups[0]["lr"]) for name, opt in zip(self.names, self.optimizers, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return {"lr_schedulers": [scheduler.state_dict() for scheduler in self.lr_schedulers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler, state in zip(self.lr_schedulers, state_dict["lr_schedulers"], strict=True):
            scheduler.load_state_dict(state)


def build_optimizers(
    model: RecurrentLM, cfg_optimizer: Optimizer, cfg_scheduler: LRScheduler, total_steps: int
) -> OptimizersContainer:
    """Optimizers for a (possibly FSDP2-sharded) RecurrentLM; build after parallelising the model.

    "muon": Muon (lr, momentum, nesterov, ns_steps, weight_decay; q,k,v and gate,up fused when
    fuse_qkv) on block and adapter matrices, AdamW (adamw_*) on the rest. "adamw": one AdamW over
    every parameter with the adamw_* settings, since `lr` is Muon's.
    """
    adamw_kwargs: dict[str, Any] = dict(
        lr=cfg_optimizer.adamw_lr,
        betas=tuple(cfg_optimizer.adamw_betas),
        eps=cfg_optimizer.adamw_eps,
        weight_decay=cfg_optimizer.adamw_weight_decay,
    )
    muon_params, adamw_params = split_params_for_muon(model)
    optimizers: dict[str, torch.optim.Optimizer]
    if cfg_optimizer.name == "adamw":
        optimizers = {"adamw": torch.optim.AdamW(muon_params + adamw_params, **adamw_kwargs)}
    elif cfg_optimizer.name == "muon":
        muon = Muon(
            muon_params,
            lr=cfg_optimizer.lr,
            weight_decay=cfg_optimizer.weight_decay,
            momentum=cfg_optimizer.momentum,
            nesterov=cfg_optimizer.nesterov,
            ns_steps=cfg_optimizer.ns_steps,
            fuse_groups=fused_matrix_groups(model) if cfg_optimizer.fuse_qkv else (),
            ns_dtype=NS_DTYPES.get(cfg_optimizer.ns_dtype),
        )
        optimizers = {"muon": muon, "adamw": torch.optim.AdamW(adamw_params, **adamw_kwargs)}
    else:
        raise ValueError(f"optimizer.name must be 'muon' or 'adamw', got {cfg_optimizer.name!r}")

    def lr_lambda(step: int) -> float:
        return wsd_factor(
            step,
            total_steps,
            cfg_scheduler.warmup_fraction,
            cfg_scheduler.decay_fraction,
            cfg_scheduler.decay_type,
            cfg_scheduler.min_lr_factor,
        )

    return OptimizersContainer(optimizers, lr_lambda)


# ---------------------------------------------------------------- gradient norm


@torch.no_grad()
def grad_square_sum(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries held by this rank (its shards for FSDP2 DTensors), in fp32.

    Summed over the ranks of an FSDP group it is the squared global norm (over an HSDP mesh each
    shard is counted once per replica); the trainer reduces it with the step's other scalars, so
    clipping costs no collective of its own. Non-finite gradients give a non-finite sum.
    """
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """The factor that brings the gradient norm down to max_norm (1 when it is below), as torch's clipping."""
    return min(1.0, max_norm / (grad_norm + 1e-6))


@torch.no_grad()
def scale_grads_(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient (its local shard) by ``factor`` in place, in one fused kernel per dtype."""
    torch._foreach_mul_([local_tensor(p.grad) for p in params if p.grad is not None], factor)
