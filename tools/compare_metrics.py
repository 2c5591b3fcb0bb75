"""``python -m tools.compare_metrics``: :mod:`memo_ext.commands.compare_metrics`,
installed as ``memo-compare-metrics``."""

import sys

from memo_ext.commands.compare_metrics import main

if __name__ == "__main__":
    sys.exit(main())
