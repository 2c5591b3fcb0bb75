"""Megatron-style command-line flags → ``RunConfig``.

Flag names follow Megatron-LM wherever Megatron has the concept, so launch scripts carry over.
Every check runs here, before any process group, model or dataset exists, and fails with one
sentence that says what is wrong and how to fix it (:class:`ArgumentError`).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from memo_ext.config import (
    CheckpointConfig,
    DataConfig,
    EvaluationConfig,
    LoggingConfig,
    ModelConfig,
    PreflightConfig,
    RunConfig,
    TrainConfig,
)
from memo_ext.hotspa.config import (
    HotSPaArgumentError,
    add_hotspa_args,
    hotspa_config_from_args,
    validate_hotspa_args,
)
from memo_ext.mcore.specs import ATTENTION_BACKENDS, LOCAL_KERNEL_SETTINGS
from memo_ext.offload.config import (
    MemoArgumentError,
    add_memo_args,
    memo_config_from_args,
    validate_memo_args,
)

logger = logging.getLogger(__name__)

TOKENIZERS = ("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer")
BYTE_VOCAB_SIZE = 257  # 256 byte values + end-of-document


class ArgumentError(ValueError):
    """A flag value or combination that cannot run; the message says how to fix it."""


def build_parser() -> argparse.ArgumentParser:
    """The full flag set of ``pretrain_gpt_memo.py``."""
    parser = argparse.ArgumentParser(
        description="GPT pretraining on megatron-core with MEMO and HotSPa.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_training_args(parser)
    _add_parallel_args(parser)
    _add_recompute_args(parser)
    _add_data_args(parser)
    _add_logging_args(parser)
    add_memo_args(parser)
    add_hotspa_args(parser)
    _add_evaluation_args(parser)
    _add_checkpoint_args(parser)
    _add_preflight_args(parser)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, required=True, help="Model width h.")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width; 4h if unset.")
    g.add_argument("--num-attention-heads", type=int, required=True, help="Query heads.")
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="Key/value heads (GQA); = heads if unset.",
    )
    g.add_argument("--kv-channels", type=int, default=None, help="Head dim; h / heads if unset.")
    g.add_argument("--seq-length", type=int, required=True, help="Tokens per sample.")
    g.add_argument(
        "--max-position-embeddings", type=int, default=None, help="Position table length."
    )
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="Learned absolute positions or rotary embeddings.",
    )
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period.")
    g.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        default="LayerNorm",
        help="Norm of each layer and the final norm.",
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Norm epsilon.")
    g.add_argument("--swiglu", action="store_true", help="Gated SiLU MLP instead of GeLU.")
    g.add_argument("--disable-bias-linear", action="store_true", help="No biases in linears.")
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="Dropout on attention probabilities (Megatron-LM defaults to 0.1).",
    )
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.0,
        help="Dropout on each residual branch's output (Megatron-LM defaults to 0.1; "
        "long-context recipes and MEMO use 0).",
    )
    g.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Std of the normal weight init (output projections: / sqrt(2·layers)).",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Give the output layer its own weights.",
    )
    g.add_argument(
        "--loss-chunks",
        type=int,
        default=1,
        help="Run the output layer and loss over this many sequence slices, recomputed in "
        "backward: only one slice's logits live at a time (1 = one pass, as megatron).",
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="Core attention: sdpa (torch), flash (flash-attn), te (transformer-engine), "
        "auto (te, then flash on CUDA when installed, else sdpa).",
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        required=True,
        help="Sequences per forward/backward pass on each DP rank.",
    )
    g.add_argument("--global-batch-size", type=int, default=None, help="mbs × DP if unset.")
    g.add_argument("--train-iters", type=int, required=True, help="Optimizer steps.")
    g.add_argument("--lr", type=float, required=True, help="Peak learning rate.")
    g.add_argument(
        "--min-lr", type=float, default=0.0, help="Learning rate at the end of the decay."
    )
    g.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine", "inverse-square-root"),
        default="linear",
        help="LR decay after warm-up (megatron-core's scheduler).",
    )
    g.add_argument(
        "--lr-warmup-iters", type=int, default=0, help="Linear warm-up steps from 0 to --lr."
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="train-iters if unset.")
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="AdamW weight decay (not on biases and norms).",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global-norm clip; 0 = off.")
    g.add_argument(
        "--seed", type=int, default=1234, help="Seed for weights, dropout and data order."
    )
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Stop, pointing at the last good checkpoint, on a non-finite loss or grad norm.",
    )
    g.add_argument(
        "--skip-iterations-with-nan",
        action="store_true",
        help="Skip the update of a step with a non-finite loss or grad norm instead of stopping.",
    )
    g.add_argument("--bf16", action="store_true", help="bf16 weights and activations (CUDA).")
    g.add_argument("--fp16", action="store_true", help="fp16 with loss scaling (CUDA).")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="TP: shard attention heads and MLP width over this many processes.",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="SP: shard norms and dropout over TP ranks along the sequence.",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="PP: split the layers into this many stages (1F1B schedule).",
    )
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="CP: split each sequence into 2·CP load-balanced chunks over this many processes.",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state over DP ranks (CUDA).",
    )


def _add_recompute_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation recomputation (Megatron baselines)")
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="Megatron recomputation: full layers, or selective (core attention).",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="Which layers full recomputation covers.",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="Layers per recompute unit (uniform) or recomputed layers per stage (block).",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument(
        "--data-path", nargs="*", default=[], help="Dataset prefixes, optionally weighted."
    )
    g.add_argument("--split", default="969,30,1", help="Train,valid,test proportions.")
    g.add_argument("--mock-data", action="store_true", help="Synthetic tokens.")
    g.add_argument(
        "--variable-seq-lengths",
        action="store_true",
        help="Whole documents (cut at --seq-length) packed into rows with per-document "
        "attention; --global-batch-size then counts documents.",
    )
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZERS,
        default="ByteTokenizer",
        help="Tokenizer; nothing is downloaded.",
    )
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary.")
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="Local tokenizer.json, or a directory holding one (HuggingFaceTokenizer).",
    )
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (GPT2BPETokenizer).")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt (GPT2BPETokenizer).")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding table to a multiple of lcm(this, TP).",
    )
    g.add_argument(
        "--data-cache-path",
        default=None,
        help="Where dataset index caches go (default: beside the data).",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="Log every this many steps (and the first and last).",
    )
    g.add_argument("--metrics-file", default=None, help="JSON Lines metrics (rank 0).")
    g.add_argument(
        "--device-peak-tflops", type=float, default=None, help="Device dense peak for MFU."
    )
    g.add_argument(
        "--tensorboard-dir", default=None, help="Write TensorBoard scalars here (rank 0)."
    )


def _add_evaluation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument(
        "--eval-interval", type=int, default=None, help="Evaluate every N steps (never if unset)."
    )
    g.add_argument(
        "--eval-iters", type=int, default=10, help="Validation global batches per evaluation."
    )


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Directory to write checkpoints to.")
    g.add_argument(
        "--load", default=None, help="Resume from the newest checkpoint in this directory."
    )
    g.add_argument(
        "--save-interval", type=int, default=None, help="Save every this many steps (and at end)."
    )
    g.add_argument(
        "--exit-interval", type=int, default=None, help="Save and stop after a multiple of N steps."
    )
    g.add_argument(
        "--exit-duration-in-mins", type=float, default=None, help="Save and stop after N minutes."
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM / SIGINT save at the next step boundary and exit 0.",
    )


def _add_preflight_args(parser: argparse.ArgumentParser) -> None:
    from memo_ext.estimate.presets import DEVICES

    g = parser.add_argument_group("preflight")
    g.add_argument(
        "--skip-preflight",
        action="store_true",
        help="Do not estimate memory before building the model (run even if it cannot fit).",
    )
    g.add_argument(
        "--preflight-device",
        choices=sorted(DEVICES),
        default=None,
        help="Check the run against this device preset (default: the CUDA device; none on CPU).",
    )


def parse_args(argv: Sequence[str] | None = None, *, world_size: int | None = None) -> RunConfig:
    """Parse and validate flags; ``world_size`` defaults to torchrun's ``WORLD_SIZE``.

    Raises:
        ArgumentError: for any invalid value or combination.
    """
    args = build_parser().parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _fill_defaults(args, world_size)
    for check in CHECKS:
        check(args, world_size)
    return _to_run_config(args, world_size)


def _fill_defaults(args: argparse.Namespace, world_size: int) -> None:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        logger.warning("--sequence-parallel has no effect with TP = 1; turning it off")
        args.sequence_parallel = False
    model_parallel = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if args.global_batch_size is None and world_size % model_parallel == 0:
        args.global_batch_size = args.micro_batch_size * (world_size // model_parallel)


def _fail(message: str) -> None:
    raise ArgumentError(message)


def _check_positive(args: argparse.Namespace, world_size: int) -> None:
    for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "seq_length", "micro_batch_size", "train_iters",
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "context_parallel_size", "log_interval",
    ):  # fmt: skip
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            _fail(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")


def _check_world(args: argparse.Namespace, world_size: int) -> None:
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    if world_size % (tp * pp * cp):
        _fail(
            f"the world size {world_size} is not divisible by TP × PP × CP = {tp}×{pp}×{cp}; "
            "change the parallel sizes or the number of processes"
        )


def _check_model_shape(args: argparse.Namespace, world_size: int) -> None:
    tp = args.tensor_model_parallel_size
    heads, groups = args.num_attention_heads, args.num_query_groups
    if args.kv_channels is None and args.hidden_size % heads:
        _fail(f"--hidden-size {args.hidden_size} is not divisible by {heads} attention heads")
    if heads % groups:
        _fail(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    if heads % tp or groups % tp:
        _fail(
            f"attention heads ({heads}) and query groups ({groups}) must both be divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.ffn_hidden_size % tp:
        _fail(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by TP = {tp}")
    if args.num_layers % args.pipeline_model_parallel_size:
        _fail(
            f"--num-layers {args.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
        )
    if args.max_position_embeddings < args.seq_length:
        _fail(
            f"--max-position-embeddings {args.max_position_embeddings} is shorter than "
            f"--seq-length {args.seq_length}"
        )


def _check_sequence(args: argparse.Namespace, world_size: int) -> None:
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1 and args.seq_length % (2 * cp):
        _fail(
            f"--seq-length {args.seq_length} must be divisible by 2 × CP = {2 * cp} "
            "(context parallelism splits it into 2·CP load-balanced chunks)"
        )
    local = args.seq_length // cp
    if args.loss_chunks < 1 or args.loss_chunks > local:
        _fail(f"--loss-chunks must be in [1, {local}] (tokens per CP rank), got {args.loss_chunks}")
    if args.sequence_parallel and local % tp:
        _fail(
            f"with --sequence-parallel each CP rank's {local} tokens must be divisible by TP = {tp}"
        )


def _check_batch(args: argparse.Namespace, world_size: int) -> None:
    model_parallel = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    dp = world_size // model_parallel
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        _fail(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size × DP = {args.micro_batch_size}×{dp}"
        )


def _check_training(args: argparse.Namespace, world_size: int) -> None:
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are exclusive; choose one")
    if (args.bf16 or args.fp16) and not torch.cuda.is_available():
        _fail("--bf16 / --fp16 need CUDA (megatron's mixed-precision optimizer); drop the flag")
    if args.use_distributed_optimizer and not torch.cuda.is_available():
        _fail("--use-distributed-optimizer needs CUDA (megatron's optimizer); drop the flag")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        _fail(f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={args.lr} min-lr={args.min_lr}")
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters > args.train_iters:
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --train-iters]")
    if args.clip_grad < 0:
        _fail(f"--clip-grad must be >= 0 (0 disables clipping), got {args.clip_grad}")


def _check_recompute(args: argparse.Namespace, world_size: int) -> None:
    if args.recompute_granularity is None:
        if args.recompute_method or args.recompute_num_layers:
            _fail("--recompute-method / --recompute-num-layers need --recompute-granularity full")
        return
    if args.recompute_granularity == "selective":
        if args.recompute_method or args.recompute_num_layers:
            _fail("--recompute-granularity selective takes no --recompute-method / -num-layers")
        return
    if args.recompute_method is None or args.recompute_num_layers is None:
        _fail("--recompute-granularity full needs --recompute-method and --recompute-num-layers")
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    if not 1 <= args.recompute_num_layers <= per_stage:
        _fail(f"--recompute-num-layers must be in [1, {per_stage}] (layers per pipeline stage)")


def _check_data(args: argparse.Namespace, world_size: int) -> None:
    if args.mock_data == bool(args.data_path):
        _fail("give exactly one of --data-path PREFIX… or --mock-data")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        _fail("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "ByteTokenizer" and args.vocab_size not in (None, BYTE_VOCAB_SIZE):
        _fail(
            f"--tokenizer-type ByteTokenizer has {BYTE_VOCAB_SIZE} tokens but --vocab-size says "
            f"{args.vocab_size}; drop --vocab-size"
        )
    if args.tokenizer_type in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        _check_file_tokenizer(args)
    for prefix in _data_prefixes(args.data_path):
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                _fail(
                    f"dataset file {prefix + suffix} does not exist; preprocess it with "
                    "tools/preprocess_data.py or fix --data-path"
                )


def _check_variable_lengths(args: argparse.Namespace, world_size: int) -> None:
    """Packed rows run under DP, TP, PP and CP; refuse what they do not support."""
    if not args.variable_seq_lengths:
        return
    unsupported = {
        "--micro-batch-size > 1 (a packed row is one micro-batch)": args.micro_batch_size != 1,
        "--memo": getattr(args, "memo", False),
        "--eval-interval": bool(args.eval_interval),
        "a blend of several --data-path prefixes": len(args.data_path) > 1,
    }
    for what, present in unsupported.items():
        if present:
            _fail(f"--variable-seq-lengths does not support {what} yet")


def _check_file_tokenizer(args: argparse.Namespace) -> None:
    """Load a file-based tokenizer now: a bad path or a size mismatch fails before any work."""
    from memo_ext.training.tokenizers import build_tokenizer

    try:
        tokenizer = build_tokenizer(
            tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file, merge_file=args.merge_file,
        )  # fmt: skip
    except ValueError as err:
        _fail(str(err))
    if args.vocab_size is not None and args.vocab_size != tokenizer.vocab_size:
        _fail(
            f"the tokenizer has {tokenizer.vocab_size} tokens but --vocab-size says "
            f"{args.vocab_size}; drop --vocab-size"
        )


def _data_prefixes(data_path: list[str]) -> list[str]:
    """Prefixes of a Megatron blend: ``a b`` or ``0.7 a 0.3 b``."""
    try:
        float(data_path[0]) if data_path else None
    except ValueError:
        return list(data_path)
    if len(data_path) % 2:
        _fail("a weighted --data-path needs WEIGHT PREFIX pairs")
    return list(data_path[1::2])


def _check_logging(args: argparse.Namespace, world_size: int) -> None:
    if args.device_peak_tflops is not None and args.device_peak_tflops <= 0:
        _fail(f"--device-peak-tflops must be positive, got {args.device_peak_tflops}")


def _check_evaluation(args: argparse.Namespace, world_size: int) -> None:
    if args.eval_interval is not None and args.eval_interval < 1:
        _fail(f"--eval-interval must be at least 1, got {args.eval_interval}")
    if args.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.eval_interval and args.eval_iters and not args.mock_data:
        weights = [float(w) for w in args.split.replace("/", ",").split(",") if w.strip()]
        if len(weights) < 2 or weights[1] <= 0:
            _fail(f"--eval-interval needs a validation part in --split, got {args.split!r}")
    if args.tensorboard_dir:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            _fail("--tensorboard-dir needs the tensorboard package: pip install tensorboard")


def _check_checkpointing(args: argparse.Namespace, world_size: int) -> None:
    for name in ("save_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.save_interval and not args.save:
        _fail("--save-interval needs --save DIR")
    if args.load and not os.path.isdir(args.load):
        _fail(f"--load directory {args.load} does not exist")
    stops = args.exit_interval or args.exit_duration_in_mins or args.exit_signal_handler
    if stops and not args.save:
        _fail("--exit-interval / --exit-duration-in-mins / --exit-signal-handler save before "
              "stopping and need --save DIR")  # fmt: skip


def _check_hotspa(args: argparse.Namespace, world_size: int) -> None:
    try:
        validate_hotspa_args(args, world_size)
    except HotSPaArgumentError as err:
        _fail(str(err))


def _check_memo(args: argparse.Namespace, world_size: int) -> None:
    try:
        validate_memo_args(args)
    except MemoArgumentError as err:
        _fail(str(err))


CHECKS = (
    _check_positive,
    _check_world,
    _check_model_shape,
    _check_sequence,
    _check_batch,
    _check_training,
    _check_recompute,
    _check_data,
    _check_logging,
    _check_memo,
    _check_evaluation,
    _check_checkpointing,
    _check_variable_lengths,
    _check_hotspa,
)


def _transformer_config(args: argparse.Namespace) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # the loss is a mean over every real token of the global batch, however it is split
        calculate_per_token_loss=True,
        # memo_ext.mcore.init redraws every weight after the model is built, independently of
        # the parallel layout. megatron's own draw still runs: with it off, its layers also
        # skip tagging weights as tensor-parallel, which gradient norms and checkpoints need.
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        **LOCAL_KERNEL_SETTINGS,
    )


def _to_run_config(args: argparse.Namespace, world_size: int) -> RunConfig:
    return RunConfig(
        transformer=_transformer_config(args),
        model=ModelConfig(
            max_position_embeddings=args.max_position_embeddings,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            attention_backend=args.attention_backend,
            loss_chunks=args.loss_chunks,
        ),
        train=TrainConfig(
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            train_iters=args.train_iters,
            lr=args.lr,
            min_lr=args.min_lr,
            lr_decay_style=args.lr_decay_style,
            lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_iters=args.lr_decay_iters,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            seed=args.seed,
            use_distributed_optimizer=args.use_distributed_optimizer,
            check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
            skip_iterations_with_nan=args.skip_iterations_with_nan,
        ),
        data=DataConfig(
            seq_length=args.seq_length,
            data_path=list(args.data_path),
            split=args.split,
            mock_data=args.mock_data,
            variable_seq_lengths=args.variable_seq_lengths,
            tokenizer_type=args.tokenizer_type,
            vocab_size=args.vocab_size,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            data_cache_path=args.data_cache_path,
        ),
        logging=LoggingConfig(
            log_interval=args.log_interval,
            metrics_file=args.metrics_file,
            device_peak_tflops=args.device_peak_tflops,
            tensorboard_dir=args.tensorboard_dir,
        ),
        evaluation=EvaluationConfig(eval_interval=args.eval_interval, eval_iters=args.eval_iters),
        preflight=PreflightConfig(enabled=not args.skip_preflight, device=args.preflight_device),
        checkpoint=CheckpointConfig(
            save=args.save,
            load=args.load,
            save_interval=args.save_interval,
            exit_interval=args.exit_interval,
            exit_duration_in_mins=args.exit_duration_in_mins,
            exit_signal_handler=args.exit_signal_handler,
        ),
        memo=memo_config_from_args(args),
        hotspa=hotspa_config_from_args(args, world_size),
        world_size=world_size,
    )
