"""``python -m benchmarks.memo_chunking``: :mod:`memo_ext.benchmarks.memo_chunking`."""

from memo_ext.benchmarks.memo_chunking import main

if __name__ == "__main__":
    main()
