"""Evaluation: held-out loss vs test recurrence (in-loop and offline) and the lm-eval-harness model.

``python -m titan_recur.eval {loss,harness}``; see docs/evaluation.md. Importing this package needs
torch only: lm_eval (the optional ``eval`` extra) is imported by ``lm_eval_model`` and ``harness``.
"""

from titan_recur.training.validation import mean_losses, validation_loss_sums

__all__ = ["mean_losses", "validation_loss_sums"]
