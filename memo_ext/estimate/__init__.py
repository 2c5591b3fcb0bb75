"""Memory, time and MFU at any scale, MEMO's α rule on estimated figures, and a preflight.

Entry points: ``tools/estimate.py`` (one configuration, or the longest sequence that fits),
``tools/memory_report.py`` (activation bytes per method) and the trainer's preflight.

Modules:
    measure: per-layer bytes and FLOPs of megatron-core layers on fake tensors.
    model: ``estimate(...)`` of one configuration.
    search: ``find_max_seq_length(...)`` and ``best_at_length(...)`` over parallel layouts.
    preflight: ``preflight(run)`` / ``check_preflight(run)`` for the trainer.
    calibration: kernels timed on this machine, efficiencies fitted to measured steps, and
        ``apply_calibration`` for the estimator (file format: ``memo_ext.hardware.Calibration``).
"""
