"""``python -m tools.preprocess_data``: :mod:`memo_ext.commands.preprocess_data`,
installed as ``memo-preprocess-data``."""

import sys

from memo_ext.commands.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
