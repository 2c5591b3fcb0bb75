"""Benchmarks that print tables and write JSON: the planner (``planner_quality``,
``planner_suite``, ``planner_fragmentation``, ``planned_allocator``), MEMO's chunks
(``memo_chunking``), the papers' figures by the estimator (``paper_table``,
``hotspa_strategies``) and checkpoint saves against Megatron-LM's (``checkpoint_save``).

Each runs as ``python -m memo_ext.benchmarks.NAME`` from any folder (``python -m
benchmarks.NAME`` in the repository). They sit above everything else in the package, and
nothing in it imports them.
"""
