"""HotSPa: length buckets, each trained in its own parallel layout, switched within a step.

Entry points: ``--hotspa`` on ``pretrain_gpt_memo.py`` (the trainer builds a
:class:`~memo_ext.hotspa.engine.HotSPaEngine`), ``memo_ext.benchmarks.hotspa_strategies`` (the
cost model's choices on paper-like workloads) and ``scripts/gpt7b_hotspa.sh``.

Modules:
    buckets: each step's documents grouped by length and packed per bucket.
    auto: ``--hotspa-strategies auto``, each bucket's layout from the estimator's cost model.
    switch: plans that move weight and gradient slices between two layouts.
    engine: one training step over buckets in their layouts.
"""
