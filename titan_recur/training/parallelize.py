"""The parallelize recipe, applied in TorchTitan's order: activation checkpointing -> per-block compile -> FSDP2.

Where a looped block breaks TorchTitan's assumptions:
- The recurrent core is ONE FSDP unit (the loop owner), so its weights are all-gathered once in forward
  and once in backward and reduce-scattered once per step, whatever the number of iterations.
- Compile wraps each prelude/coda block and one whole core iteration, never the loop: the loop stays
  plain Python, so the number of iterations never enters a graph and never triggers a recompile.
- Activation checkpointing of the core is per grad-carrying iteration; no-grad iterations store nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_recur.config import MIXED_PRECISION_MODES
from titan_recur.models.model import RecurrentLM
from titan_recur.training.cost_model import checkpoint_plan, dp_mesh_shape


def build_dp_mesh(device_type: str, world_size: int, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """1-D mesh for FSDP, 2-D (dp_replicate, dp_shard) for HSDP; dp_shard=-1 takes the rest of the world."""
    dp_replicate, dp_shard = dp_mesh_shape(world_size, dp_replicate, dp_shard)
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_activation_checkpointing(model: RecurrentLM, mode: str) -> None:
    """Checkpoint prelude/coda blocks, and the core per iteration ("per_iteration") or per block ("full").

    Checkpointing recomputes only what ran with grad: the no-grad iterations store nothing anyway.
    """
    plan = checkpoint_plan(mode)
    stacks = model.block_stacks() if plan.blocks else []
    if model.core is not None and plan.core == "block":
        stacks.append(model.core.blocks)
    for blocks in stacks:
        for i, block in enumerate(blocks):
            blocks[i] = _checkpointed(block)
    if model.core is not None and plan.core == "iteration":
        model.core.iteration = _checkpointed(model.core.iteration)  # type: ignore[assignment]  # same call


def _checkpointed(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, preserve_rng_state=False)


def apply_compile(model: RecurrentLM) -> None:
    """Compile each prelude/coda block, and the whole core iteration (A_s s + R blocks) as one graph.

    The loop stays eager, so (n, k) never enters a graph: one graph per grad mode serves every
    iteration of every step, and nothing between the core's blocks runs outside it.
    """
    for block in model.once_blocks():
        block.compile(fullgraph=True)
    if model.core is not None:
        model.core.iteration.compile(fullgraph=True)


def apply_fsdp(model: RecurrentLM, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None) -> None:
    """fully_shard per prelude/coda block, the whole core as one unit, embeddings, norm+head, root.

    With tied embeddings, embedding and head must share one FSDP group (a parameter may live in only
    one): both stay in the root group then.
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.once_blocks():
        fully_shard(block, **kwargs)
    if model.core is not None:
        fully_shard(model.core, **kwargs)
    if not model.args.tie_embeddings:
        fully_shard(model.embed_tokens, **kwargs)
        # The head's output is the last thing in forward: keep it gathered for backward.
        head = cast(nn.Linear, model.lm_head)  # untied: the model has a head
        fully_shard([model.norm, head], reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    set_prefetch(model)


def set_prefetch(model: RecurrentLM) -> None:
    """Explicit FSDP2 prefetch along the forward order of the units: each all-gathers the next one's
    parameters while it computes (and the previous one's in backward). The first unit also starts the
    core's all-gather, the largest, so that it overlaps the whole prelude."""
    units = [*([model.embed_tokens] if not model.args.tie_embeddings else []), *model.prelude]
    units += [model.core] if model.core is not None else []
    units += [*model.coda, *([model.norm] if not model.args.tie_embeddings else [])]
    for i, unit in enumerate(units):
        ahead = units[i + 1 : i + 2]
        if i == 0 and model.core is not None and model.core not in ahead and model.core is not unit:
            ahead.append(model.core)
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])


def mixed_precision_policy(
    device_type: str, param_dtype: str, reduce_dtype: str, mode: str = "fsdp"
) -> MixedPrecisionPolicy | None:
    """FSDP2's casts. "fsdp": compute in param_dtype over fp32 master weights, on accelerators only (plain
    fp32 on CPU). "autocast": FSDP2 keeps fp32 parameters (and all-gathers fp32) and `forward_autocast`
    lowers the matmuls instead."""
    if mode not in MIXED_PRECISION_MODES:
        raise ValueError(f"mixed precision mode must be one of {MIXED_PRECISION_MODES}, got {mode!r}")
    if device_type == "cpu":
        return None
    compute = param_dtype if mode == "fsdp" else "float32"
    return MixedPrecisionPolicy(param_dtype=getattr(torch, compute), reduce_dtype=getattr(torch, reduce_dtype))


def forward_autocast(device_type: str, param_dtype: str, mode: str) -> contextlib.AbstractContextManager:
    """The context of the training forward: torch.autocast(param_dtype) in "autocast" mode, as the reference.

    Linear layers then run in bf16 while values that never pass one (the embedding output, hence the
    prelude's residual stream, and RMSNorm) stay fp32. CPU autocasts too, so the mode is testable there.
    """
    if mode not in MIXED_PRECISION_MODES:
        raise ValueError(f"mixed precision mode must be one of {MIXED_PRECISION_MODES}, got {mode!r}")
    if mode == "fsdp" or param_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, param_dtype))


def parallelize_model(
    model: RecurrentLM,
    mesh: DeviceMesh | None,
    *,
    ac_mode: str,
    compile_blocks: bool,
    mp_policy: MixedPrecisionPolicy | None,
) -> RecurrentLM:
    apply_activation_checkpointing(model, ac_mode)
    if compile_blocks:
        apply_compile(model)
    if mesh is not None:
        apply_fsdp(model, mesh, mp_policy)
    return model
