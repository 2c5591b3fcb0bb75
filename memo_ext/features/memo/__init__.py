"""MEMO as a feature of the trainer: its section of the run's configuration (``config``), its
hooks (``extension``), how the estimator prices it (``stage``) and the method the estimator, the
search and the comparisons name ``memo`` (``method``).

The runtime itself, token-wise swapping and recomputation, is the library ``memo_ext.memo``.
"""
