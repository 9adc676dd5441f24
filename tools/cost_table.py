"""The README's cost table: what each paper config costs, estimated from the cost model.

For every paper config, and for the newer families' presets on the CC-Math recipe, on the paper's geometry (64 data-parallel ranks, one micro-step per step):
the training FLOPs in both conventions (training/cost_model.py; the full convention from 2,000 draws
of the trainer's sampler spread over the run, as `train --check` prints it) and the GPU-hours at an
assumed MFU of the dense bf16 peak. Estimates, not measurements: no GPU has measured this project's
MFU yet (docs/benchmarks.md).

    python tools/cost_table.py            # the markdown table README.md shows
    python tools/cost_table.py --mfu 0.3
"""

from __future__ import annotations

import argparse

from titan_recur.config import JobConfig, load_config
from titan_recur.models.args import PRESETS
from titan_recur.training import cost_model
from titan_recur.training.preflight import ASSUMED_MFU, full_flops_estimate
from titan_recur.utils.resources import project_folder

PAPER_CONFIGS = [
    "tinyllama_cc_math",
    "tinyllama_static_cc_math",
    "llama3_2_1b_cc_math",
    "llama3_2_1b_static_cc_math",
    "olmo2_1b_cc_math",
    "olmo2_1b_static_cc_math",
    "tinyllama_healing",
    "tinyllama_mixture",
    "llama3_2_1b_healing",
    "llama3_2_1b_mixture",
    "olmo2_1b_healing",
    "olmo2_1b_mixture",
]
# The newer families' presets on the CC-Math recipe (the Llama-3.2-1B config with the preset and its
# paper-style shape swapped in): what a retrofit of each would cost, before any config file is written.
RECIPE_FOR_PRESETS = "llama3_2_1b_cc_math"
NEW_FAMILY_PRESETS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "qwen3-1.7b", "smollm2-1.7b"]
WORLD_SIZE = 64
GPUS = (("H100/H200", "H100"), ("MI300X", "MI300X"))


def table(mfu: float) -> str:
    header = ["config", "shape", "tokens", "FLOPs (paper)", "FLOPs (full)"]
    header += [f"{label} GPU-h at MFU {mfu:g}" for label, _ in GPUS] + [f"hours on {WORLD_SIZE} H100"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, cfg in configs():
        run = cost_model.config_training_run(cfg, WORLD_SIZE)
        steps = cfg.training.steps
        full, _ = full_flops_estimate(run, steps)
        a = run.args
        shape = f"{a.n_prelude},{a.n_core},{a.n_coda}" if a.is_recurrent else f"{a.n_prelude} static"
        hours = [full / (cost_model.peak_flops(device_name=gpu) * mfu) / 3600 for _, gpu in GPUS]
        row = [
            name,
            shape,
            f"{steps * run.tokens_per_step:.3g}",
            f"{run.cumulative_flops(steps, 'paper'):.3e}",
            f"{full:.3e}",
            *(f"{h:,.0f}" for h in hours),
            f"{hours[0] / WORLD_SIZE:.1f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def configs() -> list[tuple[str, JobConfig]]:
    """(row label, config) of every row: the paper configs, then the newer families' presets."""
    folder = project_folder("train_configs")
    rows = [(f"`{name}`", load_config(str(folder / f"{name}.toml"))) for name in PAPER_CONFIGS]
    for preset in NEW_FAMILY_PRESETS:
        shape = ",".join(map(str, PRESETS[preset].default_shape))
        overrides = [
            "--model.preset",
            preset,
            "--model.shape",
            shape,
            "--model.path",
            f"checkpoints/converted/{preset}",
        ]
        rows.append(
            (
                f"`{preset}` on `{RECIPE_FOR_PRESETS}`",
                load_config(str(folder / f"{RECIPE_FOR_PRESETS}.toml"), overrides),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mfu", type=float, default=ASSUMED_MFU, help=f"assumed MFU (default {ASSUMED_MFU})")
    print(table(parser.parse_args(argv).mfu))


if __name__ == "__main__":
    main()
