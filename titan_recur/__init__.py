"""titan_recur: retrofit depth recurrence into pretrained LMs and train it at cluster scale."""

from titan_recur.models import ModelArgs, RecurrentLM, greedy_generate
from titan_recur.models.io import load_model, save_model
from titan_recur.tokenizer import load_tokenizer

__all__ = ["ModelArgs", "RecurrentLM", "greedy_generate", "load_model", "load_tokenizer", "save_model"]
