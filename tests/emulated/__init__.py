"""The emulated-device tier: the program's CUDA branch on a CPU machine.

Run with ``python -m tests.emulated`` (``make test`` does); :mod:`memo_ext.simulate.device` says
what is emulated and what is not.
"""
