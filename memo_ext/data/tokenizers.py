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
- ``HuggingFaceTokenizer``: a local ``tokenizer.json`` through the ``tokenizers`` library.
- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from local ``vocab.json`` / ``merges.txt``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from megatron.core.tokenizers import MegatronTokenizerBase

from memo_ext.config.data import BYTE_VOCAB_SIZE, TOKENIZER_TYPES, DataConfig
from memo_ext.errors import UsageError


class _LocalTokenizer(MegatronTokenizerBase):
    """Shared plumbing for tokenizers that live entirely in this file."""

    def __init__(self) -> None:
        super().__init__(path="", config={})

    def apply_chat_template(self, *args, **kwargs):
        """Chat templates are not supported by pretraining tokenizers."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template.")

    @property
    def description(self) -> str:
        """The tokenizer as its flags name it, for messages: ``--tokenizer-type NAME`` and the
        files or sizes it was built from."""
        return f"--tokenizer-type {type(self).__name__}"

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies this tokenizer in megatron-core's dataset cache descriptions."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("vocab_size", self.vocab_size),
            ]
        )


class ByteTokenizer(_LocalTokenizer):
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


class NullTokenizer(_LocalTokenizer):
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
EOD_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class HuggingFaceTokenizer(_LocalTokenizer):
    """A local Hugging Face ``tokenizer.json`` (the ``tokenizers`` library; nothing downloaded).

    Args:
        path: A ``tokenizer.json`` file, or a directory holding one.
    """

    def __init__(self, path: str):
        super().__init__()
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"--tokenizer-model {path}: no tokenizer.json there; give a local tokenizer.json "
                "file or a directory holding one (nothing is downloaded)"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own kinds
            raise ValueError(
                f"HuggingFaceTokenizer: {file} is not a tokenizer.json the tokenizers library "
                f"reads ({_first_line(err)})"
            ) from None
        self._eod = _find_eod(self._tok.get_vocab(with_added_tokens=True), source=str(file))
        self._files = f"--tokenizer-model {path}"

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return -1

    @property
    def description(self) -> str:
        return f"{super().description} {self._files}"


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2 byte-level BPE from local ``vocab.json`` and ``merges.txt`` files."""

    def __init__(self, vocab_file: str, merge_file: str):
        _LocalTokenizer.__init__(self)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not Path(path).is_file():
                raise ValueError(f"GPT2BPETokenizer: {flag} {path} is not a file")
        try:
            self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own kinds
            raise ValueError(
                f"GPT2BPETokenizer: {vocab_file} and {merge_file} are not a GPT-2 vocab.json and "
                f"merges.txt ({_first_line(err)})"
            ) from None
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._eod = _find_eod(self._tok.get_vocab(with_added_tokens=True), source=vocab_file)
        self._files = f"--vocab-file {vocab_file} --merge-file {merge_file}"


def _find_eod(vocab: dict[str, int], *, source: str) -> int:
    for name in EOD_TOKEN_NAMES:
        if name in vocab:
            return vocab[name]
    raise ValueError(
        f"{source} has no end-of-text token (looked for {', '.join(EOD_TOKEN_NAMES)}); "
        "add one to the tokenizer"
    )


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def build_tokenizer(
    *,
    tokenizer_type: str,
    vocab_size: int | None = None,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> MegatronTokenizerBase:
    """Build a tokenizer by its ``--tokenizer-type`` name; nothing is ever downloaded.

    Args:
        tokenizer_type: One of :data:`TOKENIZER_TYPES`.
        vocab_size: ``--vocab-size``; required by ``NullTokenizer``.
        tokenizer_model: ``--tokenizer-model``; a local ``tokenizer.json`` or its directory
            (``HuggingFaceTokenizer``).
        vocab_file: ``--vocab-file`` (``GPT2BPETokenizer``).
        merge_file: ``--merge-file`` (``GPT2BPETokenizer``).

    Returns:
        A megatron-core tokenizer usable by ``GPTDatasetConfig``.

    Raises:
        ValueError: Unknown type, or a missing / invalid setting for the type.
    """
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
        return GPT2BPETokenizer(vocab_file, merge_file)
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
        return build_tokenizer(
            tokenizer_type=data.tokenizer_type,
            vocab_size=data.vocab_size,
            tokenizer_model=data.tokenizer_model,
            vocab_file=data.vocab_file,
            merge_file=data.merge_file,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
