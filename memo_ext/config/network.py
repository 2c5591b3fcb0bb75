"""The network beyond its shape, how it is recomputed, and how its processes talk: the model,
recompute and distributed sections."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from memo_ext.config.common import at_least, fraction, importable, installed
from memo_ext.device import on_gpu
from memo_ext.errors import UsageError
from memo_ext.flags import flag_name

ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "te")


def resolve_attention_backend(backend: str, *, allow_te: bool = True) -> str:
    """Turn ``auto`` into a concrete backend and check that the asked one can run here.

    ``auto`` picks transformer-engine on CUDA when installed (unless ``allow_te`` is False, as
    for layers that MEMO rebuilds from their own modules), then flash-attn when it imports,
    else SDPA.

    Raises:
        ValueError: an unknown backend, or one this machine cannot run.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {backend}")
    cuda = on_gpu()
    if backend == "auto":
        if cuda and allow_te and installed("transformer_engine"):
            return "te"
        if cuda and flash_attn_imports():
            return "flash"
        return "sdpa"
    if backend in ("te", "flash"):
        package = "transformer_engine" if backend == "te" else "flash_attn"
        usable = installed(package) if backend == "te" else flash_attn_imports()
        if not cuda or not usable:
            broken = cuda and installed(package)  # found, but its import fails
            why = f" ({package} is installed but does not import)" if broken else ""
            raise ValueError(
                f"--attention-backend {backend} needs CUDA and the {package} package{why}; "
                "use --attention-backend sdpa here"
            )
    return backend


def flash_attn_imports() -> bool:
    """flash-attn imports with the function our flash backend calls (``mcore/attention.py``)."""
    return importable("flash_attn", "flash_attn_func")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """GPT settings beyond the shape: positions, regularisation, initialisation, kernels."""

    max_position_embeddings: int | None = None
    """Position table length; --seq-length if unset."""
    rotary_base: int = 10000
    """RoPE base period."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (megatron-core's): frequencies with wavelengths over
    8192 positions are divided by --rope-scaling-factor, those under 2048 kept, those between
    blended (--position-embedding-type rope)."""
    rope_scaling_factor: float = 8.0
    """Llama 3.1 RoPE scaling factor (with --use-rope-scaling)."""
    rotary_seq_len_interpolation_factor: float | None = None
    """Linear position interpolation: RoPE reads position p as p / this factor (≥ 1), so factor
    × the trained context falls in the positions the model knows (--position-embedding-type
    rope)."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context-extension factor s (--position-embedding-type yarn; 1: plain RoPE): low
    frequencies are divided by s, high ones kept, and q and k scaled by (0.1·--mscale·ln s + 1) /
    (0.1·--mscale-all-dim·ln s + 1)."""
    yarn_original_max_position_embeddings: int = 4096
    """YaRN: the context the model was trained with before extension, in tokens."""
    yarn_beta_fast: float = 32.0
    """YaRN: frequencies turning more than this many times over the original context are kept."""
    yarn_beta_slow: float = 1.0
    """YaRN: frequencies turning fewer than this many times over the original context are divided
    by --rotary-scaling-factor; those between are blended linearly over channels."""
    yarn_correction_range_round_to_int: bool = field(default=True, metadata={"negatable": True})
    """YaRN: round the blended channel range to whole channels (megatron-core's default)."""
    mscale: float = 1.0
    """YaRN attention factor: the numerator's coefficient (see --rotary-scaling-factor)."""
    mscale_all_dim: float = 0.0
    """YaRN attention factor: the denominator's coefficient (see --rotary-scaling-factor)."""
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
    flash on CUDA when installed and importable, else sdpa)."""
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

    YARN_FIELDS: ClassVar[tuple[str, ...]] = (
        "rotary_scaling_factor",
        "yarn_original_max_position_embeddings",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_correction_range_round_to_int",
        "mscale",
        "mscale_all_dim",
    )
    """The settings only ``--position-embedding-type yarn`` reads."""

    def check(self) -> None:
        self._check_rope_values()
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

    def check_positions(self, *, position_embedding_type: str) -> None:
        """Refuse RoPE scaling that the model's position embedding would not read: megatron-core
        silently ignores Llama 3.1 scaling and interpolation under YaRN, YaRN's settings under
        RoPE, and all of them under learned positions."""
        llama, yarn = self._llama_flags_given(), self._yarn_flags_given()
        if position_embedding_type == "learned_absolute" and (llama or yarn):
            raise UsageError(
                f"{(llama + yarn)[0]} needs rotary positions; add --position-embedding-type rope "
                "(or yarn)"
            )
        if position_embedding_type == "rope" and yarn:
            raise UsageError(f"{yarn[0]} is a YaRN setting; add --position-embedding-type yarn")
        if position_embedding_type == "yarn" and llama:
            raise UsageError(
                f"megatron-core's YaRN ignores {llama[0]}; drop it (YaRN scales by "
                "--rotary-scaling-factor)"
            )
        if self.rope_scaling_factor != 8.0 and not self.use_rope_scaling:
            raise UsageError("--rope-scaling-factor needs --use-rope-scaling")

    def _llama_flags_given(self) -> list[str]:
        given = ["--use-rope-scaling"] if self.use_rope_scaling else []
        if self.rotary_seq_len_interpolation_factor is not None:
            given.append("--rotary-seq-len-interpolation-factor")
        return given

    def _yarn_flags_given(self) -> list[str]:
        """YaRN's flags set away from their defaults, as the command line spells them."""
        given = []
        for f in fields(self):
            if f.name in self.YARN_FIELDS and getattr(self, f.name) != f.default:
                name = flag_name(f)
                given.append(name.replace("--", "--no-", 1) if f.default is True else name)
        return given

    def _check_rope_values(self) -> None:
        for flag, value in (
            ("--rope-scaling-factor", self.rope_scaling_factor),
            ("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor),
            ("--rotary-scaling-factor", self.rotary_scaling_factor),
        ):
            if value is not None and not value >= 1:
                raise UsageError(
                    f"{flag} must be at least 1 (how many times the context grows), got {value}"
                )
        at_least(
            self.yarn_original_max_position_embeddings, 1, "--yarn-original-max-position-embeddings"
        )
        if not 0 < self.yarn_beta_slow < self.yarn_beta_fast:
            raise UsageError(
                f"--yarn-beta-slow {self.yarn_beta_slow} must be positive and below "
                f"--yarn-beta-fast {self.yarn_beta_fast}"
            )
        at_least(self.mscale, 0, "--mscale")
        at_least(self.mscale_all_dim, 0, "--mscale-all-dim")


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How the processes of a job talk."""

    FLAG_PREFIX: ClassVar[str] = "distributed"

    timeout_minutes: float = 10.0
    """A collective that waits longer than this (a stalled or dead rank) fails the job instead of
    hanging it (Megatron-LM's default, 10)."""
    overlap_grad_reduce: bool = field(default=False, metadata={"flag": "--overlap-grad-reduce"})
    """Overlap the data-parallel gradient reduction with the backward pass, bucket by bucket
    (megatron-core DDP; with --hotspa, which reduces each layout's gradients itself, the log says
    it does not apply)."""
    overlap_param_gather: bool = field(default=False, metadata={"flag": "--overlap-param-gather"})
    """Overlap the distributed optimizer's parameter all-gather with the next forward pass (needs
    --use-distributed-optimizer and --overlap-grad-reduce)."""
    ddp_bucket_size: int | None = field(default=None, metadata={"flag": "--ddp-bucket-size"})
    """Gradient elements per reduction bucket with --overlap-grad-reduce (megatron-core DDP's
    default if unset: max(40M, 1M × DP)); without overlap the gradients reduce in one bucket."""
    grad_reduce_in_bf16: bool = field(default=False, metadata={"flag": "--grad-reduce-in-bf16"})
    """With --bf16, accumulate and reduce gradients in bf16 instead of fp32: half the DP traffic,
    the optimizer still keeps fp32 master weights (fp32 weights make it a no-op)."""

    def check(self, *, distributed_optimizer: bool = False) -> None:
        """``distributed_optimizer``: --use-distributed-optimizer is on."""
        if not self.timeout_minutes > 0:
            raise UsageError(
                f"--distributed-timeout-minutes must be positive, got {self.timeout_minutes}"
            )
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise UsageError(f"--ddp-bucket-size must be positive, got {self.ddp_bucket_size}")
        if self.overlap_param_gather and not (distributed_optimizer and self.overlap_grad_reduce):
            raise UsageError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
            )
