"""``python -m benchmarks.planner_suite``: :mod:`memo_ext.benchmarks.planner_suite`."""

from memo_ext.benchmarks.planner_suite import main

if __name__ == "__main__":
    main()
