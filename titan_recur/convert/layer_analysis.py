"""Layer-selection analysis: which source layers a surgery should drop and which it should loop.

The paper picks the prelude, core, coda and the dropped span by hand. This module measures, on
calibration tokens and before any training, what those choices cost:

- per layer l: block influence 1 - cos(h_l, h_{l+1}) (ShortGPT, Men et al. 2024), the loss when the
  layer alone is dropped, and the hidden-state norms, with h_l the residual stream entering layer l
  (h_L leaves the last layer, before the final norm);
- per span: the angular distance arccos(cos(h_l, h_{l+n})) / pi between the input of layer l and of
  layer l + n (Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper Layers"): small
  means layers l .. l+n-1 barely turn the residual stream, so they are the ones to drop;
- per candidate surgery: the summed angular distance of its dropped spans, and the held-out loss of
  the converted model itself, with the identity adapter at r = 1 (the healing start) and with the
  reference's random adapter at several r.

The source runs as titan_recur's static model with all its layers, so Llama (pre-norm) and OLMo-2
(post-norm) blocks take one code path; candidates are converted in memory by the same code as
``tools/convert_hf.py``. Statistics average over every token position of the calibration rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from titan_recur.convert.surgery import (
    ConversionError,
    ConvertOptions,
    LayerPlan,
    SourceModel,
    SourceWeights,
    converted_state_dict,
    format_layers,
    plan_layers,
)
from titan_recur.models.model import RecurrentLM
from titan_recur.storage.model_io import load_state_dict_into
from titan_recur.training.validation import mean_losses, validation_loss_sums

Batch = dict[str, torch.Tensor]
JSON_NAME = "layer_analysis.json"
INFLUENCE_PLOT = "influence.png"
ANGULAR_PLOT = "angular_distance.png"
RANDOM_RECURRENCES = (1, 2, 4)


class InMemoryWeights(SourceWeights):
    """Source tensors by HF name, read once onto the analysis device; every conversion shares them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @classmethod
    def load(cls, source: SourceModel, device: torch.device | str, dtype: torch.dtype) -> InMemoryWeights:
        weights = SourceWeights(source.folder)
        return cls({name: _cast(weights.get(name), device, dtype) for name in weights.files})

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _cast(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def build_model(
    source: SourceModel, plan: LayerPlan, weights: InMemoryWeights, options: ConvertOptions | None = None
) -> RecurrentLM:
    """The model ``tools/convert_hf.py`` would write for this plan, built in memory on the weights' device."""
    args, state = converted_state_dict(
        source, plan, dataclasses.replace(options or ConvertOptions(), dtype="source"), weights
    )
    embedding = weights.get("model.embed_tokens.weight")
    with torch.device("meta"):
        model = RecurrentLM(args)
    model = model.to(embedding.dtype).to_empty(device=embedding.device)
    load_state_dict_into(model, state, str(source.folder))
    return model.eval()


def static_plan(n_layers: int, drop: Sequence[int] = ()) -> LayerPlan:
    """All source layers in order as one static stack, less ``drop``."""
    return plan_layers(n_layers, prelude=[i for i in range(n_layers) if i not in drop], static=True)


# ---------------------------------------------------------------- per-layer statistics


@dataclass
class LayerStatistics:
    """Token means over the residual streams h_0 .. h_L (h_l enters layer l; h_L leaves the last one)."""

    tokens: int
    cosine: torch.Tensor  # (L+1, L+1): mean cos(h_i, h_j)
    angular: torch.Tensor  # (L+1, L+1): mean arccos(cos(h_i, h_j)) / pi
    norms: torch.Tensor  # (L+1,): mean ||h_i||_2

    @property
    def n_layers(self) -> int:
        return self.norms.numel() - 1

    def block_influence(self) -> list[float]:
        """1 - cos(input, output) of each layer: ~0 for a layer that leaves the stream's direction alone."""
        return [1.0 - float(self.cosine[i, i + 1]) for i in range(self.n_layers)]

    def angular_distance(self, start: int, n: int) -> float:
        """Angular distance between the input of layer ``start`` and of layer ``start + n``."""
        return float(self.angular[start, start + n])

    def most_redundant_spans(self) -> list[dict[str, Any]]:
        """For each span length n, the n consecutive layers whose removal turns the stream least."""
        spans = []
        for n in range(1, self.n_layers + 1):
            start = min(range(self.n_layers - n + 1), key=lambda i: self.angular_distance(i, n))
            distance = self.angular_distance(start, n)
            spans.append({"n": n, "layers": [start, start + n - 1], "angular_distance": distance})
        return spans


def residual_streams(model: RecurrentLM, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """h_0 .. h_L of a static model (the embedding output and every block's output)."""
    if model.core is not None or model.coda:
        raise ValueError("residual_streams needs a static model (all layers in the prelude)")
    streams: list[torch.Tensor] = []
    record = lambda module, inputs, output: streams.append(output)  # noqa: E731
    hooks = [module.register_forward_hook(record) for module in (model.embed_tokens, *model.prelude)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return streams


def layer_statistics(model: RecurrentLM, batches: Sequence[Batch], progress: bool = False) -> LayerStatistics:
    """Cosines, angular distances and norms between every pair of residual streams, averaged over tokens.

    Computed in float64: the angle of a near-identity layer is ~1e-3, where float32 cosines lose it.
    """
    device = model.embed_tokens.weight.device
    n = len(model.prelude) + 1
    cos_sum = torch.zeros(n, n, dtype=torch.float64, device=device)
    angle_sum = torch.zeros_like(cos_sum)
    norm_sum = torch.zeros(n, dtype=torch.float64, device=device)
    tokens = 0
    for batch in tqdm(batches, desc="statistics", unit="batch", disable=not progress):
        streams = torch.stack(residual_streams(model, batch["input_ids"].to(device))).flatten(1, 2).double()
        norms = streams.norm(dim=-1)  # (L+1, tokens)
        units = streams / norms.clamp_min(1e-30)[..., None]
        cos = torch.einsum("itd,jtd->ijt", units, units).clamp(-1.0, 1.0)
        cos_sum += cos.sum(-1)
        angle_sum += torch.arccos(cos).sum(-1) / math.pi
        norm_sum += norms.sum(-1)
        tokens += streams.shape[1]
    if tokens == 0:
        raise ValueError("no calibration tokens")
    return LayerStatistics(tokens, (cos_sum / tokens).cpu(), (angle_sum / tokens).cpu(), (norm_sum / tokens).cpu())


def model_loss(model: RecurrentLM, batches: Sequence[Batch], recurrences: Sequence[int] = (1,)) -> dict[int, float]:
    """Held-out loss per recurrence, as ``python -m titan_recur.eval loss`` measures it (zero state)."""
    return mean_losses(validation_loss_sums(model, batches, recurrences, model.embed_tokens.weight.device))


def drop_one_losses(
    source: SourceModel, weights: InMemoryWeights, batches: Sequence[Batch], progress: bool = False
) -> list[float]:
    """Loss of the source model with each layer removed alone."""
    losses = []
    for layer in tqdm(range(source.n_layers), desc="drop each layer", unit="layer", disable=not progress):
        losses.append(model_loss(build_model(source, static_plan(source.n_layers, [layer]), weights), batches)[1])
    return losses


# ---------------------------------------------------------------- candidate surgeries


def shapes_for_budget(n_layers: int, budget: int) -> list[tuple[int, int, int]]:
    """Every (P, R, C) with P + R + C = budget and P, R, C >= 1."""
    if budget < 3:
        raise ConversionError(f"budget {budget} is too small: a prelude, core and coda need at least 3 layers")
    if budget > n_layers:
        raise ConversionError(f"budget {budget} is larger than the model: the source has {n_layers} layers")
    return [(p, r, budget - p - r) for p in range(1, budget - 1) for r in range(1, budget - p)]


def candidate_plans(n_layers: int, shapes: Iterable[tuple[int, int, int]]) -> list[LayerPlan]:
    """Prelude = first P layers, coda = last C, core = any R consecutive layers between them; the rest dropped."""
    plans = []
    for shape in shapes:
        plan_layers(n_layers, shape)  # the shape must fit (one-line error otherwise)
        p, r, c = shape
        for start in range(p, n_layers - c - r + 1):
            plans.append(
                plan_layers(
                    n_layers, prelude=range(p), core=range(start, start + r), coda=range(n_layers - c, n_layers)
                )
            )
    return plans


def dropped_spans(plan: LayerPlan) -> list[tuple[int, int]]:
    """(first layer, length) of each run of consecutive dropped layers."""
    spans: list[list[int]] = []
    for i in plan.dropped:
        if spans and i == spans[-1][0] + spans[-1][1]:
            spans[-1][1] += 1
        else:
            spans.append([i, 1])
    return [(start, n) for start, n in spans]


def angular_score(plan: LayerPlan, stats: LayerStatistics) -> float:
    """Summed angular distance across the dropped spans: how far the stream turns where the surgery cuts."""
    return sum(stats.angular_distance(start, n) for start, n in dropped_spans(plan))


def is_paper_placement(plan: LayerPlan) -> bool:
    """The paper's rule: the core is the R layers just before the coda."""
    return plan.core == tuple(
        range(plan.n_source_layers - len(plan.coda) - len(plan.core), plan.n_source_layers - len(plan.coda))
    )


def convert_command(source_name: str, plan: LayerPlan) -> str:
    """The ``tools/convert_hf.py`` command that writes this candidate."""
    shape = f"{len(plan.prelude)}_{len(plan.core)}_{len(plan.coda)}"
    out = f"checkpoints/converted/{Path(source_name).name}_{shape}_core{format_layers(plan.core)}"
    parts = ["python tools/convert_hf.py", source_name, out]
    for part in ("prelude", "core", "coda"):
        if getattr(plan, part):
            parts += [f"--{part}", format_layers(getattr(plan, part))]
    return " ".join(parts)


def measure_candidate(
    source: SourceModel,
    weights: InMemoryWeights,
    plan: LayerPlan,
    batches: Sequence[Batch],
    recurrences: Sequence[int] = RANDOM_RECURRENCES,
    seed: int = 0,
) -> dict[str, Any]:
    """Held-out loss of the converted candidate: identity adapter at r = 1, random adapter at each r."""
    identity = model_loss(build_model(source, plan, weights, ConvertOptions(adapter_init="identity")), batches)
    random_model = build_model(source, plan, weights, ConvertOptions(adapter_init="random", seed=seed))
    random = model_loss(random_model, batches, recurrences)
    return {"loss_identity_r1": identity[1], "loss_random": {str(r): loss for r, loss in random.items()}}


def rank_candidates(
    source: SourceModel,
    source_name: str,
    weights: InMemoryWeights,
    plans: Sequence[LayerPlan],
    stats: LayerStatistics,
    batches: Sequence[Batch],
    *,
    measure: int,
    recurrences: Sequence[int] = RANDOM_RECURRENCES,
    seed: int = 0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Candidates by angular score; the ``measure`` most redundant ones also converted and measured.

    Measured candidates come first, by identity-adapter loss at r = 1; the rest follow by angular score.
    """
    by_angle = sorted(plans, key=lambda plan: angular_score(plan, stats))
    rows = []
    for rank, plan in enumerate(tqdm(by_angle, desc="candidates", unit="cand", disable=not progress), start=1):
        row: dict[str, Any] = {
            "prelude": list(plan.prelude),
            "core": list(plan.core),
            "coda": list(plan.coda),
            "dropped": list(plan.dropped),
            "angular_score": angular_score(plan, stats),
            "angular_rank": rank,
            "paper_placement": is_paper_placement(plan),
            "command": convert_command(source_name, plan),
        }
        if rank <= measure:
            row.update(measure_candidate(source, weights, plan, batches, recurrences, seed))
        rows.append(row)
    measured = sorted((r for r in rows if "loss_identity_r1" in r), key=lambda r: float(r["loss_identity_r1"]))
    return measured + [r for r in rows if "loss_identity_r1" not in r]


# ---------------------------------------------------------------- the whole analysis


def analyze(
    source: SourceModel,
    source_name: str,
    batches: Sequence[Batch],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    plans: Sequence[LayerPlan] = (),
    measure: int = 32,
    recurrences: Sequence[int] = RANDOM_RECURRENCES,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """The report: per-layer statistics, angular distances l x n, and the ranked candidate surgeries."""
    weights = InMemoryWeights.load(source, device, dtype)
    full = build_model(source, static_plan(source.n_layers), weights)
    stats = layer_statistics(full, batches, progress)
    source_loss = model_loss(full, batches)[1]
    del full
    drop_losses = drop_one_losses(source, weights, batches, progress)
    influence = stats.block_influence()
    layers = [
        {
            "layer": i,
            "block_influence": influence[i],
            "angular_distance_next": stats.angular_distance(i, 1),
            "drop_loss": drop_losses[i],
            "drop_loss_increase": drop_losses[i] - source_loss,
            "norm_in": float(stats.norms[i]),
            "norm_out": float(stats.norms[i + 1]),
        }
        for i in range(source.n_layers)
    ]
    report: dict[str, Any] = {
        "source": source_name,
        "architecture": source.architecture,
        "n_layers": source.n_layers,
        "tokens": stats.tokens,
        "source_loss": source_loss,
        "layers": layers,
        # angular_distance[l][n - 1]: between the inputs of layers l and l + n (n = 1 .. L - l).
        "angular_distance": [
            [stats.angular_distance(i, n) for n in range(1, source.n_layers - i + 1)] for i in range(source.n_layers)
        ],
        "most_redundant_spans": stats.most_redundant_spans(),
    }
    if plans:
        report["candidates"] = {
            "total": len(plans),
            "measured": min(measure, len(plans)),
            "random_adapter_seed": seed,
            "recurrences": list(recurrences),
            "ranked": rank_candidates(
                source,
                source_name,
                weights,
                plans,
                stats,
                batches,
                measure=measure,
                recurrences=recurrences,
                seed=seed,
                progress=progress,
            ),
        }
    return report


# ---------------------------------------------------------------- output


def format_report(report: dict[str, Any], top: int = 5) -> str:
    """The tables the CLI prints."""
    lines = [
        f"source loss {report['source_loss']:.4f} over {report['tokens']:,} tokens",
        "",
        "layer  influence  angle(n=1)  drop-alone loss (increase)   |h_in|   |h_out|",
    ]
    for row in report["layers"]:
        lines.append(
            f"{row['layer']:>5}  {row['block_influence']:>9.5f}  {row['angular_distance_next']:>10.5f}  "
            f"{row['drop_loss']:>15.4f} ({row['drop_loss_increase']:+.4f})  "
            f"{row['norm_in']:>7.2f}  {row['norm_out']:>8.2f}"
        )
    lines += [
        "",
        "most redundant n consecutive layers (smallest angular distance between layer l's input and l+n's)",
        "    n  layers  angular distance",
    ]
    for span in report["most_redundant_spans"]:
        first, last = span["layers"]
        lines.append(f"{span['n']:>5}  {format_layers(range(first, last + 1)):<6}  {span['angular_distance']:>16.5f}")
    if "candidates" in report:
        lines += ["", *_format_candidates(report["candidates"], top)]
    return "\n".join(lines)


def _format_candidates(candidates: dict[str, Any], top: int) -> list[str]:
    rs = candidates["recurrences"]
    lines = [
        f"{candidates['total']} candidate surgeries; the {candidates['measured']} with the smallest angular score "
        "converted and measured (identity adapter at r=1 = the healing start; random adapter "
        f"seed {candidates['random_adapter_seed']} at r={','.join(map(str, rs))})",
        "rank  prelude  core      coda      dropped     angular (rank)  loss id r=1  "
        + "  ".join(f"random r={r}" for r in rs),
    ]
    shown = candidates["ranked"][:top]
    for rank, row in enumerate(shown, start=1):
        measured = "loss_identity_r1" in row
        losses = (
            (f"{row['loss_identity_r1']:>11.4f}  " + "  ".join(f"{row['loss_random'][str(r)]:>10.4f}" for r in rs))
            if measured
            else "not measured"
        )
        mark = " *" if row["paper_placement"] else ""
        lines.append(
            f"{rank:>4}  {format_layers(row['prelude']):<7}  {format_layers(row['core']):<8}  "
            f"{format_layers(row['coda']):<8}  {format_layers(row['dropped']):<10}  "
            f"{row['angular_score']:>7.4f} ({row['angular_rank']:>3})  {losses}{mark}"
        )
    if any(row["paper_placement"] for row in shown):
        lines.append("* the paper's placement: core = the R layers just before the coda")
    lines += ["", "to make them:"] + [f"  {rank}: {row['command']}" for rank, row in enumerate(shown, start=1)]
    return lines


def require_matplotlib() -> Any:
    """matplotlib, or a one-line install hint (the tool checks this before its work)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plots need matplotlib: pip install -e '.[eval]'") from None
    return matplotlib


def plot_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """influence.png (block influence and drop-alone loss increase per layer) and angular_distance.png (l x n)."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [row["layer"] for row in report["layers"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), dpi=120, sharex=True)
    top.bar(layers, [row["block_influence"] for row in report["layers"]])
    top.set_ylabel("block influence\n1 - cos(in, out)")
    bottom.bar(layers, [row["drop_loss_increase"] for row in report["layers"]], color="tab:orange")
    bottom.set_ylabel("loss increase\nwhen dropped alone")
    bottom.set_xlabel("source layer")
    bottom.set_xticks(layers)
    top.set_title(f"{report['source']}: {report['tokens']:,} tokens", fontsize=9)
    fig.tight_layout()
    influence_path = out / INFLUENCE_PLOT
    fig.savefig(influence_path)
    plt.close(fig)

    n_layers = report["n_layers"]
    grid = torch.full((n_layers, n_layers), float("nan"))
    for i, row in enumerate(report["angular_distance"]):
        grid[i, : len(row)] = torch.tensor(row)
    fig, ax = plt.subplots(figsize=(5.5, 4.5), dpi=120)
    image = ax.imshow(
        grid.numpy(), origin="lower", aspect="auto", cmap="viridis", extent=(0.5, n_layers + 0.5, -0.5, n_layers - 0.5)
    )
    fig.colorbar(image, ax=ax, label=r"angular distance $d(h_l, h_{l+n})$")
    ax.set_xlabel("span n (layers dropped)")
    ax.set_ylabel("first layer l")
    ax.set_title(f"{report['source']}: smaller = more redundant", fontsize=9)
    fig.tight_layout()
    angular_path = out / ANGULAR_PLOT
    fig.savefig(angular_path)
    plt.close(fig)
    return influence_path, angular_path
