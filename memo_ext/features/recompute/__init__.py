"""Megatron's activation recomputation (``--recompute-granularity``), and none: the baselines.

megatron-core does the work (its section sets the ``TransformerConfig`` fields:
``megatron_fields``), so this feature is what the rest of the house asks of it: its section of
the run's configuration (``config``), and (``method``) how the estimator prices a stage under
each granularity, which runs select it, and how a comparison spells it (``memo_ext.compare``).
"""
