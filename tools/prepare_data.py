"""`python tools/prepare_data.py ...`: the command `titan-recur-prepare-data` (titan_recur/cli/prepare_data.py), run from a checkout."""

import sys

from titan_recur.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
