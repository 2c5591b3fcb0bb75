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
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.data.datasets import (
    check_indexed_dataset,
    check_split,
    check_split_documents,
    parse_blend,
)
from memo_ext.data.tokenizers import BYTE_VOCAB_SIZE, TOKENIZER_TYPES, build_tokenizer
from memo_ext.errors import UsageError
from memo_ext.flags import flag_name
from memo_ext.hardware import DEVICES, read_calibration
from memo_ext.mcore.batches import batch_at, parse_step_schedule
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


def _installed(module: str) -> bool:
    """``module`` can be imported (or already is: a module put in ``sys.modules`` may have no
    spec; one set to ``None`` there is blocked)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


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
    apply_layernorm_1p: bool = False
    """Zero-centred norm gains, as Megatron-LM: every norm (LayerNorm or RMSNorm) stores γ − 1,
    initialised to 0, and scales by weight + 1 (megatron-core's layernorm_zero_centered_gamma)."""
    cross_entropy_loss_fusion: bool = False
    """megatron-core's fused vocab-parallel cross entropy (CUDA; on CPU and with --hotspa the
    unfused loss runs and the log says so)."""
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
    overlap_grad_reduce: bool = field(default=False, metadata={"flag": "--overlap-grad-reduce"})
    """Overlap the data-parallel gradient reduction with the backward pass, bucket by bucket
    (megatron-core DDP; CUDA only: on CPU, and with --hotspa, the log says it does not apply)."""
    overlap_param_gather: bool = field(default=False, metadata={"flag": "--overlap-param-gather"})
    """Overlap the distributed optimizer's parameter all-gather with the next forward pass (CUDA;
    needs --use-distributed-optimizer and --overlap-grad-reduce)."""
    grad_reduce_in_bf16: bool = field(default=False, metadata={"flag": "--grad-reduce-in-bf16"})
    """With --bf16, accumulate and reduce gradients in bf16 instead of fp32: half the DP traffic,
    the optimizer still keeps fp32 master weights (fp32 weights make it a no-op)."""

    def check(self, *, distributed_optimizer: bool = False) -> None:
        """``distributed_optimizer``: --use-distributed-optimizer is on."""
        if not self.timeout_minutes > 0:
            raise UsageError(
                f"--distributed-timeout-minutes must be positive, got {self.timeout_minutes}"
            )
        if self.overlap_param_gather and not (distributed_optimizer and self.overlap_grad_reduce):
            raise UsageError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
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


OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
"""megatron-core's ``offload_modules`` of a dense GPT layer (its ``expert_fc1`` and ``moe_act``
belong to mixture-of-experts layers, which this trainer does not build)."""
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
"""megatron-core's default of ``min_offloaded_tensor_size``, elements."""


def megatron_offload_missing() -> str | None:
    """What megatron-core's activation offloading needs and this process lacks (``"CUDA"``,
    ``"transformer-engine"`` or both, as a phrase), or ``None``.

    Both of its variants copy on CUDA streams and go through transformer-engine: the layer-level
    one is transformer-engine's own offload context, which megatron-core builds only where
    transformer-engine imports; the fine-grained one raises without transformer-engine's
    ``cpu_offload`` module when it enters a module.
    """
    present = {
        "CUDA": torch.cuda.is_available(),
        "transformer-engine": _installed("transformer_engine"),
    }
    missing = [name for name, here in present.items() if not here]
    return " and ".join(missing) or None


@dataclass(frozen=True, kw_only=True)
class MegatronOffloadConfig:
    """megatron-core's own activation offloading to host memory: the in-library baselines MEMO is
    compared with (CUDA and transformer-engine only; never together with --memo)."""

    cpu_offloading_num_layers: int = 0
    """Layer-level offloading (megatron-core's cpu_offloading, through transformer-engine's offload
    context): the activations of this many layers, at least 1 and fewer than --num-layers, go to
    host memory after their forward and come back for their backward; 0 is off. CUDA and
    transformer-engine; no PP, no recomputation."""
    fine_grained_activation_offloading: bool = False
    """Module-level offloading (megatron-core's fine_grained_activation_offloading): in every layer,
    what the --offload-modules save for backward goes to pinned host memory on a copy stream and
    comes back before their backward; the last layer's stay on the device, its backward comes
    first. CUDA and transformer-engine; no recomputation."""
    offload_modules: tuple[str, ...] = field(default=(), metadata={"choices": OFFLOAD_MODULES})
    """The modules whose saved activations --fine-grained-activation-offloading moves: attn_norm,
    qkv_linear, core_attn, attn_proj (with core_attn), mlp_norm (a norm fused into the next linear
    layer, as in the te layer spec, has nothing of its own to move)."""
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    """Saved tensors of fewer elements than this stay on the device
    (--fine-grained-activation-offloading)."""

    @property
    def layer_offloading(self) -> bool:
        return self.cpu_offloading_num_layers != 0

    @property
    def enabled(self) -> bool:
        return self.layer_offloading or self.fine_grained_activation_offloading

    @property
    def flag(self) -> str:
        """The flag that turned offloading on (for messages)."""
        if self.fine_grained_activation_offloading:
            return "--fine-grained-activation-offloading"
        return "--cpu-offloading-num-layers"

    def check(self, *, num_layers: int) -> None:
        """Refuse what megatron-core would reject (in one sentence instead of its assertion) and
        module flags without --fine-grained-activation-offloading."""
        if self.layer_offloading and not 0 < self.cpu_offloading_num_layers < num_layers:
            raise UsageError(
                f"--cpu-offloading-num-layers must be at least 1 and below --num-layers "
                f"({num_layers}), got {self.cpu_offloading_num_layers}"
            )
        if not self.fine_grained_activation_offloading:
            if self.offload_modules or self.min_offloaded_tensor_size != MIN_OFFLOADED_TENSOR_SIZE:
                raise UsageError(
                    "--offload-modules / --min-offloaded-tensor-size only apply with "
                    "--fine-grained-activation-offloading; add it"
                )
        else:
            self._check_fine_grained()

    def check_machine(self) -> None:
        """Refuse offloading on a machine without CUDA or transformer-engine."""
        missing = megatron_offload_missing() if self.enabled else None
        if missing:
            raise UsageError(
                f"{self.flag} needs {missing} (megatron-core offloads on CUDA copy streams "
                "through transformer-engine), which this machine lacks; drop it (--memo offloads "
                "activations without them)"
            )

    def _check_fine_grained(self) -> None:
        if self.layer_offloading:
            raise UsageError(
                "--cpu-offloading-num-layers and --fine-grained-activation-offloading are "
                "exclusive (megatron-core runs one or the other); choose one"
            )
        if not self.offload_modules:
            raise UsageError(
                "--fine-grained-activation-offloading needs --offload-modules, one or more of "
                f"{' '.join(OFFLOAD_MODULES)}"
            )
        if "attn_proj" in self.offload_modules and "core_attn" not in self.offload_modules:
            raise UsageError(
                "--offload-modules attn_proj needs core_attn too: the projection's input is the "
                "core attention's output, which the core attention's backward needs"
            )
        if self.min_offloaded_tensor_size < 0:
            raise UsageError(
                f"--min-offloaded-tensor-size must be >= 0, got {self.min_offloaded_tensor_size}"
            )


def sample_based_steps(
    *,
    train_samples: int,
    global_batch_size: int,
    rampup_batch_size: tuple[int, ...] | None,
    step_schedule: tuple[tuple[int, int], ...] | None = None,
    seq_length: int = 1,
) -> tuple[int, int]:
    """(optimizer steps, samples they consume) of a run of ``train_samples`` samples, counted as
    Megatron-LM's ``update_train_iters`` counts them.

    Without a ramp-up: whole global batches, the last partial one dropped. With one (START INCR
    SAMPLES): while at most SAMPLES and at most ``train_samples`` samples are consumed, each step
    takes the batch megatron-core's ramp-up calculator gives for the samples consumed so far
    (the last of these steps may pass ``train_samples``); then whole full batches. With a step
    schedule (tokens → batch): each step takes the batch of the tokens consumed before it, as
    long as it fits in ``train_samples``.
    """
    if step_schedule is not None:
        steps = consumed = 0
        while consumed + (batch := batch_at(step_schedule, consumed, seq_length)) <= train_samples:
            steps, consumed = steps + 1, consumed + batch
        return steps, consumed
    if rampup_batch_size is None:
        steps = train_samples // global_batch_size
        return steps, steps * global_batch_size
    start, increment, ramp_samples = rampup_batch_size
    ramp = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=global_batch_size,
        micro_batch_size=1,  # the batch sizes do not depend on the split; nothing is checked
        data_parallel_size=1,
        decrease_batch_size_if_needed=False,
        rank=-1,  # a dry run: no log lines
        start_global_batch_size=start,
        batch_size_increment=increment,
        ramup_samples=ramp_samples,
    )
    steps = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        ramp.update(consumed, consistency_check=False)
        consumed += ramp.get_current_global_batch_size()
        steps += 1
    if train_samples > consumed:
        full = (train_samples - consumed) // global_batch_size
        steps, consumed = steps + full, consumed + full * global_batch_size
    return steps, consumed


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation schedule, batch sizes and precision."""

    micro_batch_size: int
    """Sequences per forward/backward pass on each DP rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all DP ranks; mbs × DP if unset."""
    rampup_batch_size: tuple[int, ...] | None = field(default=None, metadata={"metavar": "N"})
    """START INCR SAMPLES: start at a global batch of START sequences and grow it by INCR in equal
    shares of the first SAMPLES samples up to --global-batch-size (Megatron-LM's ramp-up; needs
    --train-samples; START and INCR multiples of --micro-batch-size × DP)."""
    step_batch_size_schedule: str | None = None
    """"TOKENS:BATCH ...", e.g. "0:768 250B:1536": the global batch steps up once the tokens
    trained reach each threshold (K, M, B, T suffixes; the first threshold 0); needs
    --train-samples, and --global-batch-size is the largest batch (Megatron-LM's step
    schedule)."""
    train_iters: int | None = None
    """Optimizer steps; give this or --train-samples."""
    train_samples: int | None = None
    """Samples to train on, instead of --train-iters: the steps are derived (a last partial batch
    dropped, --rampup-batch-size's smaller batches counted) and the LR and weight-decay schedules
    count samples (--lr-warmup-samples, --lr-decay-samples, --lr-wsd-decay-samples)."""
    lr: float
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """LR decay after warm-up (megatron-core's scheduler); WSD holds --lr and anneals to --min-lr
    over the last --lr-wsd-decay-iters / --lr-wsd-decay-samples of the decay span."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Shape of WSD's anneal (--lr-decay-style WSD)."""
    lr_warmup_fraction: float | None = None
    """Warm-up as this fraction of the decay span (--lr-decay-iters / --lr-decay-samples), in
    [0, 1); instead of --lr-warmup-iters / --lr-warmup-samples."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps from 0 to --lr."""
    lr_warmup_samples: int = 0
    """Linear warm-up samples from 0 to --lr (with --train-samples)."""
    lr_decay_iters: int | None = None
    """Steps over which the rate decays to --min-lr, warm-up included; --train-iters if unset."""
    lr_decay_samples: int | None = None
    """Samples over which the rate decays to --min-lr, warm-up included (with --train-samples);
    --train-samples if unset."""
    lr_wsd_decay_iters: int | None = None
    """Steps of WSD's anneal, at the end of the decay span."""
    lr_wsd_decay_samples: int | None = None
    """Samples of WSD's anneal, at the end of the decay span (with --train-samples)."""
    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding and output layer weights, on the same schedule
    (megatron-core's decoupled LR)."""
    decoupled_min_lr: float | None = None
    """Learning rate at the end of the decay for the embedding and output layer (needs
    --decoupled-lr; --min-lr if unset)."""
    weight_decay: float = 0.01
    """AdamW weight decay (not on biases and norms)."""
    start_weight_decay: float | None = None
    """Weight decay at the start of training (--weight-decay-incr-style linear / cosine)."""
    end_weight_decay: float | None = None
    """Weight decay at the end of training (--weight-decay-incr-style linear / cosine)."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How the weight decay grows from --start-weight-decay to --end-weight-decay over the
    training span (constant: --weight-decay throughout)."""
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
    loss_scale: float | None = None
    """--fp16: a fixed loss scale (a power of 2); dynamic loss scaling if unset."""
    initial_loss_scale: float = 2.0**32
    """--fp16, dynamic scaling: the first loss scale."""
    min_loss_scale: float = 1.0
    """--fp16, dynamic scaling: the scale never drops below this."""
    loss_scale_window: float = 1000
    """--fp16, dynamic scaling: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """--fp16, dynamic scaling: overflowing steps tolerated before the scale halves."""
    use_distributed_optimizer: bool = field(default=False, metadata={"negatable": True})
    """Shard optimizer state over DP ranks (megatron's distributed optimizer, CUDA; not applicable
    on CPU, where the run goes on with the plain optimizer, the same numbers)."""
    iters_from_samples: bool = field(default=False, metadata={"cli": False})
    """``train_iters`` was derived from --train-samples (:meth:`with_derived_iters`), not given."""
    seq_length_for_schedule: int = field(default=1, metadata={"cli": False})
    """--seq-length, which turns --step-batch-size-schedule's token thresholds into samples."""

    def check(self) -> None:
        """The flags as given (and a config whose ``train_iters`` :meth:`with_derived_iters`
        filled in)."""
        _at_least(self.micro_batch_size, 1, "--micro-batch-size")
        _at_least(self.global_batch_size, 1, "--global-batch-size")
        self._check_training_length()
        self._check_rampup()
        self._check_step_schedule()
        self._check_optimizer()
        self._check_loss_scale()
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 are exclusive; choose one")
        cuda = torch.cuda.is_available()
        if (self.bf16 or self.fp16) and not cuda:
            raise UsageError(
                "--bf16 / --fp16 need CUDA (megatron's mixed-precision optimizer); drop the flag"
            )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise UsageError(
                f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={self.lr} min-lr={self.min_lr}"
            )
        self._check_lr_schedule()
        self._check_weight_decay_schedule()
        self._check_decoupled_lr()
        if self.clip_grad < 0:
            raise UsageError(
                f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}"
            )
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32) (numpy's range), got {self.seed}")

    def _check_loss_scale(self) -> None:
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise UsageError(f"--loss-scale must be positive, got {self.loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise UsageError(
                f"need 0 < --min-loss-scale <= --initial-loss-scale, got {self.min_loss_scale} "
                f"and {self.initial_loss_scale}"
            )
        _at_least(self.hysteresis, 1, "--hysteresis")
        if not self.loss_scale_window >= 1:
            raise UsageError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")

    def _check_optimizer(self) -> None:
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= value < 1.0:
                raise UsageError(f"{flag} must be in [0, 1), got {value}")
        if not self.adam_eps > 0:
            raise UsageError(f"--adam-eps must be positive, got {self.adam_eps}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")

    @property
    def sample_based(self) -> bool:
        """Training length and LR / weight-decay spans counted in samples (--train-samples)."""
        return self.train_samples is not None

    def _check_training_length(self) -> None:
        """Exactly one of --train-iters / --train-samples, and no flag that counts the other
        unit (Megatron-LM asserts the same)."""
        iters_given = self.train_iters is not None and not self.iters_from_samples
        if iters_given == self.sample_based:
            raise UsageError(
                "give exactly one of --train-iters (optimizer steps) or --train-samples "
                "(samples to train on)"
            )
        _at_least(self.train_iters, 1, "--train-iters")
        _at_least(self.train_samples, 1, "--train-samples")
        if self.sample_based:
            mixed = {
                "--lr-warmup-iters": self.lr_warmup_iters != 0,
                "--lr-decay-iters": self.lr_decay_iters is not None,
                "--lr-wsd-decay-iters": self.lr_wsd_decay_iters is not None,
            }
            counted, wanted = "optimizer steps", "with --train-samples give the -samples flags"
        else:
            mixed = {
                "--lr-warmup-samples": self.lr_warmup_samples != 0,
                "--lr-decay-samples": self.lr_decay_samples is not None,
                "--lr-wsd-decay-samples": self.lr_wsd_decay_samples is not None,
                "--rampup-batch-size": self.rampup_batch_size is not None,
                "--step-batch-size-schedule": self.step_batch_size_schedule is not None,
            }
            counted, wanted = "samples", "they need --train-samples instead of --train-iters"
        given = [flag for flag, present in mixed.items() if present]
        if given:
            raise UsageError(f"{', '.join(given)} count {counted}: {wanted}")
        gbs = self.global_batch_size
        ramp = self.rampup_batch_size
        if self.sample_based and ramp is None and gbs and self.train_samples < gbs:
            raise UsageError(
                f"--train-samples {self.train_samples} is less than one global batch ({gbs}): "
                "no optimizer step would run"
            )

    @property
    def step_schedule(self) -> tuple[tuple[int, int], ...] | None:
        """--step-batch-size-schedule as (tokens, global batch) pairs."""
        if self.step_batch_size_schedule is None:
            return None
        try:
            return parse_step_schedule(self.step_batch_size_schedule)
        except ValueError as err:
            raise UsageError(f"--step-batch-size-schedule: {err}") from None

    def _check_step_schedule(self) -> None:
        schedule = self.step_schedule
        if schedule is None:
            return
        if self.rampup_batch_size is not None:
            raise UsageError(
                "--step-batch-size-schedule and --rampup-batch-size both set the batch of each "
                "step; give one"
            )
        largest = max(batch for _, batch in schedule)
        if self.global_batch_size is not None and self.global_batch_size != largest:
            raise UsageError(
                f"--global-batch-size {self.global_batch_size} differs from the largest batch "
                f"of --step-batch-size-schedule ({largest}); drop --global-batch-size"
            )

    def _check_rampup(self) -> None:
        """Megatron-LM's ramp-up rules; divisibility by micro-batch × DP is the run's
        (:meth:`RunConfig._check_batch`)."""
        ramp = self.rampup_batch_size
        if ramp is None:
            return
        if len(ramp) != 3 or min(ramp) < 1:
            raise UsageError(
                "--rampup-batch-size takes three positive numbers, START INCR SAMPLES, got "
                f"{' '.join(map(str, ramp)) or 'none'}"
            )
        start, incr, _ = ramp
        gbs = self.global_batch_size
        if gbs is not None and (start >= gbs or (gbs - start) % incr):
            raise UsageError(
                f"--rampup-batch-size must climb from START {start} to --global-batch-size {gbs} "
                f"in whole steps of INCR {incr}: START below it and {gbs} - {start} a multiple "
                f"of {incr}"
            )

    def _check_lr_schedule(self) -> None:
        unit = "samples" if self.sample_based else "iters"
        warmup = self.lr_warmup_samples if self.sample_based else self.lr_warmup_iters
        decay = self.lr_decay_samples if self.sample_based else self.lr_decay_iters
        length = self.train_samples if self.sample_based else self.train_iters
        if warmup < 0 or warmup > length:
            raise UsageError(f"--lr-warmup-{unit} {warmup} must be in [0, --train-{unit}]")
        if decay is not None and decay <= warmup:
            raise UsageError(
                f"--lr-decay-{unit} {decay} must be larger than --lr-warmup-{unit} {warmup} "
                "(the decay starts after the warm-up)"
            )
        if self.lr_warmup_fraction is not None:
            if warmup:
                raise UsageError(
                    f"--lr-warmup-fraction and --lr-warmup-{unit} are exclusive; give one"
                )
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise UsageError(
                    "--lr-warmup-fraction must be in [0, 1) (a share of the decay span), got "
                    f"{self.lr_warmup_fraction}"
                )
        anneal = self.lr_wsd_decay_samples if self.sample_based else self.lr_wsd_decay_iters
        if self.lr_decay_style != "WSD":
            if anneal is not None or self.lr_wsd_decay_style != "exponential":
                raise UsageError(
                    "--lr-wsd-decay-style / --lr-wsd-decay-iters / --lr-wsd-decay-samples apply "
                    "only with --lr-decay-style WSD"
                )
        elif anneal is None or anneal < 0:
            raise UsageError(
                f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} >= 0, the length of its "
                f"anneal to --min-lr (got {anneal})"
            )

    def _check_weight_decay_schedule(self) -> None:
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            if ends != (None, None):
                raise UsageError(
                    "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style "
                    "linear or cosine (the constant style uses --weight-decay)"
                )
            return
        start, end = ends
        if start is None or end is None:
            raise UsageError(
                f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                "--start-weight-decay and --end-weight-decay"
            )
        if not 0 <= start <= end:
            raise UsageError(
                "need 0 <= --start-weight-decay <= --end-weight-decay (megatron-core's schedule "
                f"only increases it), got {start} and {end}"
            )

    def _check_decoupled_lr(self) -> None:
        if self.decoupled_lr is None:
            if self.decoupled_min_lr is not None:
                raise UsageError("--decoupled-min-lr applies only with --decoupled-lr; add it")
            return
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if not 0 <= low <= self.decoupled_lr:
            raise UsageError(
                "need 0 <= --decoupled-min-lr <= --decoupled-lr (--decoupled-min-lr defaults to "
                f"--min-lr), got decoupled-lr={self.decoupled_lr} decoupled-min-lr={low}"
            )

    @property
    def weight_decay_span(self) -> tuple[float, float]:
        """(start, end) of the weight-decay schedule: --weight-decay twice when constant."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        return self.start_weight_decay, self.end_weight_decay

    def with_derived_iters(self) -> TrainConfig:
        """This config with ``train_iters`` derived from --train-samples
        (:func:`sample_based_steps`); an iteration-based one unchanged. Call it after
        :meth:`check`."""
        if not self.sample_based or self.iters_from_samples:
            return self
        steps, _ = self._sample_based_steps()
        return dataclasses.replace(self, train_iters=steps, iters_from_samples=True)

    @property
    def total_train_samples(self) -> int:
        """Training samples the data must supply: --train-iters × the global batch, or
        --train-samples and at least what the derived steps consume (a ramp-up's last step may
        pass it)."""
        if not self.sample_based:
            return self.train_iters * self.global_batch_size
        return max(self.train_samples, self._sample_based_steps()[1])

    def _sample_based_steps(self) -> tuple[int, int]:
        return sample_based_steps(
            train_samples=self.train_samples,
            global_batch_size=self.global_batch_size,
            rampup_batch_size=self.rampup_batch_size,
            step_schedule=self.step_schedule,
            seq_length=self.seq_length_for_schedule,
        )

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
    """Tokenizer; nothing is downloaded. Unset with --vocab-file and --merge-file given:
    GPT2BPETokenizer (what Megatron-LM's GPT-3 scripts mean by those two files)."""
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
    num_workers: int = 2
    """Data loader processes per rank that read and collate fixed-length samples ahead of the
    step (Megatron-LM's default, 2); 0 reads them in the training process. Same batches either
    way. Whole documents (--variable-seq-lengths) are packed in the training process."""
    mmap_bin_files: bool = True
    """Memory-map the datasets' .bin files; --no-mmap-bin-files reads each sample with a plain file
    read instead (file systems where mmap is slow)."""
    create_attention_mask_in_dataloader: bool = False
    """Build Megatron-LM's [b, 1, s, s] causal mask in the data loader and hand it to the model
    (Megatron-LM's default). Off here: the core attentions mask causally by themselves, so the
    results are the same, and the mask costs s² bytes per sample (1 TiB at 1M tokens); Megatron-LM's
    --no-create-attention-mask-in-dataloader is therefore this trainer's behaviour."""

    def check(self) -> None:
        """Flags, then the files they name: a missing dataset or tokenizer fails here."""
        _at_least(self.seq_length, 1, "--seq-length")
        _at_least(self.num_workers, 0, "--num-workers")
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
    log_throughput: bool = False
    """Show TFLOP/s per device and MFU in the console line (the metrics file, TensorBoard and W&B
    always get them)."""
    log_params_norm: bool = False
    """Log the L2 norm of all weights after each step as params_norm (every weight counted once
    over the TP / PP ranks; an all-reduce per step, as Megatron-LM)."""
    log_num_zeros_in_grad: bool = False
    """Log the zero elements of each step's reduced gradient as num_zeros_in_grad (every weight
    counted once over the TP / PP ranks)."""
    wandb_project: str | None = None
    """Also send every record of the metrics file to this Weights & Biases project (rank 0; needs
    pip install wandb; WANDB_MODE=offline writes the run locally)."""
    wandb_exp_name: str | None = None
    """Name of the W&B run; required with --wandb-project, as in Megatron-LM."""
    wandb_save_dir: str | None = None
    """Where W&B keeps its local files (default: --save/wandb, else ./wandb)."""
    wandb_entity: str | None = None
    """W&B team or user the run belongs to (default: the login's)."""

    def check(self) -> None:
        _at_least(self.log_interval, 1, "--log-interval")
        self._check_wandb()
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

    def _check_wandb(self) -> None:
        """W&B is on when --wandb-project is given and not empty (Megatron-LM's '' means off)."""
        if not self.wandb_project:
            return
        if not self.wandb_exp_name:
            raise UsageError("--wandb-project needs --wandb-exp-name NAME, the name of the run")
        if not _installed("wandb"):
            raise UsageError("--wandb-project needs the wandb package: pip install wandb")
        if self.wandb_save_dir:
            check_writable_directory(self.wandb_save_dir, flag="--wandb-save-dir")


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
class CleanupConfig:
    """When the trainer hands cached device memory back and collects Python garbage."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Return the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 0 never, 1 after
    each step's forward / backward passes and each validation batch, 2 also after the optimizer
    step. Less fragmentation, slower steps; nothing to free on CPU."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collector off while training and collect at fixed points
    instead (every --manual-gc-interval steps, around evaluations), so no rank stalls the others
    at a random step."""
    manual_gc_interval: int = 0
    """With --manual-gc, collect every N steps (0: never between steps)."""
    manual_gc_eval: bool = True
    """With --manual-gc, collect before each evaluation and the evaluation's garbage after it;
    --no-manual-gc-eval skips both."""

    def check(self) -> None:
        _at_least(self.manual_gc_interval, 0, "--manual-gc-interval")
        if not self.manual_gc and (self.manual_gc_interval or not self.manual_gc_eval):
            raise UsageError(
                "--manual-gc-interval / --no-manual-gc-eval apply with --manual-gc; add --manual-gc"
            )


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """Profiling a window of training steps on some ranks."""

    FLAG_PREFIX: ClassVar[str] = "profile"

    enabled: bool = field(default=False, metadata={"flag": "--profile"})
    """Profile iterations --profile-step-start to --profile-step-end − 1 on the --profile-ranks:
    a torch.profiler trace (Chrome trace JSON for Perfetto or TensorBoard) in --tensorboard-dir,
    else ./profile, with --use-pytorch-profiler or on CPU; on CUDA without it, an nsys capture
    range (run under nsys profile --capture-range=cudaProfilerApi)."""
    step_start: int = 10
    """First profiled iteration; the one before it warms the profiler up."""
    step_end: int = 12
    """Profiling stops before this iteration."""
    ranks: tuple[int, ...] = (0,)
    """Global ranks that profile."""
    use_pytorch_profiler: bool = field(default=False, metadata={"flag": "--use-pytorch-profiler"})
    """Profile with torch.profiler instead of an nsys range (always so on CPU)."""

    @property
    def first_iteration(self) -> int:
        """The first profiled iteration (iterations count from 1)."""
        return max(self.step_start, 1)

    def check(self, *, train_iters: int | None, world_size: int) -> None:
        if not self.enabled:
            given = [
                flag_name(f, prefix=self.FLAG_PREFIX)
                for f in dataclasses.fields(self)
                if f.name != "enabled" and getattr(self, f.name) != f.default
            ]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise UsageError(f"{', '.join(given)} only {verb} with --profile; add --profile")
            return
        _at_least(self.step_start, 0, "--profile-step-start")
        if self.step_end <= self.first_iteration:
            raise UsageError(
                f"--profile-step-end {self.step_end} must be larger than --profile-step-start "
                f"{self.step_start} (and than 1): iterations [start, end) are profiled"
            )
        if train_iters is not None and self.first_iteration > train_iters:
            raise UsageError(
                f"--profile-step-start {self.step_start} is past --train-iters {train_iters}: "
                "nothing would be profiled"
            )
        outside = [r for r in self.ranks if not 0 <= r < world_size]
        if not self.ranks or outside:
            raise UsageError(
                f"--profile-ranks must name ranks in [0, {world_size}), got "
                f"{' '.join(map(str, self.ranks)) or 'none'}"
            )


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
        same = self.save and os.path.abspath(self.load or "") == os.path.abspath(self.save)
        if self.load and not os.path.isdir(self.load) and not same:
            # --load DIR --save DIR on a first run (Megatron-LM scripts' pattern) starts fresh
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
    calibration: str | None = field(default=None, metadata={"metavar": "FILE"})
    """Estimator calibration (memo-calibration/1 JSON, written by python -m tools.compare_methods
    --calibrate): the measured matmul / attention efficiencies and host-link bandwidth replace the
    estimator's assumptions in the preflight and in HotSPa's auto layouts."""
    memory_limit_gb: float | None = None
    """Cap this process's memory so that a run too big for a smaller device fails here with out
    of memory (exit status 3): on CUDA the device memory torch may use, in GiB (the preflight
    checks against it too); on CPU how far the process's data segment may grow after start-up
    (RLIMIT_DATA). Not with --memo-allocator plan on CUDA."""

    def check(self) -> None:
        """Refuse a non-positive limit and an unreadable or malformed calibration file."""
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise UsageError(f"--memory-limit-gb must be positive, got {self.memory_limit_gb}")
        if self.calibration is not None:
            read_calibration(self.calibration)


# ---------------------------------------------------------------------------------------------
# MEMO and HotSPa
# ---------------------------------------------------------------------------------------------


def _value_or_auto(text: str, convert, *, auto, expected: str):
    """``auto`` as ``auto``, anything else through ``convert``; argparse's error otherwise."""
    if text == AUTO:
        return auto
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected} or 'auto', got {text!r}") from None


def parse_alpha(text: str) -> float | None:
    """``--memo-alpha``: a number, or ``auto`` (``None``: solved at the first layer)."""
    return _value_or_auto(text, float, auto=None, expected="a number in [0, 1]")


def parse_chunk_tokens(text: str) -> int | str:
    """``--memo-chunk-tokens``: a token count, or ``auto`` (settled by ``resolve_run``)."""
    return _value_or_auto(text, int, auto=AUTO, expected="a positive token count")


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
    keep_last_layers: int | None = None
    """Layers at the end of each pipeline stage that keep their activations on the device: their
    backward starts right after their forward, so a round trip to the host would not pay.
    Default: 2; 0 with --memo-chunk-tokens (a kept layer holds its whole saved set on the device,
    which chunking otherwise keeps off it)."""
    chunk_tokens: int | Literal["auto"] | None = field(
        default=None, metadata={"parse": parse_chunk_tokens}
    )
    """Run each layer's token-local work (norms, QKV and output projections, MLP, residual adds)
    over sub-sequence chunks of this many local tokens (after SP / CP sharding), the core
    attention still over the whole sequence; MEMO then offloads or drops saved tensors chunk by
    chunk, so a layer's device memory beyond attention's inputs and output is a few chunks, not
    the sequence. 'auto': the smallest chunk whose matrix products and collectives the estimator
    puts within 2% of the whole sequence's time on this run's device. Default: off."""
    allocator: Literal["off", "plan"] = "off"
    """plan: serve each offloaded layer's forward / backward transients at the offsets the memory
    planner computed for its recorded request sequence, inside one arena (no fragmentation); off:
    the default allocator."""
    plan_cache: str | None = None
    """Directory of cached pass plans (by digest of the request sequence and the run's shapes).
    Default: $XDG_CACHE_HOME/memo_ext/plans (~/.cache/memo_ext/plans)."""
    plan_time_limit: float = 30.0
    """Seconds the planner may spend on one pass sequence."""

    @property
    def plan_cache_dir(self) -> str:
        """Where pass plans are cached."""
        if self.plan_cache:
            return self.plan_cache
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "memo_ext", "plans")

    @property
    def kept_layers(self) -> int:
        """``keep_last_layers``, its default settled (see the field)."""
        if self.keep_last_layers is not None:
            return self.keep_last_layers
        return 0 if self.chunk_tokens is not None else 2

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
        if self.keep_last_layers is not None and self.keep_last_layers < 0:
            raise UsageError(f"--memo-keep-last-layers must be >= 0, got {self.keep_last_layers}")
        if self.plan_time_limit <= 0:
            raise UsageError(f"--memo-plan-time-limit must be positive, got {self.plan_time_limit}")
        if isinstance(self.chunk_tokens, int) and self.chunk_tokens < 1:
            raise UsageError(f"--memo-chunk-tokens must be >= 1 or 'auto', got {self.chunk_tokens}")

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
                "--memo cannot run with megatron-core's own activation offloading "
                "(--cpu-offloading-num-layers, --fine-grained-activation-offloading); drop one"
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
    with TP > 1), optionally with the recomputation of that layout's model after a colon
    ('dp4:none;tp8:full'; default: --recompute-granularity; a layout that runs on the home model
    keeps home's). 'auto' picks, per bucket, the fastest layout and recomputation that fit
    device memory by the estimator's model, for --preflight-device (default: the CUDA device,
    or h100-80g on a machine without one); it trains one layout for every bucket when switching
    is not predicted to pay."""
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
    recompute: tuple[str | None, ...] | None = field(default=None, metadata={"cli": False})
    """Per bucket, the recomputation of its layout's model where it is not the run's
    --recompute-granularity (``none``, ``selective`` or ``full``; ``None``: the run's); from a
    ``:method`` suffix of --hotspa-strategies, or chosen by ``auto``."""
    predicted_step_s: float | None = field(default=None, metadata={"cli": False})
    """The estimator's step time for these layouts (once resolved against a device)."""
    predicted_single_layout_s: float | None = field(default=None, metadata={"cli": False})
    """The estimator's step time with every document packed into --seq-length rows in the best
    single layout: what HotSPa is compared with (``auto`` takes it when switching does not
    pay, and then runs one bucket)."""

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
        spec, recompute = split_recompute(self.strategy_spec)
        try:
            layouts = parse_strategies(spec, world_size)
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
        return dataclasses.replace(
            self,
            buckets=buckets,
            strategies=layouts,
            recompute=recompute if any(recompute) else None,
        )


RECOMPUTE_CHOICES = ("none", "selective", "full")
"""What a ``:method`` suffix of --hotspa-strategies may say."""


def split_recompute(spec: str) -> tuple[str, tuple[str | None, ...]]:
    """``"dp4:none;tp8"`` → (``"dp4;tp8"``, (``"none"``, ``None``)).

    Raises:
        UsageError: for a suffix that is not a recomputation.
    """
    layouts, methods = [], []
    for part in spec.split(";"):
        layout, colon, method = part.partition(":")
        method = method.strip().lower()
        if colon and method not in RECOMPUTE_CHOICES:
            raise UsageError(
                f"--hotspa-strategies: {part.strip()!r} ends in {method!r}; after a colon comes "
                f"the layout's recomputation, one of {', '.join(RECOMPUTE_CHOICES)}"
            )
        layouts.append(layout)
        methods.append(method if colon else None)
    return ";".join(layouts), tuple(methods)


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

    @property
    def fused_cross_entropy(self) -> bool:
        """--cross-entropy-loss-fusion where megatron-core's fused loss runs: on CUDA, and not
        under HotSPa (its bucket models take explicit process groups, the fused loss does not)."""
        fusion = self.model.cross_entropy_loss_fusion
        return fusion and torch.cuda.is_available() and not self.hotspa.enabled

    @property
    def profile_dir(self) -> str:
        """Where --profile writes torch.profiler traces: --tensorboard-dir (TensorBoard's profiler
        plugin reads them there, as Megatron-LM writes them), else ./profile."""
        return self.logging.tensorboard_dir or "profile"

    def transformer_config(
        self, layout: ParallelLayout | None = None, *, recompute: str | None = None
    ) -> TransformerConfig:
        """A fresh megatron-core config of this run's model in ``layout`` (default: the run's),
        with ``recompute`` (``none``, ``selective``, ``full``: every layer) in place of the run's
        recomputation when given (HotSPa's per-layout choice)."""
        m, r, t, o = self.model, self.recompute, self.train, self.offload
        if recompute is not None:
            r = RecomputeConfig(
                granularity=None if recompute == "none" else recompute,
                method="uniform" if recompute == "full" else None,
                num_layers=1 if recompute == "full" else None,
            )
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
            cpu_offloading=o.layer_offloading,
            cpu_offloading_num_layers=o.cpu_offloading_num_layers,
            fine_grained_activation_offloading=o.fine_grained_activation_offloading,
            offload_modules=list(o.offload_modules),
            min_offloaded_tensor_size=o.min_offloaded_tensor_size,
            bf16=t.bf16,
            fp16=t.fp16,
            params_dtype=t.params_dtype,
            pipeline_dtype=t.params_dtype,
            # the loss is a mean over every real token of the global batch, however it is split
            calculate_per_token_loss=True,
            layernorm_zero_centered_gamma=m.apply_layernorm_1p,
            cross_entropy_loss_fusion=self.fused_cross_entropy,
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
        self.offload.check(num_layers=self.shape.num_layers)
        self.logging.check()
        self.distributed.check(distributed_optimizer=self.train.use_distributed_optimizer)
        self.cleanup.check()
        self.profile.check(train_iters=self.train.train_iters, world_size=self.world_size)
        if self.profile.enabled:
            check_writable_directory(self.profile_dir, flag="--profile: trace folder")
        self.memo.check()
        if self.memo.enabled:
            self._check_memo()
        self.evaluation.check()
        self._check_evaluation_split()
        self.checkpoint.check()
        self.preflight.check()
        self._check_variable_lengths()
        self.hotspa.check()
        self._check_hotspa()
        self._check_megatron_offload()

    def _check_memo(self) -> None:
        self.memo.check_combination(
            hidden_dropout=self.model.hidden_dropout,
            recompute_granularity=self.recompute.granularity,
            attention_backend=self.model.attention_backend,
            cpu_offloading=self.offload.layer_offloading,
            fine_grained_activation_offloading=self.offload.fine_grained_activation_offloading,
        )
        if self.memo.allocator == "plan":
            self._check_planned_allocator()
        if self.memo.chunk_tokens is not None and self.data.variable_seq_lengths:
            raise UsageError(
                "--memo-chunk-tokens cannot chunk packed documents (--variable-seq-lengths, "
                "--hotspa): RoPE positions restart per document; drop one of them"
            )
        stage_layers = self.shape.num_layers // self.layout.pp
        if self.memo.kept_layers >= stage_layers:
            raise UsageError(
                f"--memo would offload no layer: each pipeline stage has {stage_layers} layers and "
                f"--memo-keep-last-layers {self.memo.kept_layers} keeps them all on the "
                "device; lower --memo-keep-last-layers or drop --memo"
            )

    def _check_planned_allocator(self) -> None:
        """What cannot run under a process-wide plan-serving allocator, one sentence each."""
        if self.data.variable_seq_lengths:
            raise UsageError(
                "--memo-allocator plan serves one recorded request sequence per layer pass, and "
                "packed documents (--variable-seq-lengths, --hotspa) change it every step; drop "
                "one of them"
            )
        if torch.cuda.is_available() and "expandable_segments" in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", ""
        ):
            raise UsageError(
                "--memo-allocator plan replaces PyTorch's caching allocator, so "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments cannot apply; unset it"
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
        schedule = self.train.step_schedule or ()
        uneven = [batch for _, batch in schedule if batch % (mbs * dp)]
        if uneven:
            raise UsageError(
                f"--step-batch-size-schedule batch {uneven[0]} is not divisible by "
                f"--micro-batch-size × DP = {mbs}×{dp}"
            )
        ramp = self.train.rampup_batch_size
        if self.data.variable_seq_lengths:  # refused there (_check_variable_lengths)
            ramp = None
        if ramp is not None and (ramp[0] % (mbs * dp) or ramp[1] % (mbs * dp)):
            # every batch of the ramp, START + k × INCR, must split into whole micro-batches
            raise UsageError(
                f"--rampup-batch-size START {ramp[0]} and INCR {ramp[1]} must be multiples of "
                f"--micro-batch-size × DP = {mbs}×{dp}"
            )

    def _check_evaluation_split(self) -> None:
        if not self.evaluation.enabled or self.data.mock_data:
            return
        weights = [float(w) for w in self.data.split.replace("/", ",").split(",") if w.strip()]
        if len(weights) < 2 or weights[1] <= 0:
            raise UsageError(
                f"--eval-interval needs a validation part in --split, got {self.data.split!r}"
            )

    def _check_megatron_offload(self) -> None:
        """megatron-core's offloading with the rest of the run (what megatron-core refuses, what
        this trainer does not run it with), then the machine; --memo is refused in _check_memo."""
        if not self.offload.enabled:
            return
        for given, other, why in self._megatron_offload_conflicts():
            if given:
                raise UsageError(
                    f"{self.offload.flag} does not run with {other} here: {why}; drop one of them"
                )
        self.offload.check_machine()

    def _megatron_offload_conflicts(self) -> list[tuple[bool, str, str]]:
        """(given?, the other flag, why) for each combination the offloading asked for refuses."""
        conflicts = [
            (
                self.recompute.granularity is not None,
                "--recompute-granularity",
                "megatron-core refuses layer-level offloading with recomputation, and the "
                "fine-grained one is run here as a baseline of its own, without it",
            ),
            (self.hotspa.enabled, "--hotspa", "its bucket models are built without it"),
        ]
        if self.offload.layer_offloading:
            no_pp = "megatron-core's layer-level offloading has no pipeline support"
            return conflicts + [(self.layout.pp > 1, "--pipeline-model-parallel-size > 1", no_pp)]
        # fine-grained: megatron-core caches the first training step's micro-batches and walks
        # that cache in every later step (a micro-batch past it is not offloaded), and resets its
        # state only at the end of a training pass of its schedules
        replay = (
            "megatron-core replays the first step's micro-batches, and more would stay on the "
            "device"
        )
        return conflicts + [
            (self.data.variable_seq_lengths, "--variable-seq-lengths", replay),
            (self.train.rampup_batch_size is not None, "--rampup-batch-size", replay),
            (self.train.step_batch_size_schedule is not None, "--step-batch-size-schedule", replay),
            (
                self.evaluation.enabled,
                "--eval-interval",
                "megatron-core resets its offload state only after training passes, so an "
                "evaluation pass would leave it out of step with the next training step",
            ),
        ]

    def _check_variable_lengths(self) -> None:
        """Packed rows run under DP, TP, PP and CP; refuse what they do not support."""
        if not self.data.variable_seq_lengths:
            return
        unsupported = {
            "--micro-batch-size > 1 (a packed row is one micro-batch)": self.train.micro_batch_size
            != 1,
            "--memo": self.memo.enabled,
            "--eval-interval": bool(self.evaluation.eval_interval),
            # rows are packed from global_batch_size documents per step (with HotSPa, split
            # into buckets from them): a growing batch is not wired through either
            "--rampup-batch-size": self.train.rampup_batch_size is not None,
            "--step-batch-size-schedule": self.train.step_batch_size_schedule is not None,
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
        dropout = max(self.model.attention_dropout, self.model.hidden_dropout)
        if dropout > 0:
            raise UsageError(
                "--hotspa layouts share the home layout's dropout random streams, so the TP ranks "
                "of another layout would draw the same masks; use --attention-dropout 0 "
                f"--hidden-dropout 0 (got {dropout})"
            )
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
        hot = self.hotspa.parsed(
            seq_length=self.data.seq_length, world_size=self.world_size, shape=self.shape
        )
        if hot.recompute:
            self._check_hotspa_recompute(hot)

    def _check_hotspa_recompute(self, hot: HotSPaConfig) -> None:
        """``:method`` suffixes: not on buckets that run on the home model."""
        own = self.recompute.granularity or "none"
        home = hot.strategies[-1]
        for layout, method in zip(hot.strategies, hot.recompute):
            on_home = (layout.tp, layout.pp) == (home.tp, home.pp)
            if method is not None and method != own and on_home:
                raise UsageError(
                    f"--hotspa-strategies: {layout.name}:{method} runs on the home model (same TP "
                    f"and PP as home, {home.name}), whose recomputation is "
                    f"--recompute-granularity's ({own}); drop ':{method}' or change the flag"
                )
