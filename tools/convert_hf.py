"""``python -m tools.convert_hf``: :mod:`memo_ext.commands.convert_hf`,
installed as ``memo-convert-hf``."""

import sys

from memo_ext.commands.convert_hf import main

if __name__ == "__main__":
    sys.exit(main())
