"""``python -m tools.simulate``: :mod:`memo_ext.commands.simulate`,
installed as ``memo-simulate``."""

import sys

from memo_ext.commands.simulate import main

if __name__ == "__main__":
    sys.exit(main())
