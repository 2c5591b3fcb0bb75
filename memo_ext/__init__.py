"""Long-context GPT pretraining on megatron-core with MEMO and HotSPa.

Entry points: ``pretrain_gpt_memo.py`` (training, Megatron-LM's flags; the installed trainer is
``memo_ext.commands.pretrain_gpt_memo``), ``memo_ext.launch`` (torchrun, ending a failed run
with its one sentence) and the installed commands of ``memo_ext.commands`` (``memo-estimate``,
``memo-compare``, …; ``python -m tools.NAME`` in the repository).

Layers, lowest first; a module imports only from lower layers (``tests/unit/test_layering.py``):

    errors, device                      the error types entry points report in one sentence
    shapes, parallel, hardware, flags,  one model shape, one parallel layout, one device table,
    collectives, extension              flags generated from dataclasses, the world's loss,
                                        the interface a feature implements
    config                              every setting of a run, as frozen dataclasses
    mcore, data                         megatron-core internals (specs, attention, compat,
                                        tracing, groups); tokenizers, datasets, packed documents
    planner, allocator                  the memory planner; the run-time side of a plan
    memo                                MEMO's library: activation manager, layer modes, rules
    estimate                            memory / time / MFU at any scale, the stage protocol
    hotspa, megatron_lm, simulate       HotSPa's library; Megatron-LM's flags; the emulated
                                        CUDA device and its clock (memo-simulate)
    features                            one package per feature (hooks, estimator stage,
                                        compared methods), the registry, the preflight
    compare, arguments, training,       the comparison harness; flags → a checked run; the
    launch                              training loop; the launcher
    hf                                  Hugging Face import / export
    commands                            the installed commands and the trainer's main

Importing the package filters what megatron-core and torch announce that no user can act on
(below); the modules that import megatron-core are imported only when work starts, so
``--help`` and a wrong flag answer without them.
"""

import logging as _logging
import warnings as _warnings

__version__ = "0.1.0"

# What megatron-core and torch say that no user of this package can act on, filtered once for
# the trainer and every tool: that the optional fused kernels (Apex, Transformer Engine) are
# absent (the local paths it falls back to are the ones used on CPU), a default it takes,
# deprecations it trips in its own code (its checkpoint loader's among them), and the torch
# collectives it still calls by old names.
for _message in (
    r".*(Apex|Transformer Engine).* not installed",
    r".*tp_group is None, using default tp group",
    r"full scope is deprecated",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    # megatron-core 0.16's checkpoint loader, on every load: torch's old reader and tensor type
    r"`load_state_dict` is deprecated and will be removed in future versions",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
):
    _warnings.filterwarnings("ignore", message=_message)
# megatron-core's FSDP package logs at INFO, on import, which of its optional parts it found
_logging.getLogger("megatron.core.distributed.fsdp").setLevel(_logging.WARNING)
