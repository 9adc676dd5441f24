"""``python -m titan_recur.generate``: the generation command (titan_recur/cli/generate.py)."""

from titan_recur.cli.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
