"""`python tools/flops.py ...`: the command `titan-recur-flops` (titan_recur/cli/flops.py), run from a checkout."""

import sys

from titan_recur.cli.flops import main

if __name__ == "__main__":
    sys.exit(main())
