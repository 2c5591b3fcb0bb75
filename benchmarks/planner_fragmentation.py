"""``python -m benchmarks.planner_fragmentation``:
:mod:`memo_ext.benchmarks.planner_fragmentation`."""

from memo_ext.benchmarks.planner_fragmentation import main

if __name__ == "__main__":
    main()
