"""`python tools/convert_hf.py ...`: the command `titan-recur-convert` (titan_recur/cli/convert.py), run from a checkout."""

import sys

from titan_recur.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
