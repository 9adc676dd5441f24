"""Drives the real Trainer on fixed global batches, alone or under torchrun, and records what tests compare.

Modes:
  steps        run --steps optimizer steps; save losses, full gradients before each step and final
               full parameters (rank 0 writes --out with torch.save).
  collectives  run one step per r in --recurrences with num_steps (r-1, 1) and count, per step, the
               c10d collectives FSDP2 issues for the recurrent core's parameters.
  compile      run --steps steps with compiled blocks and varying (n, k); report dynamo's graph counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from titan_recur.config import load_config
from titan_recur.data.loader import document_ids
from titan_recur.training.trainer import Trainer

PARAM_NAME_NOISE = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for noise in PARAM_NAME_NOISE:
        name = name.replace(noise, "")
    return name


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def fixed_batches(
    steps: int, accum: int, global_batch: int, seq_len: int, vocab: int, rank: int, world: int, eos_id: int | None
):
    """The same global batches for every world size; each rank takes its contiguous slice. Given ``eos_id``
    (document masking), about one token in 5 ends a document and the batches carry document_ids, as the loader's."""
    gen = torch.Generator().manual_seed(1234)
    local = global_batch // world
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            rows = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=gen)
            if eos_id is not None:
                rows[torch.rand(rows.shape, generator=gen) < 0.2] = eos_id
            mine = rows[rank * local : (rank + 1) * local]
            batch = {"input_ids": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous()}
            if eos_id is not None:
                batch["document_ids"] = document_ids(batch["input_ids"], eos_id)
            micro.append(batch)
        yield micro


def build_trainer(args: argparse.Namespace) -> Trainer:
    world = int(os.environ.get("WORLD_SIZE", 1))
    overrides = [
        "--model.path",
        args.model,
        "--job.dump_folder",
        args.dump,
        "--training.steps",
        str(args.steps),
        "--training.local_batch_size",
        str(args.global_batch // world),
        "--training.global_batch_size",
        str(args.global_batch * args.accum),
        "--training.seq_len",
        str(args.seq_len),
        "--training.ac_mode",
        args.ac,
        "--optimizer.name",
        args.optimizer,
        "--optimizer.lr",
        "1e-3",
        "--optimizer.adamw_lr",
        "5e-5",
        "--recurrence.mean_recurrence",
        "4",
        "--recurrence.backprop_depth",
        "2",
        "--recurrence.curriculum",
        "linear",
        "--recurrence.warmup_fraction",
        "0.5",
        "--checkpoint.enable",
        "false",
        "--checkpoint.export_final",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1",
        "--parallel.dp_replicate",
        str(args.dp_replicate),
    ] + args.overrides
    return Trainer(load_config(args.config, overrides))


def run_steps(trainer: Trainer, args: argparse.Namespace) -> dict:
    grads: list[dict[str, torch.Tensor]] = []
    original_step = trainer.optimizers.step

    def step_recording_grads() -> None:
        grads.append({clean_name(n): full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None})
        original_step()

    trainer.optimizers.step = step_recording_grads
    with fsdp_modules_without_forward(trainer) as silent:
        records = train_fixed_steps(trainer, args)
    params = {clean_name(n): full(p) for n, p in trainer.model.named_parameters()}
    return {"losses": [r["loss"] for r in records], "grads": grads, "params": params, "silent_fsdp_modules": silent}


@contextlib.contextmanager
def fsdp_modules_without_forward(trainer: Trainer):
    """Names of the modules given to fully_shard whose forward never ran during the block: FSDP's
    unshard/reshard and gradient reduce-scatter of such a module run outside its schedule."""
    from torch.distributed.fsdp import FSDPModule

    ran: set[str] = set()
    modules = {clean_name(n): m for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)}
    handles = [m.register_forward_hook(lambda *_, n=n: ran.add(n)) for n, m in modules.items()]
    silent: list[str] = []
    try:
        yield silent
    finally:
        for handle in handles:
            handle.remove()
        silent.extend(sorted(set(modules) - ran))


def train_fixed_steps(trainer: Trainer, args: argparse.Namespace, after_step=lambda: None) -> list[dict]:
    """The trainer's own train_step on the fixed batches; returns each step's record."""
    rank, world = trainer.dist.rank, trainer.dist.world_size
    records = []
    eos_id = trainer.tokenizer.eos_id if trainer.cfg.training.attention_mask == "document" else None
    batches = fixed_batches(args.steps, args.accum, args.global_batch, args.seq_len, 97, rank, world, eos_id)
    for step, micro in enumerate(batches, start=1):
        trainer.step = step
        records.append(trainer.train_step(iter(micro)))
        after_step()
    return records


@contextlib.contextmanager
def count_core_collectives(trainer: Trainer):
    """Count c10d all-gathers/reduce-scatters issued while FSDP2 works on the core's parameter group."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    core_params = {id(p) for p in trainer.model.core.parameters()}
    counts: Counter = Counter()
    active = {"core": False}

    def tracking(fn, is_core_arg):
        def wrapper(*a, **kw):
            previous = active["core"]
            active["core"] = is_core_arg(*a, **kw)
            try:
                return fn(*a, **kw)
            finally:
                active["core"] = previous

        return wrapper

    def is_core(fsdp_params, *a, **kw) -> bool:
        return any(id(fp.sharded_param) in core_params for fp in fsdp_params)

    def counting(name, fn):
        def wrapper(*a, **kw):
            if active["core"]:
                counts[name] += 1
            return fn(*a, **kw)

        return wrapper

    saved = {
        (group_module, "foreach_all_gather"): group_module.foreach_all_gather,
        (group_module, "foreach_reduce"): group_module.foreach_reduce,
        (dist, "all_gather_single"): dist.all_gather_single,
        (dist, "reduce_scatter_single"): dist.reduce_scatter_single,
        (dist, "all_reduce"): dist.all_reduce,
    }
    group_module.foreach_all_gather = tracking(group_module.foreach_all_gather, is_core)
    group_module.foreach_reduce = tracking(group_module.foreach_reduce, is_core)
    dist.all_gather_single = counting("all_gather", dist.all_gather_single)
    dist.reduce_scatter_single = counting("reduce_scatter", dist.reduce_scatter_single)
    dist.all_reduce = counting("all_reduce", dist.all_reduce)
    try:
        yield counts
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


class HostSyncs(TorchFunctionMode):
    """Counts tensor-to-Python reads made by titan_recur's own code (each is a host sync on an accelerator).

    torch's AdamW reads its step counter with .item(), but that counter lives on the CPU (not a
    device sync), so only calls from titan_recur frames count.
    """

    READS = (
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
    )

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            caller = sys._getframe(1)
            if "titan_recur" in caller.f_code.co_filename:
                self.calls.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_all_reduces():
    counts = Counter()
    original = dist.all_reduce

    def counting(*a, **kw):
        counts["all_reduce"] += 1
        return original(*a, **kw)

    dist.all_reduce = counting
    try:
        yield counts
    finally:
        dist.all_reduce = original


def run_collectives(trainer: Trainer, args: argparse.Namespace) -> dict:
    """Per (n, k): one real optimizer step of the trainer with that depth; the core's all-gathers in
    forward and after it, its reduce-scatters, every all-reduce of the step, and titan_recur's host syncs."""
    results = {}
    rank, world = trainer.dist.rank, trainer.dist.world_size
    phase = {}
    trainer.model.register_forward_hook(lambda module, inputs, out: phase.update(forward=dict(core_counts)))
    for r in args.recurrences:
        for k in sorted({1, min(2, r)}):
            n = r - k
            trainer.schedule.sample = lambda step, micro_step, n=n, k=k: (n, k)
            micro = next(fixed_batches(1, 1, args.global_batch, args.seq_len, 97, rank, world, None))
            syncs = HostSyncs()
            with count_core_collectives(trainer) as core_counts, count_all_reduces() as reduces, syncs:
                trainer.step += 1
                assert trainer.train_step(iter(micro)) is not None
            forward = phase["forward"]
            after = {key: core_counts[key] - forward.get(key, 0) for key in core_counts}
            results[f"{n},{k}"] = {
                "forward": forward,
                "after_forward": after,
                "all_reduce": reduces["all_reduce"],
                "host_syncs": syncs.calls,
            }
    return results


class RecompileLog(logging.Handler):
    """Dynamo's recompile log (torch._logging recompiles=True): one record per recompilation."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Recompiling function")


def run_compile(trainer: Trainer, args: argparse.Namespace) -> dict:
    """Per step: the depth, the loss and dynamo's recompiles so far (compiles after the first graph of a frame)."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch._logging.set_logs(recompiles=True)
    log = RecompileLog()
    logging.getLogger("torch._dynamo").addHandler(log)
    records, recompiles = [], []
    for record in train_fixed_steps(trainer, args, after_step=lambda: recompiles.append(log.count)):
        records.append(record)
    return {
        "losses": [r["loss"] for r in records],
        "depths": [(r["n"], r["k"]) for r in records],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles_per_step": recompiles,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["steps", "collectives", "compile"], default="steps")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=None)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--ac", default="none")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--recurrences", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    args, args.overrides = parser.parse_known_args()
    if args.config is None:
        args.config = "train_configs/debug_model.toml"
    trainer = build_trainer(args)
    runner = {"steps": run_steps, "collectives": run_collectives, "compile": run_compile}[args.mode]
    result = runner(trainer, args)
    if trainer.dist.rank == 0:
        if args.mode == "steps":
            torch.save(result, args.out)
        else:
            with open(args.out, "w") as f:
                json.dump(result, f)
    trainer.close()


if __name__ == "__main__":
    sys.exit(main())
