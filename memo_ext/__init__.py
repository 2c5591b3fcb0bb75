"""Long-context GPT pretraining on megatron-core with MEMO and HotSPa.

Entry points: ``pretrain_gpt_memo.py`` (training, Megatron-LM's flags) and the command-line tools
in ``tools/`` (``preprocess_data``, ``plan_memory``, ``estimate``, ``memory_report``,
``compare_metrics``, ``summarize_metrics``, ``flag_reference``, ``demo_corpus``).

Layers, lowest first; a module imports only from lower layers (``tests/unit/test_layering.py``):

    errors                              the error types entry points report in one sentence
    shapes, parallel, hardware, flags   one model shape, one parallel layout, one device table,
                                        flags generated from dataclasses
    mcore, data                         megatron-core internals (specs, attention, compat,
                                        tracing, groups); tokenizers, datasets, packed documents
    config                              every setting of a run, as frozen dataclasses
    planner, offload, allocator         the memory planner; MEMO's activation manager; the
                                        run-time side of a plan
    estimate                            memory / time / MFU at any scale, the preflight
    hotspa                              length buckets in their own parallel layouts
    arguments, training                 flags → a checked run; the training loop
"""

__version__ = "0.1.0"
