"""Megatron baseline comparisons: methods × sequence lengths as real training jobs, each beside the
estimator's prediction and the figures traced on fake tensors (``memo-compare``), and the
activation report per method (``memo-memory-report``).

- :mod:`~memo_ext.compare.jobs`: a method as the comparison spells it, and one job run with a
  time limit (out of memory and a timeout are results);
- :mod:`~memo_ext.compare.comparison`: a comparison resolved from its flags, a configuration's
  command line, key and prediction;
- :mod:`~memo_ext.compare.runs`, :mod:`~memo_ext.compare.search`: running the configurations
  (resumable), and the search for the longest length each method trains at;
- :mod:`~memo_ext.compare.calibration`: the estimator's efficiencies fitted to measured steps;
- :mod:`~memo_ext.compare.report`: tables, summary and plot;
- :mod:`~memo_ext.compare.memory`: one traced layer per method, scaled to a process's iteration.
"""
