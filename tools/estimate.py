"""``python -m tools.estimate``: :mod:`memo_ext.commands.estimate`,
installed as ``memo-estimate``."""

import sys

from memo_ext.commands.estimate import main

if __name__ == "__main__":
    sys.exit(main())
