"""Our own settings, as dataclasses.

megatron-core's ``TransformerConfig`` stays the source of truth for the model shape and the
parallel sizes (TP, PP, CP, SP); the classes here hold only what it does not know: the
vocabulary and positions, the training schedule, the data, logging, and our systems' knobs.
``memo_ext.arguments`` fills them from Megatron-style command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.hotspa.config import HotSPaConfig
from memo_ext.offload.config import MemoConfig


@dataclass
class ModelConfig:
    """GPT model settings that ``TransformerConfig`` does not carry."""

    vocab_size: int = 0
    """Embedding rows after padding (set from the tokenizer and the padding rule)."""
    max_position_embeddings: int = 0
    """Rows of the learned position table; also the RoPE table length."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` or ``rope``."""
    rotary_base: int = 10000
    """RoPE base period."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of sharing the input embedding's."""
    loss_chunks: int = 1
    """Compute the output layer and loss over this many sequence slices, each recomputed in
    backward, so that only one slice's logits exist at a time (1 = megatron's single pass)."""
    attention_backend: str = "auto"
    """Core attention: ``sdpa`` (torch), ``flash`` (flash-attn), ``te`` (transformer-engine), or
    ``auto`` (te, then flash on CUDA when installed, else sdpa)."""


@dataclass
class TrainConfig:
    """Optimisation schedule and batch sizes."""

    micro_batch_size: int = 1
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = 1
    """Sequences per optimizer step over all data-parallel ranks."""
    train_iters: int = 10
    """Optimizer steps to run."""
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: str = "cosine"
    """``constant``, ``linear``, ``cosine`` or ``inverse-square-root`` (megatron's scheduler)."""
    lr_warmup_iters: int = 0
    """Steps of linear warm-up from 0 to ``lr``."""
    lr_decay_iters: int | None = None
    """Steps over which the rate decays to ``min_lr``; ``train_iters`` when unset."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; not applied to biases and norm weights."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seed for weights, dropout and data order."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (megatron's distributed optimizer, CUDA)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop with a pointer to the last good checkpoint when the loss or gradient norm is not
    finite."""
    skip_iterations_with_nan: bool = False
    """Instead of stopping, skip the update of a step with a non-finite loss or gradient."""


@dataclass
class DataConfig:
    """Where tokens come from."""

    seq_length: int = 1024
    """Tokens per sample."""
    data_path: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes, optionally weighted (``0.7 a 0.3 b``), as in Megatron-LM."""
    split: str = "969,30,1"
    """Train / validation / test proportions of each dataset."""
    mock_data: bool = False
    """Synthetic tokens instead of ``data_path``."""
    variable_seq_lengths: bool = False
    """Train on whole documents cut at ``seq_length`` and packed into rows with per-document
    attention boundaries, instead of fixed-length samples; the global batch counts documents."""
    tokenizer_type: str = "ByteTokenizer"
    """``ByteTokenizer`` (UTF-8 bytes) or ``NullTokenizer`` (ids as text; needs ``vocab_size``)."""
    vocab_size: int | None = None
    """Tokenizer vocabulary size where the tokenizer does not fix it (NullTokenizer)."""
    tokenizer_model: str | None = None
    """Local ``tokenizer.json`` (or a directory holding one) for ``HuggingFaceTokenizer``."""
    vocab_file: str | None = None
    """GPT-2 BPE ``vocab.json`` for ``GPT2BPETokenizer``."""
    merge_file: str | None = None
    """GPT-2 BPE ``merges.txt`` for ``GPT2BPETokenizer``."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding table to a multiple of this times the TP size, as Megatron-LM does."""
    data_cache_path: str | None = None
    """Where megatron-core writes dataset index caches; next to the data when unset."""


@dataclass
class LoggingConfig:
    """Console and metrics-file output."""

    log_interval: int = 10
    """Print and record metrics every this many steps."""
    metrics_file: str | None = None
    """JSON Lines file with one object per logged step (rank 0 writes it)."""
    device_peak_tflops: float | None = None
    """Dense peak of one device in TFLOP/s for MFU; looked up from the device name when unset."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (rank 0)."""


@dataclass
class EvaluationConfig:
    """Validation during training."""

    eval_interval: int | None = None
    """Evaluate on the validation split every this many steps; never when unset."""
    eval_iters: int = 10
    """Validation global batches per evaluation."""

    @property
    def enabled(self) -> bool:
        return bool(self.eval_interval) and self.eval_iters > 0


@dataclass
class CheckpointConfig:
    """Saving, resuming and stopping early."""

    save: str | None = None
    """Directory to write checkpoints to."""
    load: str | None = None
    """Directory to resume from (its newest complete checkpoint); empty means start fresh."""
    save_interval: int | None = None
    """Save every this many steps (and at the end of training when ``save`` is set)."""
    exit_interval: int | None = None
    """Save and stop after the step whose number is a multiple of this."""
    exit_duration_in_mins: float | None = None
    """Save and stop once the run has lasted this many minutes."""
    exit_signal_handler: bool = False
    """On SIGTERM / SIGINT, save at the next step boundary on every rank and exit 0."""


@dataclass
class PreflightConfig:
    """The memory check made before the model is built (``memo_ext.estimate.preflight``)."""

    enabled: bool = True
    """Estimate device and host memory first and refuse a run that cannot fit."""
    device: str | None = None
    """Device preset to check against (e.g. ``h100-80g``); the CUDA device's when unset, and
    nothing is checked on a machine without one."""


@dataclass
class RunConfig:
    """Everything one training run needs, as parsed from the command line."""

    transformer: TransformerConfig
    """megatron-core model and parallelism settings."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    memo: MemoConfig = field(default_factory=MemoConfig)
    """MEMO's token-wise activation offloading (off by default)."""
    hotspa: HotSPaConfig = field(default_factory=HotSPaConfig)
    """HotSPa's length buckets and per-bucket layouts (off by default)."""
    world_size: int = 1
    """Processes in the job (from torchrun's ``WORLD_SIZE``)."""

    @property
    def data_parallel_size(self) -> int:
        t = self.transformer
        model_parallel = (
            t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
        )
        return self.world_size // model_parallel

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (
            self.train.micro_batch_size * self.data_parallel_size
        )
