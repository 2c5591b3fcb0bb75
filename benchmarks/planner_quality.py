"""``python -m benchmarks.planner_quality``: :mod:`memo_ext.benchmarks.planner_quality`."""

from memo_ext.benchmarks.planner_quality import main

if __name__ == "__main__":
    main()
