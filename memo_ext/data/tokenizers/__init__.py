"""Tokenizers that download nothing (the embedding table's padding is ``memo_ext.shapes``).

Every tokenizer is one of megatron-core's and exposes what ``GPTDataset`` / ``MockGPTDataset``
read from a tokenizer: ``eod``, ``pad``, ``vocab_size`` and ``unique_identifiers`` (which
enters the hash of the dataset index cache). Megatron-LM's ids are what each is tested against
(``tests/unit/test_pretrained_tokenizers.py``, with a Megatron-LM checkout).

megatron-core's own text tokenizer (``MegatronTokenizerText`` over a library wrapper), where the
wrapper gives Megatron-LM's ids (``megatron_text``):

- ``NullTokenizer``: Megatron-LM's synthetic tokenizer (the ``null`` wrapper). The text is a
  whitespace-separated list of integer ids. ``--vocab-size V`` declares ids ``0 .. V-1``; the
  end-of-document id is ``V`` and the reported ``vocab_size`` is ``V + 1``. It has no pad id
  (megatron-core then pads with -1).
- ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``: a local SentencePiece ``tokenizer.model``
  (the ``sentencepiece`` wrapper), the second starting every text with BOS as Megatron-LM's does.

This package's own, on megatron-core's ``MegatronTokenizerBase``, where megatron-core's wrapper
gives other ids or needs what a run here does not have:

- ``ByteTokenizer`` (``local``): the UTF-8 bytes of the text, ids 0-255, then end-of-document
  (256); no pad id; ``vocab_size`` is 257. Any Unicode text round-trips exactly. Megatron-LM has
  no such type; megatron-core's ``byte-level`` wrapper ends documents with id 0, pads with 1 and
  strips decoded text.
- ``HuggingFaceTokenizer``, ``GPT2BPETokenizer`` (``huggingface``): a local ``tokenizer.json``,
  or GPT-2 byte-level BPE from local ``vocab.json`` / ``merges.txt``, through the ``tokenizers``
  library; BOS / EOS come from ``tokenizer_config.json`` / ``special_tokens_map.json``. The ids
  are Megatron-LM's; megatron-core's wrappers of these go through ``transformers``'
  ``AutoTokenizer``, which training does not otherwise need, and resolve a name on the Hub.
- ``SentencePieceTokenizer`` (``sentencepiece_model``): Megatron-LM's SentencePiece model plus
  ``<CLS> <SEP> <EOD> <MASK>`` and the pad / BOS / EOS pieces it lacks. megatron-core's wrapper
  adds special tokens only in its ``legacy`` mode, which drops the SentencePiece separator after
  a special token and strips decoded text; Megatron-LM's does neither.
- ``TikTokenizer`` (``tiktoken_file``): a local tiktoken vocabulary in Megatron-LM's JSON format,
  with the ids of Megatron-LM's ``CustomTikTokenizer``. megatron-core's wrapper requires seven
  special tokens (Megatron-LM's: three), so the special ids and the pad id differ, and it
  encodes special tokens' texts as special ids where Megatron-LM's encodes them as text.

``MODULES`` names each type's module, loaded on first use: ``megatron_text`` imports all of
megatron-core's library wrappers (``transformers``, ``sentencepiece`` and ``tiktoken`` where
installed), which a run of the other types does not pay for.
"""

from __future__ import annotations

import importlib

from megatron.core.tokenizers import MegatronTokenizerBase

from memo_ext.config.data import TOKENIZER_TYPES, DataConfig, TokenizerSpec
from memo_ext.data.tokenizers.tiktoken_file import TIKTOKEN_PATTERNS
from memo_ext.errors import UsageError

MODULES = {
    "ByteTokenizer": "local",
    "NullTokenizer": "megatron_text",
    "HuggingFaceTokenizer": "huggingface",
    "GPT2BPETokenizer": "huggingface",
    "SentencePieceTokenizer": "sentencepiece_model",
    "GPTSentencePieceTokenizer": "megatron_text",
    "Llama2Tokenizer": "megatron_text",
    "TikTokenizer": "tiktoken_file",
}
"""The module of each --tokenizer-type's class, loaded when a run first builds that type (the
``megatron_text`` one imports every megatron-core library wrapper)."""

SENTENCEPIECE_TOKENIZERS = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
)
"""--tokenizer-type names of the tokenizers read from a SentencePiece ``tokenizer.model``."""

__all__ = [
    *MODULES,
    "SENTENCEPIECE_TOKENIZERS",
    "build_tokenizer",
    "tokenizer_class",
    "tokenizer_for",
]


def tokenizer_class(tokenizer_type: str) -> type[MegatronTokenizerBase]:
    """The class of ``tokenizer_type``, its module imported on first use."""
    module = importlib.import_module(f"{__name__}.{MODULES[tokenizer_type]}")
    return getattr(module, tokenizer_type)


def __getattr__(name: str):
    # the classes are attributes of the package, loaded on first access
    if name in MODULES:
        return tokenizer_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    if tokenizer_type not in MODULES:
        raise ValueError(
            f"Unknown --tokenizer-type {tokenizer_type!r}; "
            f"valid types are {', '.join(TOKENIZER_TYPES)}."
        )
    if tokenizer_type == "NullTokenizer" and (vocab_size is None or vocab_size < 1):
        raise ValueError(
            f"NullTokenizer needs --vocab-size set to a positive integer, got {vocab_size}."
        )
    if tokenizer_type == "HuggingFaceTokenizer" and not tokenizer_model:
        raise ValueError("HuggingFaceTokenizer needs --tokenizer-model PATH (a tokenizer.json)")
    if tokenizer_type == "TikTokenizer" and spec.tiktoken_pattern not in TIKTOKEN_PATTERNS:
        raise ValueError(
            f"TikTokenizer needs --tiktoken-pattern v1 or v2, got {spec.tiktoken_pattern}."
        )
    cls = tokenizer_class(tokenizer_type)
    if tokenizer_type == "ByteTokenizer":
        return cls()
    if tokenizer_type == "NullTokenizer":
        return cls(vocab_size=vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return cls(spec.vocab_file, spec.merge_file)
    if tokenizer_type == "TikTokenizer":
        return cls(
            tokenizer_model,
            pattern=spec.tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=spec.tiktoken_num_special_tokens,
            special_tokens=spec.tiktoken_special_tokens,
        )
    return cls(tokenizer_model)  # the types read from --tokenizer-model alone


def tokenizer_for(data: DataConfig) -> MegatronTokenizerBase:
    """The tokenizer a run's data section names.

    Raises:
        UsageError: a tokenizer file that is missing or cannot be read.
    """
    try:
        return build_tokenizer(data.tokenizer)
    except ValueError as err:
        raise UsageError(str(err)) from None
