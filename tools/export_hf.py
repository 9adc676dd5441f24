"""`python tools/export_hf.py ...`: the command `titan-recur-export` (titan_recur/cli/export.py), run from a checkout."""

import sys

from titan_recur.cli.export import *  # noqa: F403  (its functions, for scripts that import this file)
from titan_recur.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
