"""Model code: single-device, free of parallelism."""

from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.models.generate import greedy_generate
from titan_recur.models.model import RecurrentLM, cross_entropy_loss

__all__ = ["PRESETS", "ModelArgs", "RecurrentLM", "cross_entropy_loss", "greedy_generate"]
