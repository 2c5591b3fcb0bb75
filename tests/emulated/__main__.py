"""Run the emulated-device tier: ``python -m tests.emulated [pytest arguments]``.

The C++ half of the device must be in the process before torch is imported, so this tier runs
in a process of its own, started here: the shim is loaded, then pytest runs ``tests/emulated``
(or the paths given).
"""

import sys
from pathlib import Path

from tests.emulated import runtime


def main(argv: list[str]) -> int:
    runtime.load()
    import pytest

    given = [a for a in argv if Path(a.split("::")[0]).exists()]
    here = [] if given else [str(runtime.ROOT / "tests" / "emulated")]
    return int(pytest.main([*argv, *here]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
