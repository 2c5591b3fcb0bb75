"""Tokenizers of a local SentencePiece ``tokenizer.model``, with the ids, special tokens and sizes
of Megatron-LM's classes of the same names (megatron-core's own wrapper builds all three alike:
no added specials, no BOS; so the ``sentencepiece`` package is used directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memo_ext.data.tokenizers.base import LocalTokenizer, first_line


class GPTSentencePieceTokenizer(LocalTokenizer):
    """Megatron-LM's GPTSentencePieceTokenizer: a local SentencePiece ``tokenizer.model`` as is.

    Ids are the model's pieces, no special token added to the text; ``eod`` is the model's EOS,
    ``bos`` its BOS and ``pad`` its pad id (``-1`` for a model trained without one);
    ``vocab_size`` counts the model's pieces.

    Args:
        model_file: The ``--tokenizer-model`` file.
    """

    def __init__(self, model_file: str):
        super().__init__()
        self._sp = _load_sentencepiece(model_file, tokenizer_type=type(self).__name__)
        self._files = f"--tokenizer-model {model_file}"
        # an EOS of -1 would be written into the data as the end-of-document id
        if self._sp.eos_id() < 0:
            raise ValueError(
                f"{type(self).__name__}: {model_file} has no end-of-sentence piece to end "
                "documents with; use a model trained with one (eos_id >= 0)"
            )

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode_as_ids(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(len(self._sp))}

    @property
    def vocab_size(self) -> int:
        return len(self._sp)

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: ``GPTSentencePieceTokenizer`` that starts every text with
    BOS (``tokenize("")`` is ``[bos]``). It has no pad id (``-1``): Megatron-LM's class has none,
    so its ``GPTDataset`` pads with -1 as well.
    """

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self._sp.bos_id() < 0:
            raise ValueError(
                f"Llama2Tokenizer: {model_file} has no beginning-of-sentence piece to start texts "
                "with; use GPTSentencePieceTokenizer for a model trained without one"
            )

    def tokenize(self, text: str) -> list[int]:
        return [self._sp.bos_id(), *self._sp.encode_as_ids(text)]

    @property
    def pad(self) -> int:
        return -1


class SentencePieceTokenizer(LocalTokenizer):
    """Megatron-LM's SentencePieceTokenizer: a SentencePiece model plus Megatron's specials.

    ``<CLS>``, ``<SEP>``, ``<EOD>`` and ``<MASK>``, then the model's pad, BOS and EOS pieces
    (``<PAD>``, ``<BOS>``, ``<EOS>`` where the model has none) are special tokens; each one the
    model lacks gets the next id after its pieces, so ``vocab_size`` is the model's pieces plus
    those added (usually 5). ``eod`` is ``<EOD>`` (not the model's EOS) and ``pad`` the pad
    token's id, as in Megatron-LM. ``tokenize`` cuts the text at the special tokens' texts and
    encodes the pieces between them; ``detokenize`` writes each special token with a space on
    either side, as Megatron-LM's does.

    Args:
        model_file: The ``--tokenizer-model`` file.
    """

    def __init__(self, model_file: str):
        super().__init__()
        self._sp = _load_sentencepiece(model_file, tokenizer_type=type(self).__name__)
        self._files = f"--tokenizer-model {model_file}"
        self._vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._specials: dict[str, int] = {}  # in Megatron-LM's order: it breaks ties in tokenize
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        self._pad = self._add_special(self._piece_or(self._sp.pad_id(), "<PAD>"))
        self._bos = self._add_special(self._piece_or(self._sp.bos_id(), "<BOS>"))
        self._eos = self._add_special(self._piece_or(self._sp.eos_id(), "<EOS>"))
        self._special_of_id = {i: token for token, i in self._specials.items()}

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < len(self._sp) else fallback

    def _add_special(self, token: str) -> int:
        self._specials[token] = self._vocab.setdefault(token, len(self._vocab))
        return self._specials[token]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            found = {t: at for t in self._specials if (at := text.find(t, start)) >= 0}
            if not found:
                return ids + self._sp.encode_as_ids(text[start:])
            token = min(found, key=found.get)  # the first special; on a tie, the first added
            ids += self._sp.encode_as_ids(text[start : found[token]])
            ids.append(self._specials[token])
            start = found[token] + len(token)

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for at, token_id in enumerate(ids):
            if token_id in self._special_of_id:
                text += self._sp.decode_ids(ids[last:at]) + " "
                text += self._special_of_id[token_id] + " "
                last = at + 1
        return text + self._sp.decode_ids(ids[last:])

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._specials["<EOD>"]

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def pad(self) -> int:
        return self._pad


def _load_sentencepiece(model_file: str | None, *, tokenizer_type: str):
    """The ``sentencepiece`` processor of a local model file, or one sentence saying why not."""
    if not model_file:
        raise ValueError(
            f"{tokenizer_type} needs --tokenizer-model PATH (a SentencePiece tokenizer.model)"
        )
    if not Path(model_file).is_file():
        raise ValueError(
            f"--tokenizer-model {model_file} is not a file; give the local SentencePiece "
            f"tokenizer.model {tokenizer_type} reads (nothing is downloaded)"
        )
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as err:
        raise ValueError(
            f"{tokenizer_type}: {model_file} is not a SentencePiece model ({first_line(err)})"
        ) from None


SENTENCEPIECE_TOKENIZERS = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}
"""--tokenizer-type names of the tokenizers read from a SentencePiece ``tokenizer.model``."""

# Megatron-LM's PATTERN_TIKTOKEN and PATTERN_TIKTOKEN_V2, the splits --tiktoken-pattern names
