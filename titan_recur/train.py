"""``python -m titan_recur.train``: the trainer's command (titan_recur/training/trainer.py)."""

from titan_recur.training.trainer import main

if __name__ == "__main__":
    raise SystemExit(main())
