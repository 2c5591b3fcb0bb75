"""``python -m benchmarks.paper_table``: :mod:`memo_ext.benchmarks.paper_table`."""

import sys

from memo_ext.benchmarks.paper_table import main

if __name__ == "__main__":
    sys.exit(main())
