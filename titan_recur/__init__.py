"""titan_recur: retrofit depth recurrence into pretrained LMs and train it at cluster scale."""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

from titan_recur.data.tokenizer import load_tokenizer
from titan_recur.inference.engine import greedy_generate
from titan_recur.models import ModelArgs, RecurrentLM
from titan_recur.storage.model_io import load_model, save_model

__all__ = ["__version__", "ModelArgs", "RecurrentLM", "greedy_generate", "load_model", "load_tokenizer", "save_model"]
