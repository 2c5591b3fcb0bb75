"""``python -m tools.memory_report``: :mod:`memo_ext.commands.memory_report`,
installed as ``memo-memory-report``."""

import sys

from memo_ext.commands.memory_report import main

if __name__ == "__main__":
    sys.exit(main())
