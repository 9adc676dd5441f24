"""Model code: single-device, free of parallelism."""

from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.models.generate import greedy_generate
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.models.model import RecurrentLM

__all__ = ["PRESETS", "ModelArgs", "RecurrentLM", "cross_entropy_loss", "greedy_generate"]
