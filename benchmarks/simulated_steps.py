"""``python -m benchmarks.simulated_steps``: :mod:`memo_ext.benchmarks.simulated_steps`."""

import sys

from memo_ext.benchmarks.simulated_steps import main

if __name__ == "__main__":
    sys.exit(main())
