"""Puts the emulated CUDA device into this Python process (``python -m memo_ext.simulate.run``
places this folder first on ``PYTHONPATH``); see :mod:`memo_ext.simulate.process`."""

import os

if os.environ.get("COVERAGE_PROCESS_START"):
    import coverage

    coverage.process_startup()

if os.environ.get("MEMO_EMULATED_GPU"):
    from memo_ext.simulate import process

    process.install()
