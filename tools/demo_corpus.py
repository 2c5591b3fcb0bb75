"""``python -m tools.demo_corpus``: :mod:`memo_ext.commands.demo_corpus`,
installed as ``memo-demo-corpus``."""

import sys

from memo_ext.commands.demo_corpus import main

if __name__ == "__main__":
    sys.exit(main())
