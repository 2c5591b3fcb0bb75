"""``ByteTokenizer``: the UTF-8 bytes of a text, with nothing to read (Megatron-LM's synthetic
ids, ``NullTokenizer``, are megatron-core's: :mod:`memo_ext.data.tokenizers.megatron_text`).
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
