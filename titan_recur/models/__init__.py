"""The model: single-device, free of parallelism, and importing nothing else of titan_recur."""

from titan_recur.models.args import PRESETS, ModelArgs
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.models.model import RecurrentLM

__all__ = ["PRESETS", "ModelArgs", "RecurrentLM", "cross_entropy_loss"]
