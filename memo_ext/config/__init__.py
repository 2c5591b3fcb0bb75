"""Every setting of a training run, as frozen dataclasses, one module per section, each with its
own checks.

One field per flag: ``memo_ext.arguments`` generates the trainer's command line from these
classes (``memo_ext.flags``: the flag is the field's name, its help the docstring under it, its
default the field's default) and docs/flags.md's flag reference is generated from that parser. The
model's size is :class:`~memo_ext.shapes.ModelShape` and the process layout
:class:`~memo_ext.parallel.ParallelLayout`; the sections here hold the rest:

- ``network``: the model beyond its shape, the distributed settings;
- ``train``: batches, schedule, optimizer, precision; ``data``: tokens and tokenizer;
- ``output``: logging, evaluation, checkpoints, cleanup, profiling, the preflight;
- ``run``: :class:`RunConfig`, all sections together, the features' among them.

Each memory or parallelism feature owns its section, in its own package
(``memo_ext.features.<name>.config``: ``recompute``, ``memo``, ``hotspa``, ``megatron_offload``),
with the rules it imposes on the rest of the run (``check_with``); this package gathers them
into :class:`RunConfig` and re-exports them.

A :class:`RunConfig` is built once from the flags (``memo_ext.arguments.parse_args``), checked
(:meth:`RunConfig.check`, one sentence per problem; no file is read here, the files the flags
name are checked by ``memo_ext.data.input_files``) and resolved once against the tokenizer and the
data (``memo_ext.training.resolve``): nothing downstream changes it. Its megatron-core
``TransformerConfig`` is built by ``memo_ext.features.megatron.run_transformer_config``.
This package imports nothing of the trainer above ``errors``, ``flags``, ``hardware``,
``parallel`` and ``shapes``, and the features' sections.
"""

from memo_ext.config.common import AUTO, check_regular_file, check_writable_directory, installed
from memo_ext.config.data import (
    BYTE_VOCAB_SIZE,
    DEFAULT_SPLIT,
    TOKENIZER_TYPES,
    DataConfig,
    TokenizerSpec,
    check_split,
)
from memo_ext.config.network import (
    ATTENTION_BACKENDS,
    DistributedConfig,
    ModelConfig,
    resolve_attention_backend,
)
from memo_ext.config.output import (
    CheckpointConfig,
    CleanupConfig,
    EvaluationConfig,
    LoggingConfig,
    PreflightConfig,
    ProfileConfig,
)
from memo_ext.config.run import RunConfig
from memo_ext.config.train import (
    TrainConfig,
    batch_at,
    parse_step_schedule,
    sample_based_steps,
)
from memo_ext.features.hotspa.config import (
    RECOMPUTE_CHOICES,
    HotSPaConfig,
    check_buckets,
    parse_buckets,
    parse_token_counts,
    split_recompute,
)
from memo_ext.features.megatron_offload.config import (
    MIN_OFFLOADED_TENSOR_SIZE,
    OFFLOAD_MODULES,
    MegatronOffloadConfig,
    megatron_offload_missing,
)
from memo_ext.features.memo.config import (
    DEFAULT_HOST_SHARE,
    MemoConfig,
    parse_alpha,
    parse_chunk_tokens,
)
from memo_ext.features.recompute.config import RecomputeConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO",
    "BYTE_VOCAB_SIZE",
    "DEFAULT_HOST_SHARE",
    "DEFAULT_SPLIT",
    "MIN_OFFLOADED_TENSOR_SIZE",
    "OFFLOAD_MODULES",
    "RECOMPUTE_CHOICES",
    "TOKENIZER_TYPES",
    "TokenizerSpec",
    "CheckpointConfig",
    "CleanupConfig",
    "DataConfig",
    "DistributedConfig",
    "EvaluationConfig",
    "HotSPaConfig",
    "LoggingConfig",
    "MegatronOffloadConfig",
    "MemoConfig",
    "ModelConfig",
    "PreflightConfig",
    "ProfileConfig",
    "RecomputeConfig",
    "RunConfig",
    "TrainConfig",
    "batch_at",
    "check_buckets",
    "check_split",
    "check_regular_file",
    "check_writable_directory",
    "installed",
    "megatron_offload_missing",
    "parse_alpha",
    "parse_buckets",
    "parse_chunk_tokens",
    "parse_step_schedule",
    "parse_token_counts",
    "resolve_attention_backend",
    "sample_based_steps",
    "split_recompute",
]
