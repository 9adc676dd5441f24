"""Building what a training step runs, as the trainer does it: shared by the trainer, its preflight
and the benchmarks (tools/bench_*.py), so that a benchmark measures the trainer's model."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_recur.config import JobConfig
from titan_recur.models.args import ModelArgs
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import load_state_dict_into, read_weights
from titan_recur.training.parallelize import mixed_precision_policy, parallelize_model

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType


def build_model(cfg: JobConfig, args: ModelArgs, device: torch.device, mesh: DeviceMesh | None = None) -> RecurrentLM:
    """Meta-device build, the parallelize recipe (AC, compile, FSDP on ``mesh``), materialise, then load
    the converted weights or init; in train mode."""
    t = cfg.training
    with torch.device("meta"):
        model = RecurrentLM(args)
    mp_policy = mixed_precision_policy(
        device.type, t.mixed_precision_param, t.mixed_precision_reduce, t.mixed_precision_mode
    )
    parallelize_model(model, mesh, ac_mode=t.ac_mode, compile_blocks=t.compile, mp_policy=mp_policy)
    model.to_empty(device=device)
    load_initial_weights(model, cfg, args)
    return model.train()


def load_initial_weights(model: RecurrentLM, cfg: JobConfig, args: ModelArgs) -> None:
    """Rank 0 reads (or randomly initialises) the full weights and broadcasts them into the shards.

    Building the full state on one rank makes the start identical for every world size.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    full_state: dict[str, torch.Tensor] = {}
    if is_rank0:
        full_state = initial_full_state(cfg, args)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized(), strict=True)
    set_model_state_dict(model, cast("dict[str, ValueType]", full_state), options=options)  # dict is invariant


def initial_full_state(cfg: JobConfig, args: ModelArgs) -> dict[str, torch.Tensor]:
    source = RecurrentLM(args)
    if cfg.model.init == "random" or not cfg.model.path:
        torch.manual_seed(cfg.job.seed)
        source.init_weights()
    else:
        load_state_dict_into(source, read_weights(cfg.model.path), cfg.model.path)
    return source.state_dict()
