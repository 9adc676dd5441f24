"""Evaluation: held-out loss vs test recurrence (in-loop and offline) and the lm-eval-harness model.

``python -m titan_recur.eval {loss,harness}``; see docs/evaluation.md. Importing this package needs
torch only: lm_eval (the optional ``eval`` extra) is imported by ``lm_eval_model`` and ``harness``.
"""
