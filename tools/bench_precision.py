"""Benchmark: what the two bf16 mixed-precision modes cost and give (training.mixed_precision_mode).

- fsdp:     FSDP2 casts the parameters to bf16 (MixedPrecisionPolicy(param_dtype=bf16)): every
            activation, the whole residual stream included, is bf16.
- autocast: FSDP2 keeps fp32 parameters and torch.autocast(bf16) wraps the forward, as the paper's
            code does: linear layers run in bf16, the embedding output (hence the prelude's residual
            stream) and RMSNorm stay fp32.

Both run through the real code path: one-process FSDP2 (gloo) with the policy
`mixed_precision_policy("cuda", ...)` returns on a GPU and the trainer's `forward_autocast` context.
Printed: the relative logit error ||logits - logits_fp32|| / ||logits_fp32|| at each test recurrence
r (r iterations, no grad, zero initial state so every mode starts from the same state) and the loss
difference; then the CPU seconds of a training step (fwd + bwd at (n, k) = (r - min(r, 8), min(r, 8)))
at --time-r. CPU times say little about a GPU (bf16 matmuls are emulated on CPUs without bf16
units); see docs/benchmarks.md for the GPU cost.

The model: random init of the given shape, or --model FOLDER (a converted model, e.g. the bundled
assets/tiny_llama_recurrent) with its adapter re-initialised at random, as the paper's conversion
leaves it; the inputs are random token ids.

    OMP_NUM_THREADS=1 python tools/bench_precision.py                                  # recurrent 2,2,2
    OMP_NUM_THREADS=1 python tools/bench_precision.py --shape 4,0,0 --recurrences 1 --time-r 0  # static
    OMP_NUM_THREADS=1 python tools/bench_precision.py --model assets/tiny_llama_recurrent --time-r 0
"""

from __future__ import annotations

import argparse
import time

from bench_models import add_shape_arguments, random_model, shape_model_args  # a sibling: tools/ is sys.path[0]

from titan_recur.models.families import BLOCK_TYPES

MODES = ("fp32", "fsdp", "autocast")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, vocab=2048, shape="2,2,2")
    parser.add_argument("--block-type", default="llama", choices=BLOCK_TYPES)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model", metavar="FOLDER", help="a converted model folder instead of a random init")
    parser.add_argument("--recurrences", default="1,8,32", help="test recurrences r")
    parser.add_argument("--time-r", type=int, default=8, help="time a training step at this r (0: no timing)")
    parser.add_argument("--repeats", type=int, default=2, help="timed training steps per mode, after a warm-up")
    parser.add_argument("--seeds", default="0,1,2,3", help="model inits (and input draws) to average the errors over")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, mode: str, seed: int):
    """The same model for every mode, wrapped by one-process FSDP2 with that mode's policy."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from titan_recur.storage.model_io import load_model
    from titan_recur.training.parallelize import apply_fsdp, build_dp_mesh, mixed_precision_policy

    torch.manual_seed(seed)
    if args.model:
        model = load_model(args.model)
        model.core.adapter.reset_parameters()  # the reference's random adapter (nn.Linear's init)
    else:
        model = random_model(shape_model_args(args, block_type=args.block_type), seed)
    model.args.state_init = "zero"
    policy = MixedPrecisionPolicy() if mode == "fp32" else mixed_precision_policy("cuda", "bfloat16", "float32", mode)
    apply_fsdp(model, build_dp_mesh("cpu", 1, 1, -1), policy)
    return model


def context(mode: str):
    from titan_recur.training.parallelize import forward_autocast

    return forward_autocast("cpu", "bfloat16", "fsdp" if mode == "fp32" else mode)


def eval_logits(model, mode: str, ids, r: int):
    import torch

    with torch.no_grad(), context(mode):
        return model(ids, r).float()


def step_seconds(model, mode: str, ids, r: int, repeats: int) -> float:
    """CPU seconds of one training step (this process, all threads), after a warm-up step."""
    import torch

    k = min(r, 8)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        with context(mode):
            logits = model(inputs, (r - k, k))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        model.zero_grad(set_to_none=True)

    step()
    start = time.process_time()
    for _ in range(repeats):
        step()
    return (time.process_time() - start) / repeats


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seeds = [int(v) for v in args.seeds.split(",")]
    recurrences = [int(v) for v in args.recurrences.split(",")]
    errors: dict[tuple[int, str], list[float]] = {}
    losses: dict[tuple[int, str], list[float]] = {}
    for seed in seeds:
        models = {mode: build(args, mode, seed) for mode in MODES}
        vocab = models["fp32"].args.vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(seed))
        for r in recurrences:
            reference = eval_logits(models["fp32"], "fp32", ids[:, :-1], r)
            ref_loss = torch.nn.functional.cross_entropy(reference.flatten(0, 1), ids[:, 1:].flatten())
            for mode in MODES[1:]:
                logits = eval_logits(models[mode], mode, ids[:, :-1], r)
                errors.setdefault((r, mode), []).append(float((logits - reference).norm() / reference.norm()))
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                losses.setdefault((r, mode), []).append(abs(float(loss - ref_loss)))
    a = models["fp32"].args
    source = args.model or "random init"
    print(
        f"# {source}: shape {a.n_prelude},{a.n_core},{a.n_coda} {a.block_type} d={a.dim} ffn {a.ffn_dim} vocab "
        f"{a.vocab_size}, random adapter, zero state; batch {args.batch} x seq {args.seq_len}; seeds {args.seeds}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    print("| r | mode | rel. logit error vs fp32, mean (min-max) | abs. loss difference, mean |")
    print("|---|---|---|---|")
    for (r, mode), values in errors.items():
        mean = sum(values) / len(values)
        loss = sum(losses[r, mode]) / len(values)
        print(f"| {r} | {mode} | {mean:.2e} ({min(values):.2e}-{max(values):.2e}) | {loss:.1e} |")
    if args.time_r:
        print(f"\n| mode | CPU s per training step at r = {args.time_r} | / fp32 |")
        print("|---|---|---|")
        base = None
        for mode in MODES:
            seconds = step_seconds(models[mode], mode, ids, args.time_r, args.repeats)  # the last seed's model
            base = base or seconds
            print(f"| {mode} | {seconds:.3f} | {seconds / base:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
