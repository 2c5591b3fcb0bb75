"""``python -m tools.plot_position_loss``: :mod:`memo_ext.commands.plot_position_loss`,
installed as ``memo-plot-position-loss``."""

import sys

from memo_ext.commands.plot_position_loss import main

if __name__ == "__main__":
    sys.exit(main())
