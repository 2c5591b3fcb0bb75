"""Loads the emulated CUDA device when pytest starts, before any conftest imports torch.

``python -m tests.emulated`` names this module in ``PYTEST_PLUGINS``, which pytest reads before
it imports conftest files, in its own process and in every pytest-xdist worker (they inherit
the environment): each process of the tier then has the device before torch.
"""

import os

from memo_ext.simulate import runtime

runtime.load()

if os.environ.get("COVERAGE_PROCESS_START"):  # the tier measured (make test): each worker too
    import coverage

    coverage.process_startup()
