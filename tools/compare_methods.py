"""``python -m tools.compare_methods``: :mod:`memo_ext.commands.compare_methods`,
installed as ``memo-compare``."""

import sys

from memo_ext.commands.compare_methods import main

if __name__ == "__main__":
    sys.exit(main())
