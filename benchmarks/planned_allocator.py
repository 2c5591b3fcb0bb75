"""``python -m benchmarks.planned_allocator``: :mod:`memo_ext.benchmarks.planned_allocator`."""

import sys

from memo_ext.benchmarks.planned_allocator import main

if __name__ == "__main__":
    sys.exit(main())
