"""`python tools/compare.py ...`: the command `titan-recur-compare` (titan_recur/cli/compare.py), run from a checkout."""

import sys

from titan_recur.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
