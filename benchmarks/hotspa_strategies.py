"""``python -m benchmarks.hotspa_strategies``: :mod:`memo_ext.benchmarks.hotspa_strategies`."""

import sys

from memo_ext.benchmarks.hotspa_strategies import main

if __name__ == "__main__":
    sys.exit(main())
