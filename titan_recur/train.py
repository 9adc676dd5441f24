"""``python -m titan_recur.train``: the trainer's command (titan_recur/cli/train.py)."""

from titan_recur.cli.train import main

if __name__ == "__main__":
    raise SystemExit(main())
