"""Tokenizers that download nothing (the embedding table's padding is ``memo_ext.shapes``).

Every tokenizer subclasses megatron-core's ``MegatronTokenizerBase`` and exposes what
``GPTDataset`` / ``MockGPTDataset`` read from a tokenizer: ``eod``, ``pad``, ``vocab_size`` and
``unique_identifiers`` (which enters the hash of the dataset index cache).

- ``ByteTokenizer``: the UTF-8 bytes of the text, ids 0-255, then end-of-document (256); no pad
  id; ``vocab_size`` is 257. Any Unicode text round-trips exactly.
- ``NullTokenizer``: Megatron-LM's synthetic tokenizer. The text is a whitespace-separated list
  of integer ids. ``--vocab-size V`` declares ids ``0 .. V-1``; the end-of-document id is ``V``
  and the reported ``vocab_size`` is ``V + 1``, exactly as Megatron-LM's ``_NullTokenizer`` and
  megatron-core's ``NullTokenizer`` do. It has no pad id (megatron-core then pads with -1).
- ``HuggingFaceTokenizer``: a local ``tokenizer.json`` through the ``tokenizers`` library; its
  BOS / EOS come from ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it.
- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from local ``vocab.json`` / ``merges.txt``.
- ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``: a local
  SentencePiece ``tokenizer.model``, with the ids, special tokens and sizes of Megatron-LM's
  classes of those names (``megatron/training/tokenizer/tokenizer.py``, which Megatron-LM's
  trainer uses). megatron-core's own SentencePiece wrapper builds all three alike (no added
  specials, no BOS), so the ``sentencepiece`` package is used directly.
- ``TikTokenizer``: a local tiktoken vocabulary in Megatron-LM's JSON format, with the ids of
  Megatron-LM's ``CustomTikTokenizer``, through the ``tiktoken`` package.

One module per library: ``local`` (bytes, synthetic ids), ``huggingface`` (``tokenizers``),
``sentencepiece_model`` (``sentencepiece``), ``tiktoken_file`` (``tiktoken``); ``base`` holds
what they share. Megatron-LM's ids are what each is tested against
(``tests/unit/test_pretrained_tokenizers.py``); megatron-core's own tokenizer classes are not
subclassed: its SentencePiece wrapper builds ``GPTSentencePieceTokenizer`` and
``Llama2Tokenizer`` without Megatron-LM's BOS / special-token ids, and its HuggingFace wrapper
goes through ``transformers``' ``AutoTokenizer`` (a download unless the files are local).
"""

from __future__ import annotations

from megatron.core.tokenizers import MegatronTokenizerBase

from memo_ext.config.data import TOKENIZER_TYPES, DataConfig, TokenizerSpec
from memo_ext.data.tokenizers.huggingface import GPT2BPETokenizer, HuggingFaceTokenizer
from memo_ext.data.tokenizers.local import ByteTokenizer, NullTokenizer
from memo_ext.data.tokenizers.sentencepiece_model import (
    SENTENCEPIECE_TOKENIZERS,
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from memo_ext.data.tokenizers.tiktoken_file import TIKTOKEN_PATTERNS, TikTokenizer
from memo_ext.errors import UsageError

__all__ = [
    "SENTENCEPIECE_TOKENIZERS",
    "ByteTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "build_tokenizer",
    "tokenizer_for",
]


def build_tokenizer(spec: TokenizerSpec) -> MegatronTokenizerBase:
    """Build the tokenizer ``spec`` names (``--tokenizer-type`` and its files); nothing is ever
    downloaded.

    The trainer (:func:`tokenizer_for`) and ``memo-preprocess-data`` both build through here,
    so data and training agree on every id. ``spec.vocab_size`` is required by
    ``NullTokenizer`` and is ``TikTokenizer``'s size; ``spec.tokenizer_model`` is a local
    ``tokenizer.json`` or its directory (``HuggingFaceTokenizer``), a SentencePiece
    ``tokenizer.model`` (:data:`SENTENCEPIECE_TOKENIZERS`) or a tiktoken vocabulary
    (``TikTokenizer``); ``vocab_file`` and ``merge_file`` are ``GPT2BPETokenizer``'s.

    Returns:
        A megatron-core tokenizer usable by ``GPTDatasetConfig``.

    Raises:
        ValueError: Unknown type, or a missing / invalid setting for the type.
    """
    tokenizer_type, vocab_size, tokenizer_model = (
        spec.tokenizer_type,
        spec.vocab_size,
        spec.tokenizer_model,
    )
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                f"NullTokenizer needs --vocab-size set to a positive integer, got {vocab_size}."
            )
        return NullTokenizer(vocab_size=vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model PATH (a tokenizer.json)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    if tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        return SENTENCEPIECE_TOKENIZERS[tokenizer_type](tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        if spec.tiktoken_pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(
                f"TikTokenizer needs --tiktoken-pattern v1 or v2, got {spec.tiktoken_pattern}."
            )
        return TikTokenizer(
            tokenizer_model,
            pattern=spec.tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=spec.tiktoken_num_special_tokens,
            special_tokens=spec.tiktoken_special_tokens,
        )
    raise ValueError(
        f"Unknown --tokenizer-type {tokenizer_type!r}; "
        f"valid types are {', '.join(TOKENIZER_TYPES)}."
    )


def tokenizer_for(data: DataConfig) -> MegatronTokenizerBase:
    """The tokenizer a run's data section names.

    Raises:
        UsageError: a tokenizer file that is missing or cannot be read.
    """
    try:
        return build_tokenizer(data.tokenizer)
    except ValueError as err:
        raise UsageError(str(err)) from None
