"""Puts the emulated CUDA device into this Python process (``python -m tests.emulated.run``
places this folder first on ``PYTHONPATH``); see :mod:`tests.emulated.process`."""

import os

if os.environ.get("COVERAGE_PROCESS_START"):
    import coverage

    coverage.process_startup()

if os.environ.get("MEMO_EMULATED_GPU"):
    from tests.emulated import process

    process.install()
