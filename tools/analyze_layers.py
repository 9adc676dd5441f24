"""`python tools/analyze_layers.py ...`: the command `titan-recur-analyze-layers` (titan_recur/cli/analyze_layers.py), run from a checkout."""

import sys

from titan_recur.cli.analyze_layers import main

if __name__ == "__main__":
    sys.exit(main())
