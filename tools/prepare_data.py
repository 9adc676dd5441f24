"""`python tools/prepare_data.py ...`: the command `titan-recur-prepare-data` (titan_recur/cli/prepare_data.py), run from a checkout."""

import sys

from titan_recur.cli.prepare_data import *  # noqa: F403  (its functions, for scripts that import this file)
from titan_recur.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
