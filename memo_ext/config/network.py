"""The network beyond its shape, how it is recomputed, and how its processes talk: the model,
recompute and distributed sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from memo_ext.config.common import at_least, fraction, installed
from memo_ext.errors import UsageError

ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "te")


def resolve_attention_backend(backend: str, *, allow_te: bool = True) -> str:
    """Turn ``auto`` into a concrete backend and check that the asked one can run here.

    ``auto`` picks transformer-engine on CUDA when installed (unless ``allow_te`` is False, as
    for layers that MEMO rebuilds from their own modules), then flash-attn, else SDPA.

    Raises:
        ValueError: an unknown backend, or one this machine cannot run.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {backend}")
    cuda = torch.cuda.is_available()
    if backend == "auto":
        if cuda and allow_te and installed("transformer_engine"):
            return "te"
        if cuda and installed("flash_attn"):
            return "flash"
        return "sdpa"
    if backend in ("te", "flash"):
        package = "transformer_engine" if backend == "te" else "flash_attn"
        if not cuda or not installed(package):
            raise ValueError(
                f"--attention-backend {backend} needs CUDA and the {package} package; "
                "use --attention-backend sdpa here"
            )
    return backend


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
        at_least(self.max_position_embeddings, 1, "--max-position-embeddings")
        fraction(self.attention_dropout, "--attention-dropout")
        fraction(self.hidden_dropout, "--hidden-dropout")
        at_least(self.make_vocab_size_divisible_by, 1, "--make-vocab-size-divisible-by")
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
