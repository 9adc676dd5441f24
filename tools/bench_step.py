"""Benchmark the real training step: tokens/s, MFU, peak memory, no-grad and grad iteration times.

Runs titan_recur's Trainer (parallelize recipe, FSDP2 with bf16 mixed precision on GPU, Muon + AdamW,
chunked loss) on random token batches at a fixed (n, k), so the figure is the step users run at the
depth they choose. Launch under torchrun (one process per GPU; FSDP2 and its mixed-precision policy
need a process group; tools/bench_gpu.sh sets torchrun's RANK, WORLD_SIZE and MASTER_* for one rank
itself), or as one process on the CPU. The trainer's data check and loader are skipped: neither
`datasets` nor `torchdata` is needed.

    torchrun --standalone --nproc-per-node 1 tools/bench_step.py --preset llama3.2-1b --shape 4,6,4 \\
        --num-steps 24,8 --seq-len 1024 --local-batch 8 --compile --ac-mode per_iteration
    python tools/bench_step.py --model assets/tiny_llama_recurrent --num-steps 3,1 --seq-len 64   # CPU

--attention-mask document times training.attention_mask = "document": the random rows then hold documents of
--document-len tokens on average (each token ends one with probability 1 / --document-len) and carry the
loader's document ids.

MFU uses the full FLOP convention (titan_recur.training.cost_model: every matmul of the (n, k) run, attention
included, AC recompute excluded) over the device's dense bf16 peak (--peak-flops to override).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, get_args
from unittest import mock

if TYPE_CHECKING:
    from titan_recur.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from titan_recur.config import ATTENTION_MASKS, ACMode, NSDtype

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", help="source-model preset, random init (e.g. llama3.2-1b)")
    model.add_argument("--model", help="a model folder (e.g. assets/tiny_llama_recurrent)")
    parser.add_argument("--shape", default="4,6,4", help="P,R,C with --preset")
    parser.add_argument("--num-steps", default="24,8", help="n,k: no-grad then grad core iterations")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--local-batch", type=int, default=8, help="sequences per GPU per step")
    parser.add_argument("--ac-mode", default="per_iteration", choices=get_args(ACMode))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024)
    parser.add_argument("--attention-mask", default="causal", choices=ATTENTION_MASKS, help="training.attention_mask")
    parser.add_argument(
        "--document-len", type=int, default=256, help="mean document length under --attention-mask document"
    )
    parser.add_argument(
        "--ns-dtype", default="auto", choices=get_args(NSDtype), help="Muon's Newton-Schulz dtype (optimizer.ns_dtype)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1: the first compiles)")
    parser.add_argument("--peak-flops", type=float, help="per-device peak FLOP/s (default: the device table)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--jsonl", type=Path, help="also append the result as one JSON line to this file")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.document_len < 1:
        parser.error("--warmup, --steps and --document-len must be >= 1")
    return args


def trainer_overrides(args: argparse.Namespace, dump: str) -> list[str]:
    if args.preset:
        model = [
            "--model.path",
            "none",
            "--model.preset",
            args.preset,
            "--model.shape",
            args.shape,
            "--model.init",
            "random",
            "--data.tokenizer",
            str(REPO / "assets" / "tokenizer"),
        ]
    else:
        model = ["--model.path", args.model, "--model.preset", "none", "--model.shape", ""]
    return [
        *model,
        "--job.dump_folder",
        dump,
        "--training.steps",
        str(args.warmup + args.steps),
        "--training.local_batch_size",
        str(args.local_batch),
        "--training.seq_len",
        str(args.seq_len),
        "--training.ac_mode",
        args.ac_mode,
        "--training.compile",
        str(args.compile).lower(),
        "--training.loss_chunk_tokens",
        str(args.loss_chunk_tokens),
        "--training.attention_mask",
        args.attention_mask,
        "--optimizer.ns_dtype",
        args.ns_dtype,
        "--checkpoint.enable",
        "false",
        "--checkpoint.export_final",
        "false",
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.jsonl",
        "false",
        "--data.validation_fraction",
        "0",
        "--recurrence.curriculum",
        "none",
        "--training.global_batch_size",
        "none",
        *(["--metrics.peak_flops", str(args.peak_flops)] if args.peak_flops else []),
    ]


def build_trainer(args: argparse.Namespace, dump: str) -> Trainer:
    """The trainer of the debug config with this benchmark's overrides, without its data check and loader: the
    benchmark feeds random batches, and both read the config's corpus through `datasets` and `torchdata`, which
    a GPU machine may lack (P0-10 item 4)."""
    from titan_recur.config import load_config
    from titan_recur.training.trainer import Trainer

    cfg = load_config(str(REPO / "train_configs" / "debug_model.toml"), trainer_overrides(args, dump))
    with (
        mock.patch("titan_recur.training.preflight.check_data"),
        mock.patch("titan_recur.training.trainer.build_dataloader", return_value=None),
    ):
        return Trainer(cfg)


def random_batches(args: argparse.Namespace, vocab: int, eos_id: int | None, seed: int) -> Iterator[dict]:
    """Endless batches of random rows; given ``eos_id``, with documents of ~args.document_len tokens and their ids."""
    import torch

    from titan_recur.data.loader import document_ids

    gen = torch.Generator().manual_seed(seed)
    while True:
        rows = torch.randint(0, vocab, (args.local_batch, args.seq_len + 1), generator=gen)
        if eos_id is not None:
            rows[torch.rand(rows.shape, generator=gen) < 1 / args.document_len] = eos_id
        batch = {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}
        if eos_id is not None:
            batch["document_ids"] = document_ids(batch["input_ids"], eos_id)
        yield batch


def run(args: argparse.Namespace) -> dict:
    """Time the step at (n, k), split into its phases, then at (n + 4, k) and (n, k + 2): the differences are
    the cost of one no-grad and one grad iteration inside the real step (changing (n, k) compiles nothing new)."""
    import torch

    from titan_recur.training import cost_model
    from titan_recur.training.optim import Muon
    from titan_recur.training.profiling import STEP_PHASES

    n, k = (int(v) for v in args.num_steps.split(","))
    with tempfile.TemporaryDirectory() as dump:
        trainer = build_trainer(args, dump)
        device = trainer.dist.device
        eos_id = trainer.tokenizer.eos_id if args.attention_mask == "document" else None
        data = random_batches(args, trainer.model_args.vocab_size, eos_id, seed=trainer.dist.rank)

        def seconds_per_step(depth: tuple[int, int], steps: int) -> float:
            trainer.schedule.sample = lambda step, micro_step: depth
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                trainer.step += 1
                trainer.train_step(data)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / steps

        first_step = seconds_per_step((n, k), 1)
        if args.warmup > 1:
            seconds_per_step((n, k), args.warmup - 1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.phases.enabled = True
        seconds = seconds_per_step((n, k), args.steps)
        phases = {name: total / args.steps for name, total in trainer.phases.seconds().items()}
        trainer.phases.enabled = False
        memory = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        recurrent = trainer.model_args.is_recurrent
        no_grad_ms = 1000 * (seconds_per_step((n + 4, k), args.steps) - seconds) / 4 if recurrent else None
        grad_ms = 1000 * (seconds_per_step((n, k + 2), args.steps) - seconds) / 2 if recurrent else None
        world = trainer.dist.world_size
        tokens = args.local_batch * args.seq_len * trainer.grad_accum
        per_token = cost_model.training_flops_per_token(trainer.model_args, (n, k), args.seq_len, args.ac_mode)
        paper_per_token = cost_model.paper_flops_per_token(trainer.model_args, n + k, k)
        muon = next((opt for opt in trainer.optimizers.optimizers if isinstance(opt, Muon)), None)
        estimate = cost_model.memory_estimate(trainer.cfg, trainer.model_args, world, device.type).total
        peak = trainer.metrics.peak_flops
        result = {
            "model": args.preset or args.model,
            "shape": args.shape if args.preset else None,
            "num_steps": [n, k],
            "seq_len": args.seq_len,
            "local_batch": args.local_batch,
            "world_size": world,
            "ac_mode": args.ac_mode,
            "compile": args.compile,
            "attention_mask": args.attention_mask,
            "document_len": args.document_len if eos_id is not None else None,
            "device": str(device),
            "step_seconds": seconds,
            **{f"{name}_seconds": phases[name] for name in STEP_PHASES},
            "other_seconds": seconds - sum(phases.values()),
            "compile_seconds": first_step - seconds,
            "tokens_per_sec_per_device": tokens / seconds,
            "model_flops_per_token": per_token.total,
            "paper_flops_per_token": paper_per_token,
            "optimizer_flops_per_step": None if muon is None else muon.orthogonalisation_flops(),
            "peak_flops": peak,
            "mfu": cost_model.mfu(per_token.total * tokens / seconds, peak),
            "mfu_paper": cost_model.mfu(paper_per_token * tokens / seconds, peak),
            "peak_memory_gib": None if memory is None else memory / 2**30,
            "estimated_memory_gib": estimate / 2**30,
            "memory_vs_estimate": None if memory is None else memory / estimate,
            "no_grad_iteration_ms": no_grad_ms,
            "grad_iteration_ms": grad_ms,
        }
        trainer.close()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.jsonl:
        with args.jsonl.open("a") as out:
            out.write(json.dumps(result) + "\n")
    print(json.dumps(result) if args.json else describe(result))


def describe(result: dict) -> str:
    """The result as two lines: throughput, MFU in both conventions and memory; the step's time split."""

    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{1000 * seconds:.2f} ms"

    def percent(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    mem = "n/a" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f} GiB"
    documents = "" if result["document_len"] is None else f" (documents of ~{result['document_len']} tokens)"
    phases = [key.removesuffix("_seconds") for key in result if key.endswith("_seconds") and key != "step_seconds"]
    split = ", ".join(f"{name} {ms(result[f'{name}_seconds'])}" for name in phases if name != "compile")
    optimizer_flops = result["optimizer_flops_per_step"]
    iterations = [
        None if v is None else v / 1000 for v in (result["no_grad_iteration_ms"], result["grad_iteration_ms"])
    ]
    return (
        f"{result['model']} {result['shape'] or ''} (n,k)={tuple(result['num_steps'])} seq {result['seq_len']} "
        f"batch {result['local_batch']} ac {result['ac_mode']} compile {result['compile']} attention "
        f"{result['attention_mask']}{documents} world "
        f"{result['world_size']}: {result['tokens_per_sec_per_device']:,.0f} tok/s/device, MFU "
        f"{percent(result['mfu'])} (paper convention {percent(result['mfu_paper'])}), peak {mem} (preflight "
        f"estimate {result['estimated_memory_gib']:.3g} GiB), no-grad iteration {ms(iterations[0])}, grad "
        f"iteration {ms(iterations[1])}\n"
        f"  step {ms(result['step_seconds'])} = {split}; the first step took {ms(result['compile_seconds'])} more "
        f"(compilation, first allocations); Muon's Newton-Schulz: "
        f"{'n/a' if optimizer_flops is None else f'{optimizer_flops:.3g}'} FLOPs per step over all ranks"
    )


if __name__ == "__main__":
    main()
