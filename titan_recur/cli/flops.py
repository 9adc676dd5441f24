"""FLOPs of a depth-recurrent training run: per token, cumulative under the curriculum, compute-matched.

Two conventions (see titan_recur/training/cost_model.py): "paper" (6 * tokens * non-embedding params, scheduled
mean r, as the reference reports) and "full" (matmul FLOPs of the (n, k) actually sampled per
micro-step, with attention, adapter and LM head).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from titan_recur.cli.kit import OneLineParser, run_command
from titan_recur.config import Recurrence, Training, load_config
from titan_recur.convert.surgery import parse_shape
from titan_recur.models.args import CURRICULUM_KINDS, PRESETS, ModelArgs
from titan_recur.storage.model_io import read_model_args
from titan_recur.training.cost_model import (
    AC_MODES,
    CONVENTIONS,
    TrainingRun,
    config_training_run,
    document_masking_note,
    eval_flops_per_token,
    paper_flops_per_token,
    param_counts,
    training_flops_per_token,
)
from titan_recur.training.recurrence import Curriculum, RecurrenceSchedule

PROG = "titan-recur-flops"
# Flags that describe the run, and the config keys that take their place under --config.
SCHEDULE_FLAGS = {
    "preset": "model.preset",
    "shape": "model.shape",
    "model": "model.path",
    "steps": "training.steps",
    "curriculum": "recurrence.curriculum",
    "warmup_fraction": "recurrence.warmup_fraction",
    "max_mean": "recurrence.mean_recurrence",
    "start": "recurrence.start",
    "backprop_depth": "recurrence.backprop_depth",
    "tokens_per_step": "training.global_batch_size",
    "seq_len": "training.seq_len",
    "micro_steps": "training.global_batch_size",
    "ac_mode": "training.ac_mode",
}
# Without --config, a run has the trainer's defaults (titan_recur.config), as a config file that sets nothing.
_TRAINING, _RECURRENCE = Training(), Recurrence()
DEFAULTS = dict(
    steps=_TRAINING.steps,
    curriculum=_RECURRENCE.curriculum,
    warmup_fraction=_RECURRENCE.warmup_fraction,
    max_mean=_RECURRENCE.mean_recurrence,
    start=_RECURRENCE.start,
    backprop_depth=_RECURRENCE.backprop_depth,
    seq_len=_TRAINING.seq_len,
    micro_steps=1,
    ac_mode=_TRAINING.ac_mode,
)

EPILOG = """\
examples:
  # the paper's TinyLlama 4,8,4 run: 50k steps, 1-sqrt curriculum over 75% to mean 32, 64 GPUs x 16 x 1024
  # = 2^20 tokens/step (the trainer's defaults; --world-size sets the GPUs)
  python tools/flops.py --preset tinyllama-1.1b --shape 4,8,4 --world-size 64

  # FLOPs after 20k steps of a run to mean 4, as JSON
  python tools/flops.py --preset tinyllama-1.1b --shape 4,8,4 --world-size 64 --max-mean 4 --at-step 20000 --json

  # how many steps of the static TinyLlama cost as much; table every 10% of the run
  python tools/flops.py --preset tinyllama-1.1b --shape 4,8,4 --world-size 64 --match tinyllama-1.1b:static --table

  # per-token FLOPs at n=24 no-grad + k=8 grad iterations, with activation-checkpointing recompute
  python tools/flops.py --preset llama3.2-1b --shape 4,6,4 --num-steps 24,8 --ac-mode per_iteration

  # a train config with trainer-style overrides; tokens/step = training.global_batch_size (or, unset,
  # local_batch_size * --world-size) * seq_len, each micro-step drawing its own (n, k)
  python tools/flops.py --config train_configs/tinyllama.toml --training.steps 1000 --world-size 64

OTHER (--match): PRESET, PRESET:P,R,C, PRESET:static, a converted model folder (these share this
run's schedule and batch), or a train config file (its own schedule and batch).

Without --config, the schedule and batch are the trainer's defaults (python -m titan_recur.train
--help): tokens/step = training.local_batch_size (16) x --world-size x --seq-len unless
--tokens-per-step is given. Every figure is printed with the assumptions it used.

Steps are numbered 1..S as in the trainer: FLOPs "at step S" count steps 1..S, and "full" replays
the trainer's (n, k) draws (seeded by step and micro-step). "full" counts matmuls
only (norms and elementwise ops excluded) and attention over the full T x T square.
"""


# The FLOPs of a run are summed step by step (each step has its own mean recurrence): ~1 min per 10^6 steps.
MAX_STEPS = 1_000_000


@dataclass
class Setup:
    """A model and how it is trained: everything the FLOP counts need."""

    label: str
    args: ModelArgs
    steps: int
    schedule: RecurrenceSchedule
    tokens_per_step: int
    seq_len: int
    micro_steps: int
    ac_mode: str
    preset: str | None = None
    curriculum: str = ""  # how the mean recurrence ramps, for the printed assumptions
    attention_mask: str = "causal"  # training.attention_mask: the counts are the same, the note says why

    def run(self) -> TrainingRun:
        return TrainingRun(self.args, self.schedule, self.tokens_per_step, self.seq_len, self.micro_steps)

    def final_num_steps(self) -> tuple[int, int]:
        """(n, k) at the final scheduled mean: the last backprop-depth iterations carry grad."""
        mean, depth = self.schedule.mean(self.steps), self.schedule.backprop_depth(self.steps)
        return max(mean - depth, 0), min(mean, depth)


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog=PROG,
        description=__doc__,
        allow_abbrev=False,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (one of --preset/--model/--config, required)")
    model.add_argument("--preset", choices=sorted(PRESETS), help="source-model shape without weights")
    model.add_argument(
        "--shape", metavar="P,R,C", help="layers for --preset (default: the preset's); 'static' = all, no loop"
    )
    model.add_argument("--model", metavar="PATH", help="converted model folder (its config.json)")
    model.add_argument(
        "--config", metavar="FILE", help="train config TOML; trainer-style --section.key VALUE overrides follow it"
    )
    # Schedule and batch flags default to None so that --config can reject them; DEFAULTS fills them in.
    d = DEFAULTS
    sched = p.add_argument_group("schedule (ignored by static models)")
    sched.add_argument("--steps", type=int, metavar="N", help=f"optimizer steps of the run (default {d['steps']})")
    sched.add_argument(
        "--curriculum", choices=CURRICULUM_KINDS, help=f"mean-recurrence ramp (default {d['curriculum']})"
    )
    sched.add_argument(
        "--warmup-fraction",
        type=float,
        metavar="F",
        help=f"fraction of steps the ramp takes (default {d['warmup_fraction']})",
    )
    sched.add_argument(
        "--max-mean", type=int, metavar="R", help=f"mean recurrence the curriculum reaches (default {d['max_mean']})"
    )
    sched.add_argument("--start", type=int, metavar="R", help=f"mean recurrence at step 0 (default {d['start']})")
    sched.add_argument(
        "--backprop-depth",
        type=int,
        metavar="D",
        help=f"grad-carrying iterations, the paper's 8 (default {d['backprop_depth']})",
    )
    batch = p.add_argument_group("batch")
    batch.add_argument(
        "--tokens-per-step",
        type=int,
        metavar="N",
        help=f"tokens per optimizer step (default training.local_batch_size {_TRAINING.local_batch_size} x "
        "--world-size x --seq-len; 64 GPUs at seq 1024: 2**20, the paper's)",
    )
    batch.add_argument(
        "--seq-len", type=int, metavar="T", help=f"sequence length, for attention FLOPs (default {d['seq_len']})"
    )
    batch.add_argument(
        "--micro-steps",
        type=int,
        metavar="M",
        help=f"gradient-accumulation micro-steps per step, each with its own (n, k) (default {d['micro_steps']})",
    )
    batch.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="W",
        help="data-parallel ranks: tokens/step without --tokens-per-step; with --config, "
        "global_batch_size / (local_batch_size * W) micro-steps per step (default 1)",
    )
    batch.add_argument(
        "--ac-mode",
        choices=AC_MODES,
        help=f"activation checkpointing, for the recompute figure (default {d['ac_mode']})",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--num-steps",
        metavar="n,k",
        help="per-token FLOPs at n no-grad + k grad iterations (default: the final mean split by the backprop depth)",
    )
    out.add_argument("--at-step", type=int, metavar="S", help="cumulative FLOPs after S steps (default --steps)")
    out.add_argument("--match", metavar="OTHER", help="steps of OTHER costing the same FLOPs (see below)")
    out.add_argument(
        "--table",
        action="store_true",
        help="cumulative FLOPs every 10%% of the run, with matched steps of OTHER (default: the preset's static model)",
    )
    out.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def parse_num_steps(text: str) -> tuple[int, int]:
    """--num-steps '24,8' -> (24, 8): n no-grad and k grad iterations."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < 0:
        raise ValueError(f"--num-steps must be 2 comma-separated integers >= 0, got {text!r}")
    return values[0], values[1]


def preset_args(name: str, shape: str | None) -> ModelArgs:
    preset = PRESETS[name]
    if shape == "static":
        return preset.model_args(preset.n_layers, 0, 0)
    return preset.model_args(*(parse_shape(shape) if shape else preset.default_shape))


def shape_label(args: ModelArgs) -> str:
    kind = "recurrent" if args.is_recurrent else "static"
    return f"{args.n_prelude},{args.n_core},{args.n_coda} ({kind})"


def describe_curriculum(kind: str, mean: int, fraction: float, start: int) -> str:
    return f"{kind} curriculum of the mean r from {start} to {mean} over {fraction:g} of the steps"


def schedule_from_flags(ns: argparse.Namespace) -> RecurrenceSchedule:
    mean = Curriculum(ns.curriculum, ns.max_mean, ns.steps, ns.warmup_fraction, ns.start)
    return RecurrenceSchedule(mean, ns.backprop_depth)


def setup_from_flags(ns: argparse.Namespace) -> Setup:
    if ns.model and (ns.preset or ns.shape):
        raise ValueError("--model takes its shape from the folder's config.json; drop --preset/--shape")
    if ns.model:
        args, label, preset = read_model_args(ns.model), ns.model, None
    elif ns.preset:
        preset = ns.preset
        args = preset_args(preset, ns.shape)
        label = f"{preset} {shape_label(args)}"
    else:
        raise ValueError(
            f"give --preset ({', '.join(sorted(PRESETS))}), --model FOLDER or --config FILE: the model to count"
        )
    return Setup(
        label,
        args,
        ns.steps,
        schedule_from_flags(ns),
        ns.tokens_per_step,
        ns.seq_len,
        ns.micro_steps,
        ns.ac_mode,
        preset,
        describe_curriculum(ns.curriculum, ns.max_mean, ns.warmup_fraction, ns.start),
    )


def setup_from_config(path: str, overrides: list[str], world_size: int) -> Setup:
    """Shape, schedule and batch of a train config; tokens/step = global batch (sequences) * seq_len."""
    cfg = load_config(path, overrides)
    run = config_training_run(cfg, world_size)
    label = cfg.model.path or f"{cfg.model.preset} {shape_label(run.args)}"
    r = cfg.recurrence
    assert run.schedule is not None  # config_training_run always builds one
    return Setup(
        f"{label} [{path}]",
        run.args,
        cfg.training.steps,
        run.schedule,
        run.tokens_per_step,
        run.seq_len,
        run.micro_steps,
        cfg.training.ac_mode,
        cfg.model.preset,
        describe_curriculum(r.curriculum, r.mean_recurrence, r.warmup_fraction, r.start),
        cfg.training.attention_mask,
    )


def resolve_flags(ns: argparse.Namespace, extra: list[str]) -> Setup:
    """The run described on the command line: a config (+ overrides) or the schedule flags."""
    if ns.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {ns.world_size}")
    if ns.config:
        given = [f"--{k.replace('_', '-')}" for k in SCHEDULE_FLAGS if getattr(ns, k) is not None]
        if given:
            keys = sorted({SCHEDULE_FLAGS[g[2:].replace("-", "_")] for g in given})
            raise ValueError(
                f"{', '.join(given)} cannot be combined with --config: override {', '.join(keys)} "
                f"as --section.key VALUE instead"
            )
        return setup_from_config(ns.config, extra, ns.world_size)
    if extra:
        raise ValueError(f"unrecognized arguments: {' '.join(extra)} (--section.key overrides need --config)")
    for key, value in DEFAULTS.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    if ns.tokens_per_step is None:
        ns.tokens_per_step = _TRAINING.local_batch_size * ns.world_size * ns.seq_len
    return setup_from_flags(ns)


def resolve_other(text: str, base: Setup, world_size: int) -> Setup:
    """--match OTHER: a preset[:shape], a model folder (same schedule/batch) or a config file."""
    name, _, shape = text.partition(":")
    if name in PRESETS:
        args = preset_args(name, shape or None)
        return replace(base, label=f"{name} {shape_label(args)}", args=args, preset=name)
    path = Path(text)
    if path.is_dir():
        return replace(base, label=text, args=read_model_args(path), preset=None)
    if path.is_file():
        return setup_from_config(text, [], world_size)
    raise ValueError(
        f"--match {text!r} is neither a preset ({', '.join(sorted(PRESETS))}), a model folder nor a config file"
    )


def static_of(base: Setup) -> Setup | None:
    """The base's source model without recurrence, when a preset says what that is."""
    if base.preset is None:
        return None
    return resolve_other(f"{base.preset}:static", base, 1)


def report(ns: argparse.Namespace, setup: Setup) -> dict:
    """Every number the tool prints, as one JSON-able dict."""
    at_step = setup.steps if ns.at_step is None else ns.at_step
    if not 1 <= setup.steps <= MAX_STEPS:
        raise ValueError(f"steps must be in [1, {MAX_STEPS:,}] (FLOPs are summed step by step), got {setup.steps}")
    if not 0 <= at_step <= setup.steps:
        raise ValueError(f"--at-step must be in [0, {setup.steps}] (the run's steps), got {at_step}")
    num_steps = parse_num_steps(ns.num_steps) if ns.num_steps else setup.final_num_steps()
    other = resolve_other(ns.match, setup, ns.world_size) if ns.match else None
    per_token = training_flops_per_token(setup.args, num_steps, setup.seq_len, setup.ac_mode)
    mean = setup.schedule.mean(setup.steps)
    counts = param_counts(setup.args)
    run = setup.run()
    out: dict[str, Any] = {
        "model": setup.label,
        "assumptions": assumptions(ns, setup),
        "recurrent": setup.args.is_recurrent,
        "params": {**vars(counts), "non_embedding": counts.non_embedding, "total": counts.total},
        "steps": setup.steps,
        "tokens_per_step": setup.tokens_per_step,
        "seq_len": setup.seq_len,
        "micro_steps": setup.micro_steps,
        "num_steps": list(num_steps),
        "ac_mode": setup.ac_mode,
        "flops_per_token": per_token.total,
        "flops_per_token_breakdown": per_token.to_dict(),
        "eval_flops_per_token": eval_flops_per_token(setup.args, max(sum(num_steps), 1), setup.seq_len),
        "paper_flops_per_token": paper_flops_per_token(setup.args, mean, setup.schedule.backprop_depth(setup.steps)),
        "at_step": at_step,
        "tokens": at_step * setup.tokens_per_step,
        "paper_flops": run.cumulative_flops(at_step, "paper"),
        "full_flops": run.cumulative_flops(at_step, "full"),
    }
    if other is not None:
        other_run = other.run()
        out["matched_steps"] = {
            "other": other.label,
            **{c: other_run.steps_for_flops(out[f"{c}_flops"], c) for c in CONVENTIONS},
        }
    if ns.table:
        out["table"] = table(setup, run, other or static_of(setup))
    return out


def assumptions(ns: argparse.Namespace, setup: Setup) -> dict:
    """What the figures assume about the run: where the schedule and batch came from, and their values."""
    schedule = setup.schedule
    return {
        "source": ns.config or "the trainer's defaults and the flags given",
        "world_size": ns.world_size,
        "tokens_per_step": setup.tokens_per_step,
        "seq_len": setup.seq_len,
        "micro_steps": setup.micro_steps,
        "steps": setup.steps,
        "curriculum": setup.curriculum if setup.args.is_recurrent else None,
        "backprop_depth": schedule.backprop_depth(setup.steps) if setup.args.is_recurrent else None,
        "ac_mode": setup.ac_mode,
        "attention_mask": setup.attention_mask,
    }


def table(setup: Setup, run: TrainingRun, other: Setup | None) -> dict:
    """Cumulative FLOPs every 10% of the run, and the steps of ``other`` costing as much."""
    other_run = other.run() if other is not None else None
    rows = []
    for tenth in range(11):
        step = setup.steps * tenth // 10
        row: dict[str, float] = {"step": step, "mean": setup.schedule.mean(max(step, 1))}
        for c in CONVENTIONS:
            row[f"{c}_flops"] = run.cumulative_flops(step, c)
        for c in CONVENTIONS:
            if other_run is not None:
                row[f"matched_{c}"] = other_run.steps_for_flops(row[f"{c}_flops"], c)
        rows.append(row)
    return {"other": other.label if other is not None else None, "rows": rows}


def print_text(out: dict) -> None:
    params, bd = out["params"], out["flops_per_token_breakdown"]
    n, k = out["num_steps"]
    a = out["assumptions"]
    print(f"model: {out['model']}")
    recurrence = f", {a['curriculum']}, backprop depth {a['backprop_depth']}" if a["curriculum"] else ""
    print(
        f"  assuming ({a['source']}): {a['steps']:,} steps of {a['tokens_per_step']:,} tokens (world size "
        f"{a['world_size']}, {a['micro_steps']} micro-step(s)/step, seq_len {a['seq_len']}){recurrence}, "
        f"ac_mode {a['ac_mode']}"
    )
    print(
        f"  params: total {params['total']:,}, non-embedding {params['non_embedding']:,} "
        f"(prelude {params['prelude']:,}, core {params['core']:,}, coda {params['coda']:,}), "
        f"adapter {params['adapter']:,}, embedding {params['embedding']:,}, head {params['head']:,}"
    )
    at = f"at (n, k) = ({n}, {k})" if out["recurrent"] else "(static model)"
    print(f"per-token FLOPs of a training micro-step {at}, seq_len {out['seq_len']}:")
    recompute = f"  (+ recompute {bd['recompute']:.4e}, ac_mode {out['ac_mode']})" if bd["recompute"] else ""
    print(f"  forward {bd['forward']:.4e}  backward {bd['backward']:.4e}  total {bd['total']:.4e}{recompute}")
    if a["attention_mask"] == "document":
        print(f"  {document_masking_note()}")
    eval_at = f" at r = {max(n + k, 1)}" if out["recurrent"] else ""
    print(
        f"  eval forward{eval_at}: {out['eval_flops_per_token']:.4e}; "
        f"paper convention at the final mean: {out['paper_flops_per_token']:.4e}"
    )
    print(
        f"cumulative training FLOPs after {out['at_step']:,} of {out['steps']:,} steps "
        f"({out['tokens']:.4e} tokens, {out['micro_steps']} micro-step(s)/step):"
    )
    print(f"  paper {out['paper_flops']:.4e}   full {out['full_flops']:.4e}")
    if "matched_steps" in out:
        m = out["matched_steps"]
        print(f"same FLOPs as {m['other']}: {m['paper']:,.1f} steps (paper), {m['full']:,.1f} steps (full)")
    if "table" in out:
        t = out["table"]
        matched = t["other"] is not None
        head = f"{'step':>8} {'mean r':>6} {'paper FLOPs':>12} {'full FLOPs':>12}"
        print(("\n" + head + (f" {'matched paper':>14} {'matched full':>14}" if matched else "")).rstrip())
        for row in t["rows"]:
            line = f"{row['step']:>8} {row['mean']:>6} {row['paper_flops']:>12.4e} {row['full_flops']:>12.4e}"
            if matched:
                line += f" {row['matched_paper']:>14,.1f} {row['matched_full']:>14,.1f}"
            print(line)
        if matched:
            print(f"matched: steps of {t['other']} costing the same FLOPs")


def main(argv: list[str] | None = None) -> int:
    ns, extra = build_parser().parse_known_args(argv)
    return run_command(PROG, lambda: show(report(ns, resolve_flags(ns, extra)), ns.json))


def show(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        print_text(out)


if __name__ == "__main__":
    sys.exit(main())
