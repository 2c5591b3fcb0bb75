"""``python -m benchmarks.checkpoint_save``: :mod:`memo_ext.benchmarks.checkpoint_save`."""

import sys

from memo_ext.benchmarks.checkpoint_save import main

if __name__ == "__main__":
    sys.exit(main())
