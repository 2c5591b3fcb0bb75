"""Every setting of a training run, as frozen dataclasses, and the checks of each.

One field per flag: ``memo_ext.arguments`` generates the trainer's command line from these
classes (``memo_ext.flags``: the flag is the field's name, its help the docstring under it, its
default the field's default) and the README's flag reference is generated from that parser. The
model's size is :class:`~memo_ext.shapes.ModelShape` and the process layout
:class:`~memo_ext.parallel.ParallelLayout`; the sections here hold the rest.

A :class:`RunConfig` is built once from the flags (``memo_ext.arguments.parse_args``), checked
(:meth:`RunConfig.check`, one sentence per problem) and resolved once against the tokenizer and
the data (``memo_ext.training.resolve``): nothing downstream changes it. Its megatron-core
``TransformerConfig`` is derived from it (:attr:`RunConfig.transformer`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.data.datasets import (
    check_indexed_dataset,
    check_split,
    check_split_documents,
    parse_blend,
)
from memo_ext.data.tokenizers import BYTE_VOCAB_SIZE, TOKENIZER_TYPES, build_tokenizer
from memo_ext.errors import UsageError
from memo_ext.hardware import DEVICES
from memo_ext.mcore.config import transformer_config
from memo_ext.mcore.specs import ATTENTION_BACKENDS, resolve_attention_backend
from memo_ext.parallel import LayoutError, ParallelLayout, parse_strategies
from memo_ext.shapes import ModelShape

AUTO = "auto"
DEFAULT_HOST_SHARE = 0.8
"""Share of the available host memory MEMO may take when no budget is given: the rest is for the
data loader, the optimizer's host state and the operating system."""


def _at_least(value: float | None, low: float, flag: str) -> None:
    if value is not None and value < low:
        raise UsageError(f"{flag} must be at least {low:g}, got {value}")


def check_writable_directory(path: str, *, flag: str) -> None:
    """``path`` is a directory this process can write, or can be created as one: a wrong path
    fails now, not at the first save.

    Raises:
        UsageError: naming the path and what is wrong with it.
    """
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is" if existing == os.path.abspath(path) else f"lies under {existing}, which is"
        raise UsageError(f"{flag} {path} {where} a file, not a directory; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {existing} is not writable by this user")


def _fraction(value: float, flag: str) -> None:
    if not 0.0 <= value < 1.0:
        raise UsageError(f"{flag} must be in [0, 1), got {value}")


# ---------------------------------------------------------------------------------------------
# model, schedule, data, logging
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """GPT settings beyond the shape: positions, regularisation, initialisation, kernels."""

    max_position_embeddings: int | None = None
    """Position table length; --seq-length if unset."""
    rotary_base: int = 10000
    """RoPE base period."""
    norm_epsilon: float = 1e-5
    """Norm epsilon."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (Megatron-LM defaults to 0.1)."""
    hidden_dropout: float = 0.0
    """Dropout on each residual branch's output (Megatron-LM defaults to 0.1; long-context recipes
    and MEMO use 0)."""
    init_method_std: float = 0.02
    """Std of the normal weight init (output projections: / sqrt(2·layers))."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of sharing the input embedding's."""
    loss_chunks: int = 1
    """Run the output layer and loss over this many sequence slices, recomputed in backward: only
    one slice's logits live at a time (1 = one pass, as megatron)."""
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Core attention: sdpa (torch), flash (flash-attn), te (transformer-engine), auto (te, then
    flash on CUDA when installed, else sdpa)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding table to a multiple of lcm(this, TP)."""
    padded_vocab_size: int = field(default=0, metadata={"cli": False})
    """Embedding rows after padding (set when the run is resolved against its tokenizer)."""

    def check(self) -> None:
        _at_least(self.max_position_embeddings, 1, "--max-position-embeddings")
        _fraction(self.attention_dropout, "--attention-dropout")
        _fraction(self.hidden_dropout, "--hidden-dropout")
        _at_least(self.make_vocab_size_divisible_by, 1, "--make-vocab-size-divisible-by")
        for flag, value in (
            ("--init-method-std", self.init_method_std),
            ("--norm-epsilon", self.norm_epsilon),
            ("--rotary-base", self.rotary_base),
        ):
            if not value > 0:
                raise UsageError(f"{flag} must be positive, got {value}")
        try:
            resolve_attention_backend(self.attention_backend)
        except ValueError as err:
            raise UsageError(str(err)) from None


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How the processes of a job talk."""

    FLAG_PREFIX: ClassVar[str] = "distributed"

    timeout_minutes: float = 10.0
    """A collective that waits longer than this (a stalled or dead rank) fails the job instead of
    hanging it (Megatron-LM's default, 10)."""

    def check(self) -> None:
        if not self.timeout_minutes > 0:
            raise UsageError(
                f"--distributed-timeout-minutes must be positive, got {self.timeout_minutes}"
            )


@dataclass(frozen=True, kw_only=True)
class RecomputeConfig:
    """Megatron-LM's activation recomputation (the baselines MEMO is compared with)."""

    FLAG_PREFIX: ClassVar[str] = "recompute"

    granularity: Literal["full", "selective"] | None = None
    """Megatron recomputation: full layers, or selective (core attention)."""
    method: Literal["uniform", "block"] | None = None
    """Which layers full recomputation covers."""
    num_layers: int | None = None
    """Layers per recompute unit (uniform) or recomputed layers per stage (block)."""

    def check(self, *, stage_layers: int) -> None:
        """``stage_layers``: transformer layers per pipeline stage."""
        if self.granularity is None:
            if self.method or self.num_layers:
                raise UsageError(
                    "--recompute-method / --recompute-num-layers need --recompute-granularity full"
                )
            return
        if self.granularity == "selective":
            if self.method or self.num_layers:
                raise UsageError(
                    "--recompute-granularity selective takes no --recompute-method / -num-layers"
                )
            return
        if self.method is None or self.num_layers is None:
            raise UsageError(
                "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
            )
        if not 1 <= self.num_layers <= stage_layers:
            raise UsageError(
                f"--recompute-num-layers must be in [1, {stage_layers}] (layers per pipeline stage)"
            )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation schedule, batch sizes and precision."""

    micro_batch_size: int
    """Sequences per forward/backward pass on each DP rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all DP ranks; mbs × DP if unset."""
    train_iters: int
    """Optimizer steps."""
    lr: float
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "linear"
    """LR decay after warm-up (megatron-core's scheduler)."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Steps over which the rate decays to --min-lr; --train-iters if unset."""
    weight_decay: float = 0.01
    """AdamW weight decay (not on biases and norms)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global-norm clip; 0 = off."""
    seed: int = 1234
    """Seed for weights, dropout and data order."""
    check_for_nan_in_loss_and_grad: bool = field(default=True, metadata={"negatable": True})
    """Stop, pointing at the last good checkpoint, on a non-finite loss or grad norm."""
    skip_iterations_with_nan: bool = False
    """Skip the update of a step with a non-finite loss or grad norm instead of stopping."""
    bf16: bool = False
    """bf16 weights and activations (CUDA)."""
    fp16: bool = False
    """fp16 with loss scaling (CUDA)."""
    use_distributed_optimizer: bool = field(default=False, metadata={"negatable": True})
    """Shard optimizer state over DP ranks (megatron's distributed optimizer, CUDA)."""

    def check(self) -> None:
        _at_least(self.micro_batch_size, 1, "--micro-batch-size")
        _at_least(self.global_batch_size, 1, "--global-batch-size")
        _at_least(self.train_iters, 1, "--train-iters")
        self._check_optimizer()
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 are exclusive; choose one")
        cuda = torch.cuda.is_available()
        if (self.bf16 or self.fp16) and not cuda:
            raise UsageError(
                "--bf16 / --fp16 need CUDA (megatron's mixed-precision optimizer); drop the flag"
            )
        if self.use_distributed_optimizer and not cuda:
            raise UsageError(
                "--use-distributed-optimizer needs CUDA (megatron's optimizer); drop the flag"
            )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise UsageError(
                f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={self.lr} min-lr={self.min_lr}"
            )
        if self.lr_warmup_iters < 0 or self.lr_warmup_iters > self.train_iters:
            raise UsageError(
                f"--lr-warmup-iters {self.lr_warmup_iters} must be in [0, --train-iters]"
            )
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise UsageError(
                f"--lr-decay-iters {self.lr_decay_iters} must be larger than --lr-warmup-iters "
                f"{self.lr_warmup_iters} (the decay starts after the warm-up)"
            )
        if self.clip_grad < 0:
            raise UsageError(
                f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}"
            )
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32) (numpy's range), got {self.seed}")

    def _check_optimizer(self) -> None:
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= value < 1.0:
                raise UsageError(f"{flag} must be in [0, 1), got {value}")
        if not self.adam_eps > 0:
            raise UsageError(f"--adam-eps must be positive, got {self.adam_eps}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from."""

    seq_length: int
    """Tokens per sample."""
    data_path: tuple[str, ...] = ()
    """Dataset prefixes, optionally weighted (0.7 a 0.3 b), as in Megatron-LM."""
    split: str = "969,30,1"
    """Train,valid,test proportions."""
    mock_data: bool = False
    """Synthetic tokens."""
    variable_seq_lengths: bool = False
    """Whole documents (cut at --seq-length) packed into rows with per-document attention;
    --global-batch-size then counts documents."""
    tokenizer_type: Literal[TOKENIZER_TYPES] = "ByteTokenizer"
    """Tokenizer; nothing is downloaded."""
    vocab_size: int | None = None
    """NullTokenizer vocabulary (other tokenizers fix their own)."""
    tokenizer_model: str | None = None
    """Local tokenizer.json, or a directory holding one (HuggingFaceTokenizer)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocab.json (GPT2BPETokenizer)."""
    merge_file: str | None = None
    """GPT-2 BPE merges.txt (GPT2BPETokenizer)."""
    data_cache_path: str | None = None
    """Where dataset index caches go (default: beside the data)."""

    def check(self) -> None:
        """Flags, then the files they name: a missing dataset or tokenizer fails here."""
        _at_least(self.seq_length, 1, "--seq-length")
        if self.data_cache_path:
            check_writable_directory(self.data_cache_path, flag="--data-cache-path")
        if self.mock_data == bool(self.data_path):
            raise UsageError("give exactly one of --data-path PREFIX… or --mock-data")
        if self.tokenizer_type == "NullTokenizer" and self.vocab_size is None:
            raise UsageError("--tokenizer-type NullTokenizer needs --vocab-size")
        if self.tokenizer_type == "ByteTokenizer" and self.vocab_size not in (
            None,
            BYTE_VOCAB_SIZE,
        ):
            raise UsageError(
                f"--tokenizer-type ByteTokenizer has {BYTE_VOCAB_SIZE} tokens but --vocab-size "
                f"says {self.vocab_size}; drop --vocab-size"
            )
        if self.tokenizer_type in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
            self._check_file_tokenizer()
        try:
            check_split(self.split)
            prefixes = parse_blend(self.data_path)[0] if self.data_path else []
            for prefix in prefixes:
                documents = check_indexed_dataset(prefix)
                if not self.variable_seq_lengths:  # whole documents take no --split
                    check_split_documents(prefix, self.split, documents=documents)
        except (ValueError, FileNotFoundError) as err:
            raise UsageError(str(err)) from None

    def _check_file_tokenizer(self) -> None:
        """Load a file-based tokenizer now: a bad path or a size mismatch fails before any work."""
        tokenizer = self.build_tokenizer()
        if self.vocab_size is not None and self.vocab_size != tokenizer.vocab_size:
            raise UsageError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but --vocab-size says "
                f"{self.vocab_size}; drop --vocab-size"
            )

    def build_tokenizer(self):
        """The tokenizer these flags name (``memo_ext.data.tokenizers``).

        Raises:
            UsageError: a tokenizer file that is missing or cannot be read.
        """
        try:
            return build_tokenizer(
                tokenizer_type=self.tokenizer_type,
                vocab_size=self.vocab_size,
                tokenizer_model=self.tokenizer_model,
                vocab_file=self.vocab_file,
                merge_file=self.merge_file,
            )
        except ValueError as err:
            raise UsageError(str(err)) from None


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Console, metrics-file and TensorBoard output."""

    log_interval: int = 10
    """Log every this many steps (and the first and last)."""
    metrics_file: str | None = None
    """JSON Lines metrics, one object per logged step (rank 0)."""
    device_peak_tflops: float | None = None
    """Device dense peak for MFU; looked up from the CUDA device's name when unset."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (rank 0)."""

    def check(self) -> None:
        _at_least(self.log_interval, 1, "--log-interval")
        if self.device_peak_tflops is not None and self.device_peak_tflops <= 0:
            raise UsageError(
                f"--device-peak-tflops must be positive, got {self.device_peak_tflops}"
            )
        if self.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            raise UsageError(
                "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
            )
        if self.tensorboard_dir:
            check_writable_directory(self.tensorboard_dir, flag="--tensorboard-dir")
        if self.metrics_file:
            if os.path.isdir(self.metrics_file):
                raise UsageError(f"--metrics-file {self.metrics_file} is a directory; give a file")
            parent = os.path.dirname(os.path.abspath(self.metrics_file))
            check_writable_directory(parent, flag=f"--metrics-file {self.metrics_file}: folder")


@dataclass(frozen=True, kw_only=True)
class EvaluationConfig:
    """Validation during training."""

    eval_interval: int | None = None
    """Evaluate on the validation split every N steps (never if unset)."""
    eval_iters: int = 10
    """Validation global batches per evaluation."""

    @property
    def enabled(self) -> bool:
        return bool(self.eval_interval) and self.eval_iters > 0

    def check(self) -> None:
        _at_least(self.eval_interval, 1, "--eval-interval")
        _at_least(self.eval_iters, 0, "--eval-iters")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving, resuming and stopping early."""

    save: str | None = None
    """Directory to write checkpoints to."""
    load: str | None = None
    """Resume from the newest checkpoint in this directory (none there: start fresh)."""
    save_interval: int | None = None
    """Save every this many steps (and at the end)."""
    exit_interval: int | None = None
    """Save and stop after a step whose number is a multiple of N."""
    exit_duration_in_mins: float | None = None
    """Save and stop after N minutes."""
    exit_signal_handler: bool = False
    """On SIGTERM / SIGINT save at the next step boundary and exit 0."""
    override_opt_param_scheduler: bool = field(
        default=False, metadata={"flag": "--override-opt_param-scheduler"}
    )
    """On resume, train with the LR / weight-decay schedule of these flags, not the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = field(
        default=False, metadata={"flag": "--use-checkpoint-opt_param-scheduler"}
    )
    """On resume, keep the checkpoint's LR / weight-decay schedule whatever these flags say.
    Without either flag a resumed run whose schedule differs from its checkpoint's stops and
    names the difference (as Megatron-LM does)."""

    def check(self) -> None:
        _at_least(self.save_interval, 1, "--save-interval")
        _at_least(self.exit_interval, 1, "--exit-interval")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise UsageError(
                f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}"
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise UsageError(
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
                "exclusive; choose the flags' schedule or the checkpoint's"
            )
        if self.save:
            check_writable_directory(self.save, flag="--save")
        if self.save_interval and not self.save:
            raise UsageError("--save-interval needs --save DIR")
        if self.load and not os.path.isdir(self.load):
            raise UsageError(f"--load directory {self.load} does not exist")
        stops = self.exit_interval or self.exit_duration_in_mins or self.exit_signal_handler
        if stops and not self.save:
            raise UsageError(
                "--exit-interval / --exit-duration-in-mins / --exit-signal-handler save before "
                "stopping and need --save DIR"
            )


@dataclass(frozen=True, kw_only=True)
class PreflightConfig:
    """The memory check made before the model is built (``memo_ext.estimate.preflight``)."""

    enabled: bool = field(default=True, metadata={"flag": "--skip-preflight"})
    """Estimate device and host memory first and refuse a run that cannot fit; --skip-preflight
    runs it even if it cannot fit."""
    device: str | None = field(
        default=None, metadata={"flag": "--preflight-device", "choices": sorted(DEVICES)}
    )
    """Check the run against this device preset (default: the CUDA device; none on CPU); HotSPa's
    auto layouts are planned for it too."""


# ---------------------------------------------------------------------------------------------
# MEMO and HotSPa
# ---------------------------------------------------------------------------------------------


def parse_alpha(text: str) -> float | None:
    """``--memo-alpha``: a number, or ``auto`` (``None``: solved at the first layer)."""
    if text == AUTO:
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number in [0, 1] or 'auto', got {text!r}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class MemoConfig:
    """Token-wise activation swapping and recomputation (MEMO) for every transformer layer."""

    FLAG_PREFIX: ClassVar[str] = "memo"

    enabled: bool = field(default=False, metadata={"flag": "--memo"})
    """Turn MEMO on."""
    alpha: float | None = field(default=None, metadata={"parse": parse_alpha})
    """Fraction of each token-wise activation's tokens kept in host memory, in [0, 1], or 'auto'
    (largest α whose copy hides under a layer's forward and fits the host budget). Default: auto."""
    host_memory_gb: float | None = None
    """Host memory MEMO may use per process, GiB. Default: 80% of the available memory divided by
    the processes on this node."""
    keep_last_layers: int = 2
    """Layers at the end of each pipeline stage that keep their activations on the device: their
    backward starts right after their forward, so a round trip to the host would not pay."""

    @property
    def auto_alpha(self) -> bool:
        return self.alpha is None

    def check(self) -> None:
        """Refuse values MEMO cannot honour; MEMO flags without --memo."""
        if not self.enabled:
            given = [
                f"--memo-{f.name.replace('_', '-')}"
                for f in dataclasses.fields(self)
                if f.name != "enabled" and getattr(self, f.name) != f.default
            ]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise UsageError(f"{', '.join(given)} only {verb} with --memo; add --memo")
            return
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise UsageError(f"--memo-alpha must be in [0, 1] or 'auto', got {self.alpha}")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            raise UsageError(f"--memo-host-memory-gb must be positive, got {self.host_memory_gb}")
        if self.keep_last_layers < 0:
            raise UsageError(f"--memo-keep-last-layers must be >= 0, got {self.keep_last_layers}")

    @staticmethod
    def check_combination(
        *,
        hidden_dropout: float,
        recompute_granularity: str | None,
        attention_backend: str,
        cpu_offloading: bool = False,
        fine_grained_activation_offloading: bool = False,
    ) -> None:
        """Refuse what MEMO cannot run with, one sentence each.

        Hidden dropout sits in the token-local part that is recomputed on a token slice, where it
        would draw other masks; attention dropout is fine (attention is never re-run).
        """
        if hidden_dropout > 0.0:
            raise UsageError(
                f"--memo recomputes token slices and cannot reproduce hidden-dropout masks; "
                f"use --hidden-dropout 0 (got {hidden_dropout})"
            )
        if recompute_granularity is not None:
            raise UsageError(
                "--memo replaces megatron's activation recomputation; drop --recompute-granularity"
            )
        if attention_backend == "te":
            raise UsageError(
                "--memo works on layers with our core attention; use --attention-backend sdpa or "
                "flash"
            )
        if cpu_offloading or fine_grained_activation_offloading:
            raise UsageError(
                "--memo cannot run with megatron's cpu_offloading or "
                "fine_grained_activation_offloading; turn those off"
            )


def parse_token_counts(text: str) -> tuple[int, ...]:
    """``"4096,16384,32768"`` → ``(4096, 16384, 32768)``."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated token counts, got {text!r}"
        ) from None


def check_buckets(bounds: tuple[int, ...], *, seq_length: int) -> None:
    """Bucket bounds must ascend strictly and end at ``--seq-length``.

    Raises:
        UsageError: naming the problem.
    """
    if any(b < 2 for b in bounds) or list(bounds) != sorted(set(bounds)):
        text = ",".join(map(str, bounds))
        raise UsageError(f"--hotspa-buckets must be strictly ascending, each 2 or more: {text!r}")
    if bounds[-1] != seq_length:
        raise UsageError(
            f"the last of --hotspa-buckets ({bounds[-1]}) must equal --seq-length ({seq_length}): "
            "documents are cut at --seq-length and the longest bucket must hold them"
        )


def parse_buckets(text: str, *, seq_length: int) -> tuple[int, ...]:
    """``--hotspa-buckets`` text → checked ascending bounds ending at ``seq_length``.

    Raises:
        ValueError: naming the problem.
    """
    try:
        bounds = parse_token_counts(text)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"--hotspa-buckets {err}") from None
    check_buckets(bounds, seq_length=seq_length)
    return bounds


@dataclass(frozen=True, kw_only=True)
class HotSPaConfig:
    """Length buckets, each trained in its own parallel layout of the same processes."""

    FLAG_PREFIX: ClassVar[str] = "hotspa"

    enabled: bool = field(default=False, metadata={"flag": "--hotspa"})
    """Group each global batch into length buckets and train each bucket in its own parallel
    layout of the same processes, switching weights in and gradients back to the home layout (the
    longest bucket's) within the step. Needs --variable-seq-lengths; the layouts replace
    --tensor/--pipeline-model-parallel-size."""
    buckets: tuple[int, ...] = field(
        default=(), metadata={"parse": parse_token_counts, "metavar": "N1,N2,..."}
    )
    """Bucket upper bounds in tokens, ascending; the last must equal --seq-length (default:
    --seq-length alone, one bucket)."""
    strategy_spec: str = field(
        default=AUTO, metadata={"flag": "--hotspa-strategies", "metavar": "LAYOUTS|auto"}
    )
    """One layout per bucket, shortest first, separated by ';', each a product of dp<N>, tp<N>,
    pp<N>, cp<N> (e.g. 'dp4;dp2tp2;tp2cp2'; a missing dp takes the remaining processes; SP is on
    with TP > 1). 'auto' picks, per bucket, the fastest layout that fits device memory by the
    estimator's model, for --preflight-device (default: the CUDA device, or h100-80g on a machine
    without one)."""
    backfill: bool = True
    """Fill the room long documents leave in longer buckets' rows with shorter documents before
    opening shorter rows; --no-hotspa-backfill keeps every document in the smallest bucket that
    holds it."""
    mode: Literal["switch", "dynamic-cp"] = "switch"
    """switch: each bucket may use any DP × TP × PP × CP layout (weights re-sharded when TP or PP
    differ from home); dynamic-cp: every bucket keeps home's TP and PP and only the CP degree
    changes, so nothing is re-sharded. Layouts that differ from home only in CP run on the home
    model in both modes."""
    strategies: tuple[ParallelLayout, ...] | None = field(default=None, metadata={"cli": False})
    """One layout per bucket (shortest first); ``None`` while ``auto`` has not chosen."""

    @property
    def auto(self) -> bool:
        return self.strategy_spec.strip().lower() == AUTO

    @property
    def home(self) -> ParallelLayout:
        """The longest bucket's layout: megatron's global groups, optimizer and checkpoints."""
        if not self.strategies:
            raise RuntimeError("HotSPa strategies are not chosen yet; resolve the run first")
        return self.strategies[-1]

    def check(self) -> None:
        """HotSPa flags without --hotspa (the rest needs the run: :meth:`RunConfig.check`)."""
        if self.enabled:
            return
        defaults = HotSPaConfig()
        if (self.buckets, self.strategy_spec, self.mode) != (
            defaults.buckets,
            defaults.strategy_spec,
            defaults.mode,
        ):
            raise UsageError("--hotspa-buckets / --hotspa-strategies / --hotspa-mode need --hotspa")

    def parsed(self, *, seq_length: int, world_size: int, shape: ModelShape) -> HotSPaConfig:
        """Buckets defaulted and checked, explicit strategies parsed and checked against the
        model and each bucket.

        Raises:
            UsageError: one sentence.
        """
        buckets = self.buckets or (seq_length,)
        check_buckets(buckets, seq_length=seq_length)
        if self.auto:
            return dataclasses.replace(self, buckets=buckets)
        try:
            layouts = parse_strategies(self.strategy_spec, world_size)
            for layout, bucket in zip(layouts, buckets):
                layout.check_fits(shape, bucket, length=f"the {bucket}-token bucket")
        except LayoutError as err:
            raise LayoutError(f"--hotspa-strategies: {err}") from None
        if len(layouts) != len(buckets):
            raise UsageError(
                f"--hotspa-strategies gives {len(layouts)} layouts for {len(buckets)} buckets "
                f"({','.join(map(str, buckets))}); give one per bucket, shortest first"
            )
        home = layouts[-1]
        if self.mode == "dynamic-cp":
            for layout in layouts:
                if (layout.tp, layout.pp) != (home.tp, home.pp):
                    raise UsageError(
                        f"--hotspa-mode dynamic-cp changes only CP: layout {layout.name} has "
                        f"other TP / PP than home ({home.name})"
                    )
        return dataclasses.replace(self, buckets=buckets, strategies=layouts)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one training run needs (see the module docstring)."""

    shape: ModelShape
    """The model's sizes."""
    model: ModelConfig
    layout: ParallelLayout
    """This run's process layout (with HotSPa: the home layout once resolved)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    train: TrainConfig
    data: DataConfig
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    memo: MemoConfig = field(default_factory=MemoConfig)
    """MEMO's token-wise activation offloading (off by default)."""
    hotspa: HotSPaConfig = field(default_factory=HotSPaConfig)
    """HotSPa's length buckets and per-bucket layouts (off by default)."""
    world_size: int = 1
    """Processes in the job (torchrun's ``WORLD_SIZE``)."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each DP rank."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.layout.dp)

    @functools.cached_property
    def transformer(self) -> TransformerConfig:
        """megatron-core's config of this run's model in its layout (built once per RunConfig;
        a model that megatron's schedules configure gets its own copy,
        :meth:`transformer_config`)."""
        return self.transformer_config()

    def transformer_config(self, layout: ParallelLayout | None = None) -> TransformerConfig:
        """A fresh megatron-core config of this run's model in ``layout`` (default: the run's)."""
        m, r, t = self.model, self.recompute, self.train
        return transformer_config(
            self.shape,
            layout=layout or self.layout,
            layernorm_epsilon=m.norm_epsilon,
            attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            init_method_std=m.init_method_std,
            recompute_granularity=r.granularity,
            recompute_method=r.method,
            recompute_num_layers=r.num_layers,
            bf16=t.bf16,
            fp16=t.fp16,
            params_dtype=t.params_dtype,
            pipeline_dtype=t.params_dtype,
            # the loss is a mean over every real token of the global batch, however it is split
            calculate_per_token_loss=True,
            # memo_ext.mcore.init redraws every weight after the model is built, independently
            # of the parallel layout. megatron's own draw still runs: with it off, its layers
            # also skip tagging weights as tensor-parallel, which gradient norms and checkpoints
            # need.
            use_cpu_initialization=not torch.cuda.is_available(),
            perform_initialization=True,
        )

    def check(self) -> None:
        """Every section's checks, then the rules that tie sections together.

        Raises:
            UsageError: the first problem, in one sentence that says what to change.
        """
        self.shape.check()
        self.data.check()  # before the model's: --max-position-embeddings defaults to its length
        self.model.check()
        self.train.check()
        self.layout.check_fits(self.shape, self.data.seq_length)
        self._check_sequence()
        self._check_batch()
        self.recompute.check(stage_layers=self.shape.num_layers // self.layout.pp)
        self.logging.check()
        self.distributed.check()
        self.memo.check()
        if self.memo.enabled:
            self._check_memo()
        self.evaluation.check()
        self._check_evaluation_split()
        self.checkpoint.check()
        self._check_variable_lengths()
        self.hotspa.check()
        self._check_hotspa()

    def _check_memo(self) -> None:
        self.memo.check_combination(
            hidden_dropout=self.model.hidden_dropout,
            recompute_granularity=self.recompute.granularity,
            attention_backend=self.model.attention_backend,
        )
        stage_layers = self.shape.num_layers // self.layout.pp
        if self.memo.keep_last_layers >= stage_layers:
            raise UsageError(
                f"--memo would offload no layer: each pipeline stage has {stage_layers} layers and "
                f"--memo-keep-last-layers {self.memo.keep_last_layers} keeps them all on the "
                "device; lower --memo-keep-last-layers or drop --memo"
            )

    def _check_sequence(self) -> None:
        seq = self.data.seq_length
        if self.shape.position_embedding_type == "rope" and self.shape.head_dim % 2:
            raise UsageError(
                f"rotary embeddings rotate channel pairs: the head dim {self.shape.head_dim} "
                "(--hidden-size / --num-attention-heads, or --kv-channels) must be even"
            )
        if (self.model.max_position_embeddings or seq) < seq:
            raise UsageError(
                f"--max-position-embeddings {self.model.max_position_embeddings} is shorter than "
                f"--seq-length {seq}"
            )
        local = seq // self.layout.cp
        if not 1 <= self.model.loss_chunks <= local:
            raise UsageError(
                f"--loss-chunks must be in [1, {local}] (tokens per CP rank), got "
                f"{self.model.loss_chunks}"
            )

    def _check_batch(self) -> None:
        mbs, dp = self.train.micro_batch_size, self.layout.dp
        gbs = self.train.global_batch_size
        if gbs is not None and (gbs < 1 or gbs % (mbs * dp)):
            raise UsageError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size × DP = "
                f"{mbs}×{dp}"
            )

    def _check_evaluation_split(self) -> None:
        if not self.evaluation.enabled or self.data.mock_data:
            return
        weights = [float(w) for w in self.data.split.replace("/", ",").split(",") if w.strip()]
        if len(weights) < 2 or weights[1] <= 0:
            raise UsageError(
                f"--eval-interval needs a validation part in --split, got {self.data.split!r}"
            )

    def _check_variable_lengths(self) -> None:
        """Packed rows run under DP, TP, PP and CP; refuse what they do not support."""
        if not self.data.variable_seq_lengths:
            return
        unsupported = {
            "--micro-batch-size > 1 (a packed row is one micro-batch)": self.train.micro_batch_size
            != 1,
            "--memo": self.memo.enabled,
            "--eval-interval": bool(self.evaluation.eval_interval),
            "a blend of several --data-path prefixes": len(self.data.data_path) > 1,
        }
        for what, present in unsupported.items():
            if present:
                raise UsageError(f"--variable-seq-lengths does not support {what} yet")

    def _check_hotspa(self) -> None:
        if not self.hotspa.enabled:
            return
        if not self.data.variable_seq_lengths:
            raise UsageError("--hotspa trains whole documents: add --variable-seq-lengths")
        fixed = {
            "--tensor-model-parallel-size": self.layout.tp,
            "--pipeline-model-parallel-size": self.layout.pp,
            "--context-parallel-size": self.layout.cp,
        }
        for flag, value in fixed.items():
            if value != 1:
                raise UsageError(
                    f"with --hotspa the layouts come from --hotspa-strategies; drop {flag}"
                )
        self.hotspa.parsed(
            seq_length=self.data.seq_length, world_size=self.world_size, shape=self.shape
        )
