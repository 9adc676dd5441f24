"""`python tools/compare.py ...`: the command `titan-recur-compare` (titan_recur/cli/compare.py), run from a checkout."""

import sys

from titan_recur.cli.compare import *  # noqa: F403  (its functions, for scripts that import this file)
from titan_recur.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
