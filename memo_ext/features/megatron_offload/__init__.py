"""megatron-core's own activation offloading (``--cpu-offloading-num-layers``,
``--fine-grained-activation-offloading``): a baseline. megatron-core does the work; the feature is
its section of the run's configuration (``config``), its trainer hook (``extension``: the
preflight skipped, since the estimator does not model it) and the method comparisons run as
``megatron-offload`` (``method``).
"""
