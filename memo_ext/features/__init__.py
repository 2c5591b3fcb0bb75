"""The trainer's features: one package each (``recompute``, ``megatron_offload``, ``memo``,
``hotspa``), and the registry the trainer, the estimator's callers, the search and the
comparisons read (``registry``).

A feature's package holds its faces:

- its section of the run's configuration (``config``: a frozen dataclass whose documented
  fields are its flags, with its checks; :class:`~memo_ext.config.RunConfig` holds one of each).
  A section imports nothing of the house above ``memo_ext.config.common``, so the libraries
  below the features (``memo_ext.memo`` reads MEMO's) may take it;
- its trainer hooks, an ``memo_ext.extension.Extension`` (``FEATURES`` in
  :mod:`memo_ext.features.extensions`, imported by the trainer only: extensions build layers and
  import megatron-core);
- for a feature that holds activations its own way, its
  :class:`~memo_ext.estimate.stage.MemoryMethod` (``registry.METHODS``: how the estimator prices
  a stage under it, which runs select it, what a search tries);
- the methods a comparison runs (``registry.COMPARED``,
  :class:`~memo_ext.features.compared.ComparedMethod`).

These lists are all the rest of the house knows of the features: nothing below this package
names one. A new feature is a package plus one line in each list it joins, or a ``register``
call from anywhere (a test's own: ``register(METHODS, method)``; an extension:
``memo_ext.features.extensions.register``). This file and each feature's ``__init__`` import
nothing, so that a section can be imported without the rest.
"""
