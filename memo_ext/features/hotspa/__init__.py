"""HotSPa as a feature of the trainer: its hooks (``extension``), its section of the run's
configuration (``config``) and its automatic choice of layouts per bucket (``auto``).

The engine itself, hot switching between parallel strategies, is the library ``memo_ext.hotspa``.
"""
