"""``python -m tools.plan_memory``: :mod:`memo_ext.commands.plan_memory`,
installed as ``memo-plan-memory``."""

import sys

from memo_ext.commands.plan_memory import main

if __name__ == "__main__":
    sys.exit(main())
