"""The data section: where tokens come from and how they are read.

Its checks read flags only; the files they name (datasets, tokenizer files) are checked by
``memo_ext.data.input_files`` when the run is parsed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from memo_ext.config.common import at_least, check_writable_directory
from memo_ext.errors import UsageError

if TYPE_CHECKING:
    from memo_ext.config.output import EvaluationConfig
    from memo_ext.config.train import TrainConfig

TOKENIZER_TYPES = (
    "ByteTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
)
"""--tokenizer-type choices (``memo_ext.data.tokenizers`` builds them; nothing is downloaded)."""
MODEL_FILE_TOKENIZER_TYPES = (
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
)
"""The tokenizers read from the --tokenizer-model file."""
BYTE_VOCAB_SIZE = 257
"""ByteTokenizer's ids: 256 bytes and the end-of-document token."""


DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's train,valid,test proportions, what an unset --split starts from."""


def check_split(split: str) -> None:
    """Check a ``--split`` string such as ``"969,30,1"`` (at most three non-negative weights).

    megatron-core's own parser silently ignores signs and non-numeric text, so check first.

    Raises:
        ValueError: naming the string.
    """
    parts = [part.strip() for part in split.split(",")]
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(
            f"--split must be up to three comma-separated non-negative weights with a positive "
            f"sum, such as 969,30,1; got {split!r}."
        )


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """Which tokenizer, from which local files: the run's ``--tokenizer-*`` flags, and what
    ``memo-preprocess-data`` builds its tokenizer from (``memo_ext.data.tokenizers``), so data
    and training agree on every id."""

    tokenizer_type: str = "ByteTokenizer"
    vocab_size: int | None = None
    tokenizer_model: str | None = None
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: tuple[str, ...] = ()
    vocab_file: str | None = None
    merge_file: str | None = None
    """Each as the ``DataConfig`` field of the same name documents it."""


TOKENIZER_FIELDS = tuple(f.name for f in dataclasses.fields(TokenizerSpec))
"""The fields of ``DataConfig`` that choose the tokenizer (and so the vocabulary)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from."""

    seq_length: int
    """Tokens per sample."""
    data_path: tuple[str, ...] = ()
    """Dataset prefixes, optionally weighted (0.7 a 0.3 b), as in Megatron-LM."""
    data_args_path: str | None = None
    """A text file holding the --data-path list (white-space separated), instead of --data-path."""
    train_data_path: tuple[str, ...] = ()
    """Training dataset prefixes, a blend like --data-path, used whole (no --split)."""
    valid_data_path: tuple[str, ...] = ()
    """Validation dataset prefixes, a blend like --data-path, used whole (no --split)."""
    test_data_path: tuple[str, ...] = ()
    """Test dataset prefixes, a blend like --data-path, used whole (no --split)."""
    per_split_data_args_path: str | None = None
    """A JSON file {"train": [...], "valid": [...], "test": [...]} holding the three per-split
    blends, instead of --train-data-path, --valid-data-path and --test-data-path."""
    split: str | None = None
    """Train,valid,test proportions. Unset: 969,30,1, except that a part a small corpus would
    leave without a document is dropped (the test part, then the validation part unless
    --eval-interval reads it), and the log says so."""
    mock_data: bool = False
    """Synthetic tokens."""
    variable_seq_lengths: bool = False
    """Whole documents (cut at --seq-length) packed into rows with per-document attention;
    --global-batch-size then counts documents."""
    tokenizer_type: Literal[TOKENIZER_TYPES] = "ByteTokenizer"
    """Tokenizer; nothing is downloaded. Unset with --vocab-file and --merge-file given:
    GPT2BPETokenizer (what Megatron-LM's GPT-3 scripts mean by those two files)."""
    vocab_size: int | None = None
    """NullTokenizer vocabulary; TikTokenizer's ids in all, special tokens included (default
    131072, as Megatron-LM). Other tokenizers fix their own."""
    tokenizer_model: str | None = None
    """Local tokenizer file: a tokenizer.json or a directory holding one (HuggingFaceTokenizer),
    a SentencePiece tokenizer.model (SentencePieceTokenizer, GPTSentencePieceTokenizer,
    Llama2Tokenizer), a tiktoken vocabulary .json in Megatron-LM's format (TikTokenizer)."""
    tiktoken_pattern: Literal["v1", "v2"] | None = None
    """TikTokenizer's text split: Megatron-LM's regex v1 or v2 (needed by TikTokenizer)."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids before the file's tokens, held by the special tokens and fillers."""
    tiktoken_special_tokens: tuple[str, ...] = ()
    """TikTokenizer's special tokens (ids 0, 1, ...), Megatron-LM's unknown, BOS and EOS tokens
    among them; unset: just those three."""
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

    @property
    def per_split(self) -> bool:
        """Train, valid and test come from their own prefixes (no --split)."""
        return bool(
            self.train_data_path
            or self.valid_data_path
            or self.test_data_path
            or self.per_split_data_args_path
        )

    @property
    def split_or_default(self) -> str:
        """--split as given, else the default before it is fitted to a corpus."""
        return DEFAULT_SPLIT if self.split is None else self.split

    @property
    def tokenizer(self) -> TokenizerSpec:
        """The tokenizer these flags choose."""
        return TokenizerSpec(**{name: getattr(self, name) for name in TOKENIZER_FIELDS})

    def check(self) -> None:
        """The flags alone; the files they name are checked by ``memo_ext.data.input_files``."""
        at_least(self.seq_length, 1, "--seq-length")
        at_least(self.num_workers, 0, "--num-workers")
        at_least(self.vocab_size, 1, "--vocab-size")
        if self.data_cache_path:
            check_writable_directory(self.data_cache_path, flag="--data-cache-path")
        self._check_sources()
        self._check_tokenizer()
        try:
            if self.split is not None:
                check_split(self.split)
        except ValueError as err:
            raise UsageError(str(err)) from None

    def _check_tokenizer(self) -> None:
        """The flags each tokenizer type needs (its files are read by ``input_files``)."""
        kind = self.tokenizer_type
        if kind == "NullTokenizer" and self.vocab_size is None:
            raise UsageError("--tokenizer-type NullTokenizer needs --vocab-size")
        if kind == "ByteTokenizer" and self.vocab_size not in (None, BYTE_VOCAB_SIZE):
            raise UsageError(
                f"--tokenizer-type ByteTokenizer has {BYTE_VOCAB_SIZE} tokens but --vocab-size "
                f"says {self.vocab_size}; drop --vocab-size"
            )
        if kind in MODEL_FILE_TOKENIZER_TYPES and not self.tokenizer_model:
            raise UsageError(f"--tokenizer-type {kind} needs --tokenizer-model PATH")
        if kind == "TikTokenizer" and self.tiktoken_pattern is None:
            raise UsageError(
                "--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2 (the regex the "
                "vocabulary was made with)"
            )

    def _check_sources(self) -> None:
        """One source of tokens, as Megatron-LM: a blend split by --split, per-split blends, or
        mock data."""
        per_split_flags = self.train_data_path or self.valid_data_path or self.test_data_path
        if self.data_path and self.data_args_path:
            raise UsageError("give --data-path or --data-args-path, not both")
        if per_split_flags and self.per_split_data_args_path:
            raise UsageError(
                "give --train-data-path/--valid-data-path/--test-data-path or "
                "--per-split-data-args-path, not both"
            )
        if self.per_split and (self.data_path or self.data_args_path):
            raise UsageError(
                "per-split data paths (--train-data-path, --valid-data-path, --test-data-path, "
                "--per-split-data-args-path) replace --data-path and --data-args-path; give one "
                "kind"
            )
        if self.per_split and self.split is not None:
            raise UsageError(
                "per-split data paths are used whole and take no --split; drop --split"
            )
        sources = self.mock_data + bool(self.data_path or self.data_args_path) + self.per_split
        if sources != 1:
            raise UsageError(
                "give exactly one of --data-path PREFIX… (or --data-args-path), per-split paths "
                "(--train-data-path PREFIX… or --per-split-data-args-path), or --mock-data"
            )
        if self.per_split and not self.per_split_data_args_path and not self.train_data_path:
            raise UsageError("per-split data paths need --train-data-path PREFIX…")

    def check_with(
        self, *, train: TrainConfig, evaluation: EvaluationConfig, memo_enabled: bool
    ) -> None:
        """Evaluation needs validation data; packed rows (--variable-seq-lengths) run under DP,
        TP, PP and CP: refuse what they do not support."""
        # a per-split JSON file is read later: check_inputs checks its "valid" list
        no_valid = not (self.per_split_data_args_path or self.valid_data_path)
        if self.per_split and evaluation.enabled and no_valid:
            raise UsageError(
                "--eval-interval evaluates on validation data, which per-split paths take "
                "from --valid-data-path; give it, or drop --eval-interval"
            )
        if not self.variable_seq_lengths:
            return
        unsupported = {
            "--micro-batch-size > 1 (a packed row is one micro-batch)": train.micro_batch_size != 1,
            "--memo": memo_enabled,
            "--eval-interval": bool(evaluation.eval_interval),
            # rows are packed from global_batch_size documents per step (with HotSPa, split
            # into buckets from them): a growing batch is not wired through either
            "--rampup-batch-size": train.rampup_batch_size is not None,
            "--step-batch-size-schedule": train.step_batch_size_schedule is not None,
            "a blend of several --data-path prefixes": len(self.data_path) > 1,
            "a blend of several --train-data-path prefixes": len(self.train_data_path) > 1,
            "--data-args-path": self.data_args_path is not None,
            "--per-split-data-args-path": self.per_split_data_args_path is not None,
            "--valid-data-path or --test-data-path (it reads --train-data-path only)": bool(
                self.valid_data_path or self.test_data_path
            ),
        }
        for what, present in unsupported.items():
            if present:
                raise UsageError(f"--variable-seq-lengths does not support {what} yet")
