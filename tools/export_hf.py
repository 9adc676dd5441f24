"""`python tools/export_hf.py ...`: the command `titan-recur-export` (titan_recur/cli/export.py), run from a checkout."""

import sys

from titan_recur.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
