"""Tokenizers without a file: bytes (``ByteTokenizer``) and Megatron-LM's synthetic ids
(``NullTokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence

from memo_ext.config.data import BYTE_VOCAB_SIZE
from memo_ext.data.tokenizers.base import LocalTokenizer


class ByteTokenizer(LocalTokenizer):
    """UTF-8 byte tokenizer: ids 0-255 are bytes, 256 ends a document; no pad id.

    Pretraining samples are never padded, and a pad id inside the vocabulary is harmful with
    megatron-core 0.16's ``GPTDataset``: the first sample it reads aliases its cached loss mask
    and zeroes it wherever that sample's labels equal the pad id, so every later sample of that
    process inherits those holes (mock data contains every id). ``-1`` is megatron's own
    "no pad" value and never equals a label.
    """

    EOD_ID = 256
    PAD_ID = -1

    def tokenize(self, text: str) -> list[int]:
        """Encode text as its UTF-8 bytes.

        Args:
            text: Any Unicode string (may be empty).

        Returns:
            One id per UTF-8 byte, each in ``[0, 256)``.
        """
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode byte ids back to text, dropping the end-of-document and pad ids.

        A byte sequence cut inside a multi-byte character (e.g. a training sample window) decodes
        with U+FFFD replacement characters instead of failing.

        Args:
            ids: Token ids as produced by ``tokenize`` (special ids are skipped).

        Returns:
            The decoded text; ``detokenize(tokenize(t)) == t`` for every string ``t``.
        """
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        """Token name to id: ``<0xNN>`` for bytes, then ``<eod>``."""
        names = {f"<0x{i:02X}>": i for i in range(256)}
        names["<eod>"] = self.EOD_ID
        return names

    @property
    def vocab_size(self) -> int:
        """256 byte ids plus end-of-document."""
        return BYTE_VOCAB_SIZE

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self.EOD_ID

    @property
    def pad(self) -> int:
        """``-1``: no padding token (megatron-core's convention)."""
        return self.PAD_ID


class NullTokenizer(LocalTokenizer):
    """Megatron-LM's NullTokenizer: text is a whitespace-separated list of integer ids.

    Args:
        vocab_size: The ``--vocab-size`` flag: ids ``0 .. vocab_size-1`` are regular tokens, the
            end-of-document id is ``vocab_size`` and ``self.vocab_size`` is ``vocab_size + 1``.
    """

    def __init__(self, *, vocab_size: int) -> None:
        super().__init__()
        self._vocab_size_without_eod = int(vocab_size)

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

    def detokenize(self, ids: Sequence[int]) -> str:
        """Join ids with single spaces (the inverse of ``tokenize``)."""
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict[str, int]:
        """Each id's decimal text (what ``tokenize`` reads) → the id, end-of-document included."""
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        """The flag's vocabulary size plus one for the end-of-document id."""
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        """End-of-document id: the flag's ``--vocab-size``."""
        return self._vocab_size_without_eod

    @property
    def description(self) -> str:
        return f"{super().description} --vocab-size {self._vocab_size_without_eod}"


# End-of-text tokens of common tokenizers, tried in order when a tokenizer names none itself.
