"""``python -m titan_recur.eval``: the evaluation command (titan_recur/cli/eval.py)."""

from titan_recur.cli.eval import main

if __name__ == "__main__":
    raise SystemExit(main())
