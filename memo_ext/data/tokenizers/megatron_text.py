"""Tokenizers that are megatron-core's own ``MegatronTokenizerText`` over one of its library
wrappers, where that wrapper gives Megatron-LM's ids: ``NullTokenizer`` (the ``null`` library)
and ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer`` (the ``sentencepiece`` library, without
its legacy special tokens). This package adds its checks and messages, and Llama 2's BOS.

Importing this module imports every megatron-core library wrapper (its ``libraries`` package
loads them all: ``transformers``, ``sentencepiece`` and ``tiktoken`` where installed), so
:mod:`memo_ext.data.tokenizers` loads it only for a run that builds one of these types.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.tokenizers.text import MegatronTokenizerText

from memo_ext.data.tokenizers.base import TokenizerFace, first_line
from memo_ext.data.tokenizers.sentencepiece_model import check_model_file


class LibraryTokenizer(TokenizerFace, MegatronTokenizerText):
    """megatron-core's text tokenizer over its ``library`` wrapper (``kwargs``: the wrapper's
    arguments), with this package's face."""

    def __init__(self, path: str, *, library: str, **kwargs) -> None:
        super().__init__(path, {"library": library}, **kwargs)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The wrapper's text of ``ids``, given as Python ints (a tensor's or an array's too)."""
        return super().detokenize([int(i) for i in ids])


class NullTokenizer(LibraryTokenizer):
    """Megatron-LM's NullTokenizer, megatron-core's ``null`` library: text is a
    whitespace-separated list of integer ids.

    The ids are megatron-core's: ``0 .. vocab_size-1`` are regular tokens, the end-of-document id
    is ``vocab_size`` and ``self.vocab_size`` is ``vocab_size + 1``. Reading text is this
    package's: any whitespace separates ids (megatron-core's splits on single spaces only and
    fails on two in a row), and an id outside the vocabulary is refused.

    Args:
        vocab_size: The ``--vocab-size`` flag.
    """

    def __init__(self, *, vocab_size: int) -> None:
        super().__init__("", library="null", vocab_size=int(vocab_size))
        self._files = f"--vocab-size {int(vocab_size)}"

    def tokenize(self, text: str) -> list[int]:
        """Parse whitespace-separated integer ids.

        Args:
            text: For example ``"17 4 1022"``; empty or blank text gives no ids.

        Returns:
            The ids, each checked to lie in ``[0, vocab_size)``.

        Raises:
            ValueError: A field is not an integer or an id is outside the vocabulary.
        """
        ids = []
        for field in text.split():
            try:
                ids.append(int(field))
            except ValueError:
                raise ValueError(
                    f"NullTokenizer expects whitespace-separated integer ids, got {field[:40]!r}."
                ) from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"NullTokenizer id {bad[0]} is outside [0, {self.vocab_size}); "
                f"raise --vocab-size or fix the input."
            )
        return ids

    @property
    def vocab(self) -> dict[str, int]:
        """Each id's decimal text (what ``tokenize`` reads) → the id, end-of-document included
        (megatron-core's wrapper has no vocabulary to list)."""
        return {str(i): i for i in range(self.vocab_size)}


class GPTSentencePieceTokenizer(LibraryTokenizer):
    """Megatron-LM's GPTSentencePieceTokenizer, megatron-core's ``sentencepiece`` library: a
    local SentencePiece ``tokenizer.model`` as is.

    Ids are the model's pieces, no special token added to the text; ``eod`` is the model's EOS,
    ``bos`` its BOS and ``pad`` its pad id (``-1`` for a model trained without one);
    ``vocab_size`` counts the model's pieces.

    Args:
        model_file: The ``--tokenizer-model`` file.
    """

    def __init__(self, model_file: str | None):
        name = type(self).__name__
        check_model_file(model_file, tokenizer_type=name)
        try:
            super().__init__(model_file, library="sentencepiece")
        except (RuntimeError, OSError) as err:
            raise ValueError(
                f"{name}: {model_file} is not a SentencePiece model ({first_line(err)})"
            ) from None
        self._files = f"--tokenizer-model {model_file}"
        # an EOS of -1 would be written into the data as the end-of-document id
        if self.eod < 0:
            raise ValueError(
                f"{name}: {model_file} has no end-of-sentence piece to end documents with; use a "
                "model trained with one (eos_id >= 0)"
            )

    @property
    def vocab(self) -> dict[str, int]:
        """Piece → id (megatron-core's wrapper lists the pieces in id order)."""
        return {piece: i for i, piece in enumerate(super().vocab)}

    def _no_bert_token(self):
        raise AttributeError(f"{type(self).__name__} has no CLS, SEP or MASK token")

    # megatron-core's wrapper raises NameError for these, which hasattr() does not catch
    cls = cls_id = sep = sep_id = mask = mask_id = property(_no_bert_token)


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: ``GPTSentencePieceTokenizer`` that starts every text with
    BOS (``tokenize("")`` is ``[bos]``). It has no pad id (``-1``): Megatron-LM's class has none,
    so its ``GPTDataset`` pads with -1 as well.
    """

    def __init__(self, model_file: str | None):
        super().__init__(model_file)
        if self.bos < 0:
            raise ValueError(
                f"Llama2Tokenizer: {model_file} has no beginning-of-sentence piece to start texts "
                "with; use GPTSentencePieceTokenizer for a model trained without one"
            )

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]

    @property
    def pad(self) -> int:
        return -1
