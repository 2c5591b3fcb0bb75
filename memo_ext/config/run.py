"""The whole run: every section together, and the rules that tie sections together."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from memo_ext.config.common import check_writable_directory
from memo_ext.config.data import TOKENIZER_FIELDS, DataConfig
from memo_ext.config.network import DistributedConfig, ModelConfig
from memo_ext.config.output import (
    CheckpointConfig,
    CleanupConfig,
    EvaluationConfig,
    LoggingConfig,
    PreflightConfig,
    ProfileConfig,
)
from memo_ext.config.train import TrainConfig
from memo_ext.errors import UsageError
from memo_ext.features.hotspa.config import HotSPaConfig
from memo_ext.features.megatron_offload.config import MegatronOffloadConfig
from memo_ext.features.memo.config import MemoConfig
from memo_ext.features.recompute.config import RecomputeConfig
from memo_ext.flags import argv_of
from memo_ext.hardware import available_host_memory_bytes
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

MODEL_DEFINING_FIELDS = (
    "max_position_embeddings", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "rotary_scaling_factor",
    "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim", "norm_epsilon",
    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "apply_layernorm_1p",
)  # fmt: skip
"""The fields of ``ModelConfig`` that change what the weights compute (not how they train)."""


INDEX_BYTES_PER_SAMPLE = 12
"""The least host memory megatron-core's ``GPTDataset`` builds per sample before training: a row
of its sample index (two int32) and its shuffle index entry (int32); the document index adds
more."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one training run needs (see the package docstring)."""

    shape: ModelShape
    """The model's sizes."""
    model: ModelConfig
    layout: ParallelLayout
    """This run's process layout (with HotSPa: the home layout once resolved)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    offload: MegatronOffloadConfig = field(default_factory=MegatronOffloadConfig)
    """megatron-core's own activation offloading (off by default)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    train: TrainConfig
    data: DataConfig
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    cleanup: CleanupConfig = field(default_factory=CleanupConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    memo: MemoConfig = field(default_factory=MemoConfig)
    """MEMO's token-wise activation offloading (off by default)."""
    hotspa: HotSPaConfig = field(default_factory=HotSPaConfig)
    """HotSPa's length buckets and per-bucket layouts (off by default)."""
    plugin_sections: tuple[tuple[str, Any], ...] = ()
    """The sections of the features plugins add (``memo_ext.features.registry.Feature``), by
    name; :meth:`section` reads one."""
    world_size: int = 1
    """Processes in the job (torchrun's ``WORLD_SIZE``)."""

    def section(self, name: str) -> Any:
        """The section ``name``: a built-in one (``memo``) or a plugin feature's.

        Raises:
            KeyError: for a name that is neither.
        """
        if name in {f.name for f in dataclasses.fields(self)} - {"plugin_sections", "world_size"}:
            return getattr(self, name)
        for key, section in self.plugin_sections:
            if key == name:
                return section
        raise KeyError(f"the run has no section {name!r}")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each DP rank."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.layout.dp)

    def model_flags(self) -> list[str]:
        """The trainer flags that define this run's model, tokenizer included: what a later run
        (``--finetune``, ``tools.convert_hf export``) needs to build the same model again.
        A learned position table's length is written out (its default follows --seq-length,
        and the table is part of the weights)."""
        model = self.model
        if not self.shape.rotary and model.max_position_embeddings is None:
            model = dataclasses.replace(model, max_position_embeddings=self.data.seq_length)
        return [
            *argv_of(self.shape),
            *argv_of(model, only=MODEL_DEFINING_FIELDS),
            *argv_of(self.data, only=TOKENIZER_FIELDS),
        ]

    @property
    def profile_dir(self) -> str:
        """Where --profile writes torch.profiler traces: --tensorboard-dir (TensorBoard's profiler
        plugin reads them there, as Megatron-LM writes them), else ./profile."""
        return self.logging.tensorboard_dir or "profile"

    def check(self) -> None:
        """Every section's own checks, then each feature's rules against the rest of the run
        (``check_with``), then the rules of the run as a whole. Reads no file: the files the
        flags name are checked by ``memo_ext.data.input_files``.

        Raises:
            UsageError: the first problem, in one sentence that says what to change.
        """
        self.shape.check()
        self.data.check()  # before the model's: --max-position-embeddings defaults to its length
        self.model.check()
        self.model.check_positions(position_embedding_type=self.shape.position_embedding_type)
        self.train.check()
        self.layout.check_fits(self.shape, self.data.seq_length)
        self._check_sequence()
        self._check_batch()
        self._check_counts()
        self.recompute.check(stage_layers=self.shape.num_layers // self.layout.pp)
        self.offload.check(num_layers=self.shape.num_layers)
        self.logging.check()
        self.distributed.check(distributed_optimizer=self.train.use_distributed_optimizer)
        self.cleanup.check()
        self.profile.check(train_iters=self.train.train_iters, world_size=self.world_size)
        if self.profile.enabled:
            check_writable_directory(self.profile_dir, flag="--profile: trace folder")
        self.memo.check()
        self.memo.check_with(
            model=self.model,
            recompute=self.recompute,
            offload=self.offload,
            data=self.data,
            shape=self.shape,
            layout=self.layout,
        )
        self.evaluation.check()
        self._check_retrieval()
        self.evaluation.check_split(split=self.data.split_or_default, mock_data=self.data.mock_data)
        self.checkpoint.check()
        self.preflight.check()
        self.data.check_with(
            train=self.train, evaluation=self.evaluation, memo_enabled=self.memo.enabled
        )
        self.hotspa.check()
        self.hotspa.check_with(
            data=self.data,
            model=self.model,
            recompute=self.recompute,
            shape=self.shape,
            layout=self.layout,
            world_size=self.world_size,
        )
        self.offload.check_with(
            recompute=self.recompute,
            hotspa=self.hotspa,
            layout=self.layout,
            data=self.data,
            train=self.train,
            evaluation=self.evaluation,
        )
        for _, section in self.plugin_sections:  # a plugin feature's own checks, then the run's
            if hasattr(section, "check"):
                section.check()
            if hasattr(section, "check_with"):
                section.check_with(self)

    def _check_sequence(self) -> None:
        seq = self.data.seq_length
        if self.shape.rotary and self.shape.head_dim % 2:
            raise UsageError(
                f"rotary embeddings rotate channel pairs: the head dim {self.shape.head_dim} "
                "(--hidden-size / --num-attention-heads, or --kv-channels) must be even"
            )
        if (self.model.max_position_embeddings or seq) < seq:
            raise UsageError(
                f"--max-position-embeddings {self.model.max_position_embeddings} is shorter than "
                f"--seq-length {seq}"
            )
        self._check_yarn_table()
        local = seq // self.layout.cp
        if not 1 <= self.model.loss_chunks <= local:
            raise UsageError(
                f"--loss-chunks must be in [1, {local}] (tokens per CP rank), got "
                f"{self.model.loss_chunks}"
            )

    def _check_retrieval(self) -> None:
        """Retrieval prompts run through the model at lengths of their own: each must be one
        the model addresses and the layout cuts."""
        evaluation = self.evaluation
        if evaluation.skip_train and self.data.variable_seq_lengths:
            raise UsageError(
                "--skip-train evaluates, and --variable-seq-lengths runs have no evaluation; "
                "drop --variable-seq-lengths to evaluate their checkpoint"
            )
        if not evaluation.retrieval:
            return
        if not (evaluation.eval_interval or evaluation.skip_train):
            raise UsageError(
                "--eval-retrieval-lengths is scored at evaluations: add --eval-interval N "
                "(or --skip-train to score a checkpoint once)"
            )
        longest = max(evaluation.eval_retrieval_lengths)
        table = self.model.max_position_embeddings or self.data.seq_length
        if self.shape.position_embedding_type == "learned_absolute" and longest > table:
            raise UsageError(
                f"--eval-retrieval-lengths {longest} is past the {table} positions the model's "
                "learned position embedding addresses (--max-position-embeddings); give lengths "
                f"up to {table}"
            )
        layout = self.layout
        multiple = math.lcm(2 * layout.cp if layout.cp > 1 else 1, layout.tp if layout.sp else 1)
        uneven = [n for n in evaluation.eval_retrieval_lengths if n % multiple]
        if uneven:
            raise UsageError(
                f"--eval-retrieval-lengths {uneven[0]} is not a multiple of {multiple}, which "
                "the layout cuts a sequence into (2 × CP, and TP under --sequence-parallel)"
            )

    def _check_yarn_table(self) -> None:
        # megatron-core's YarnRotaryEmbedding computes a table of the original context when it is
        # built and cuts it into 2·CP blocks under megatron's global CP group (the run's layout)
        original, cp = self.model.yarn_original_max_position_embeddings, self.layout.cp
        if self.shape.position_embedding_type == "yarn" and original % (2 * cp):
            raise UsageError(
                f"--yarn-original-max-position-embeddings {original} must be divisible by 2 × "
                f"--context-parallel-size = {2 * cp} (megatron-core's YaRN splits it for CP)"
            )

    def _check_counts(self) -> None:
        # megatron-core counts samples and tokens in int64 (its sample indices, the consumed
        # samples); a count past that would wrap, or build indices no memory holds
        gbs = self.train.global_batch_size or self.train.micro_batch_size * self.layout.dp
        steps, samples = self.train.train_iters, self.train.train_samples
        if steps is None and samples is None:
            return  # TrainConfig.check names the missing length
        if steps is None:  # --train-samples: the steps are derived at resolution
            counts = [("--train-samples", samples, samples)]
            steps = samples // gbs
        else:
            counts = [("--train-iters", steps, steps * gbs)]
        evaluation = self.evaluation
        if evaluation.enabled:
            evaluations = steps // evaluation.eval_interval + 1
            counts.append(("--eval-iters", evaluation.eval_iters,
                           evaluations * evaluation.eval_iters * gbs))  # fmt: skip
        for flag, value, samples in counts:
            if samples * self.data.seq_length >= 2**63:
                raise UsageError(
                    f"{flag} {value} makes {samples:.3g} samples of {self.data.seq_length} tokens, "
                    "past the 64-bit counts megatron-core keeps of them"
                )
            index_bytes = samples * INDEX_BYTES_PER_SAMPLE
            available = available_host_memory_bytes()
            if index_bytes > available:
                raise UsageError(
                    f"{flag} {value} makes {samples:.3g} samples; megatron-core indexes every "
                    f"one before the first step (at least {index_bytes / 2**30:,.0f} GiB), more "
                    f"than the {available / 2**30:,.0f} GiB this machine has free: train fewer "
                    "steps per run (a later run resumes from the checkpoint)"
                )

    def _check_batch(self) -> None:
        mbs, dp = self.train.micro_batch_size, self.layout.dp
        gbs = self.train.global_batch_size
        if gbs is not None and (gbs < 1 or gbs % (mbs * dp)):
            raise UsageError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size × DP = "
                f"{mbs}×{dp}"
            )
        schedule = self.train.step_schedule or ()
        uneven = [batch for _, batch in schedule if batch % (mbs * dp)]
        if uneven:
            raise UsageError(
                f"--step-batch-size-schedule batch {uneven[0]} is not divisible by "
                f"--micro-batch-size × DP = {mbs}×{dp}"
            )
        ramp = self.train.rampup_batch_size
        if self.data.variable_seq_lengths:  # refused there (DataConfig.check_with)
            ramp = None
        if ramp is not None and (ramp[0] % (mbs * dp) or ramp[1] % (mbs * dp)):
            # every batch of the ramp, START + k × INCR, must split into whole micro-batches
            raise UsageError(
                f"--rampup-batch-size START {ramp[0]} and INCR {ramp[1]} must be multiples of "
                f"--micro-batch-size × DP = {mbs}×{dp}"
            )
