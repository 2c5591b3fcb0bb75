"""Megatron-LM's ``SentencePieceTokenizer`` (a local SentencePiece ``tokenizer.model`` plus
Megatron's special tokens) through the ``sentencepiece`` package, and the check of a model file
every SentencePiece type makes. ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer`` are
megatron-core's wrapper (:mod:`memo_ext.data.tokenizers.megatron_text`); this one is not: the
wrapper's mode that adds special tokens (``legacy``) drops the SentencePiece separator after a
special token and strips the decoded text, and Megatron-LM's class does neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memo_ext.data.tokenizers.base import LocalTokenizer, first_line


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


def check_model_file(model_file: str | None, *, tokenizer_type: str) -> None:
    """Refuse a ``--tokenizer-model`` that is not given or not a file, in one sentence.

    Raises:
        ValueError: naming the flag.
    """
    if not model_file:
        raise ValueError(
            f"{tokenizer_type} needs --tokenizer-model PATH (a SentencePiece tokenizer.model)"
        )
    if not Path(model_file).is_file():
        raise ValueError(
            f"--tokenizer-model {model_file} is not a file; give the local SentencePiece "
            f"tokenizer.model {tokenizer_type} reads (nothing is downloaded)"
        )


def _load_sentencepiece(model_file: str | None, *, tokenizer_type: str):
    """The ``sentencepiece`` processor of a local model file, or one sentence saying why not."""
    check_model_file(model_file, tokenizer_type=tokenizer_type)
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as err:
        raise ValueError(
            f"{tokenizer_type}: {model_file} is not a SentencePiece model ({first_line(err)})"
        ) from None
