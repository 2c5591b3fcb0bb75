"""Run the emulated-device tier: ``python -m tests.emulated [pytest arguments]``.

The C++ half of the device must be in the process before torch is imported, so this tier runs
in processes of its own, started here: the shim is built and loaded, then pytest runs
``tests/emulated`` (or the paths given). ``-n N`` (pytest-xdist) works: each worker loads the
shim first too (:mod:`tests.emulated.plugin`).
"""

import os
import sys
from pathlib import Path

from memo_ext.simulate import runtime

PLUGIN = "tests.emulated.plugin"


def main(argv: list[str]) -> int:
    runtime.load()  # built once here, before any worker starts
    plugins = [p for p in os.environ.get("PYTEST_PLUGINS", "").split(",") if p]
    os.environ["PYTEST_PLUGINS"] = ",".join([*plugins, PLUGIN])
    import pytest

    given = [a for a in argv if Path(a.split("::")[0]).exists()]
    here = [] if given else [str(Path(__file__).resolve().parent)]
    return int(pytest.main([*argv, *here]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
