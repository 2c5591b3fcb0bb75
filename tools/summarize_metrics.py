"""``python -m tools.summarize_metrics``: :mod:`memo_ext.commands.summarize_metrics`,
installed as ``memo-summarize-metrics``."""

import sys

from memo_ext.commands.summarize_metrics import main

if __name__ == "__main__":
    sys.exit(main())
