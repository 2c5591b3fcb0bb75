"""``python -m tools.eval_retrieval``: :mod:`memo_ext.commands.eval_retrieval`, installed as
``memo-eval-retrieval``."""

import sys

from memo_ext.commands.eval_retrieval import main

if __name__ == "__main__":
    sys.exit(main())
