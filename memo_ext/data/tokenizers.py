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
"""

from __future__ import annotations

import base64
import binascii
import json
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

    _files = ""
    """The flags naming the files it was read from (``--tokenizer-model PATH``), for messages."""

    @property
    def description(self) -> str:
        """The tokenizer as its flags name it, for messages: ``--tokenizer-type NAME`` and the
        files or sizes it was built from."""
        return f"--tokenizer-type {type(self).__name__} {self._files}".rstrip()

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

# Beside a tokenizer.json: the files where Hugging Face exports name their special tokens (which
# one wins: ``_named_special_tokens``).
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HuggingFaceTokenizer(_LocalTokenizer):
    """A local Hugging Face ``tokenizer.json`` (the ``tokenizers`` library; nothing downloaded).

    BOS and EOS (``eod``) are the ``bos_token`` / ``eos_token`` the export beside the
    ``tokenizer.json`` names, read as ``transformers`` reads them: from ``tokenizer_config.json``
    alone when it lists ``added_tokens_decoder`` (current exports), else from
    ``special_tokens_map.json`` first and ``tokenizer_config.json`` for what the map does not
    name. Neither file naming an EOS, ``eod`` is the first of
    :data:`EOD_TOKEN_NAMES` in the vocabulary; no BOS named, ``bos`` is ``None``. Text is
    encoded with the special tokens the ``tokenizer.json``'s own post-processor adds (a Llama 3
    export's ``<|begin_of_text|>``; nothing for GPT-2), as Megatron-LM's HuggingFaceTokenizer
    does (``transformers``' tokenizer call, ``add_special_tokens`` on by default).

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
        vocab = self._tok.get_vocab(with_added_tokens=True)
        named = _named_special_tokens(file.parent)
        self._eod = (
            _named_id(vocab, named["eos_token"], file=file)
            if "eos_token" in named
            else _find_eod(vocab, source=str(file))
        )
        self._bos = (
            _named_id(vocab, named["bos_token"], file=file) if "bos_token" in named else None
        )
        self._files = f"--tokenizer-model {path}"

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

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
    def bos(self) -> int | None:
        """The BOS id the tokenizer's config files name, or ``None``."""
        return self._bos

    @property
    def pad(self) -> int:
        return -1


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
        self._bos = None
        self._files = f"--vocab-file {vocab_file} --merge-file {merge_file}"


def _named_special_tokens(directory: Path) -> dict[str, tuple[str, Path]]:
    """``bos_token`` / ``eos_token`` → (the token, the file naming it), as ``transformers``
    (5.x) reads an export in ``directory``: a ``tokenizer_config.json`` with
    ``added_tokens_decoder`` (what transformers has written since 4.34) is the only source;
    otherwise ``special_tokens_map.json`` names first and ``tokenizer_config.json`` fills what
    it does not name."""
    configs = {}
    for name in SPECIAL_TOKEN_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{file} is not valid JSON ({err}); fix or remove it") from None
        configs[name] = (config if isinstance(config, dict) else {}, file)
    order = ["special_tokens_map.json", "tokenizer_config.json"]
    if "added_tokens_decoder" in configs.get("tokenizer_config.json", ({}, None))[0]:
        order = ["tokenizer_config.json"]
    named: dict[str, tuple[str, Path]] = {}
    for config, file in (configs[name] for name in order if name in configs):
        for key in ("bos_token", "eos_token"):
            token = config.get(key)
            # transformers saves a token as its text or as an AddedToken dict {"content": ...}
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and key not in named:
                named[key] = (token, file)
    return named


def _named_id(vocab: dict[str, int], named: tuple[str, Path], *, file: Path) -> int:
    token, source = named
    if token not in vocab:
        raise ValueError(
            f"{source} names the special token {token!r}, which {file} does not have; give the "
            "config files that belong to this tokenizer.json"
        )
    return vocab[token]


class GPTSentencePieceTokenizer(_LocalTokenizer):
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


class SentencePieceTokenizer(_LocalTokenizer):
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
            f"{tokenizer_type}: {model_file} is not a SentencePiece model ({_first_line(err)})"
        ) from None


SENTENCEPIECE_TOKENIZERS = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}
"""--tokenizer-type names of the tokenizers read from a SentencePiece ``tokenizer.model``."""

# Megatron-LM's PATTERN_TIKTOKEN and PATTERN_TIKTOKEN_V2, the splits --tiktoken-pattern names
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
TIKTOKEN_VOCAB_SIZE = 2**17
"""TikTokenizer's vocabulary without --vocab-size (Megatron-LM's fallback, 131072)."""
TIKTOKEN_REQUIRED_SPECIALS = ("<unk>", "<s>", "</s>")
"""Special tokens every TikTokenizer has (Megatron-LM's default list; a given list needs them)."""


class TikTokenizer(_LocalTokenizer):
    """Megatron-LM's TikTokenizer (``CustomTikTokenizer``) from a local vocabulary file.

    Ids ``0 .. num_special_tokens-1`` are the special tokens (the given ones, then
    ``<SPECIAL_i>`` fillers), then the file's tokens in rank order, cut so that ``vocab_size``
    ids exist in all. ``eod`` is ``</s>``, ``bos`` is ``<s>``; there is no pad id (``-1``, as
    Megatron-LM's ``GPTDataset`` pads without one). Text is split by the ``--tiktoken-pattern``
    regex and encoded without special tokens (``"</s>"`` in a text is ordinary bytes).

    Args:
        path: ``--tokenizer-model``: a JSON list of ``{"rank", "token_bytes", "token_str"}``,
            rank ``i`` at index ``i``, ``token_bytes`` base64, the first 256 the single bytes.
        pattern: ``--tiktoken-pattern``: ``v1`` or ``v2``.
        vocab_size: ``--vocab-size``: ids in all, special tokens included (default 131072).
        num_special_tokens: ``--tiktoken-num-special-tokens``.
        special_tokens: ``--tiktoken-special-tokens``; empty: ``<unk> <s> </s>``.
    """

    def __init__(
        self,
        path: str,
        *,
        pattern: str,
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: Sequence[str] = (),
    ):
        super().__init__()
        import tiktoken

        self._vocab_size = vocab_size or TIKTOKEN_VOCAB_SIZE
        specials = _tiktoken_specials(special_tokens, num_special_tokens, self._vocab_size)
        ranks = _read_tiktoken_ranks(path, count=self._vocab_size - num_special_tokens)
        self._specials = {token: i for i, token in enumerate(specials)}
        self._model = tiktoken.Encoding(
            name=Path(path).parent.name,
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=self._specials,
        )
        self._files = (
            f"--tokenizer-model {path} --tiktoken-pattern {pattern} --vocab-size "
            f"{self._vocab_size} --tiktoken-num-special-tokens {num_special_tokens}"
        )

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._model.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[bytes | str, int]:
        """Token bytes (special tokens: their text) → id, as Megatron-LM's ``vocab``."""
        vocab: dict[bytes | str, int] = {
            self._model.decode_single_token_bytes(i): i
            for i in range(len(self._specials), self._vocab_size)
        }
        return vocab | self._specials

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._specials["</s>"]

    @property
    def bos(self) -> int:
        return self._specials["<s>"]

    @property
    def unk(self) -> int:
        return self._specials["<unk>"]

    @property
    def pad(self) -> int:
        """``-1``: no pad id (Megatron-LM's class has none; its ``GPTDataset`` then uses -1)."""
        return -1


def _tiktoken_specials(given: Sequence[str], count: int, vocab_size: int) -> list[str]:
    """The ``count`` special tokens: ``given`` (default ``<unk> <s> </s>``), then fillers."""
    specials = list(given) or list(TIKTOKEN_REQUIRED_SPECIALS)
    missing = [t for t in TIKTOKEN_REQUIRED_SPECIALS if t not in specials]
    if missing or len(set(specials)) != len(specials):
        raise ValueError(
            f"--tiktoken-special-tokens must list distinct tokens including "
            f"{' '.join(TIKTOKEN_REQUIRED_SPECIALS)}; got {' '.join(specials)}"
        )
    if not len(specials) <= count < vocab_size:
        raise ValueError(
            f"--tiktoken-num-special-tokens {count} must be at least the {len(specials)} special "
            f"tokens and below --vocab-size {vocab_size}"
        )
    fillers = [f"<SPECIAL_{i}>" for i in range(len(specials), count)]
    if set(fillers) & set(specials):
        raise ValueError(f"--tiktoken-special-tokens repeats a filler name <SPECIAL_i>: {specials}")
    return specials + fillers


def _read_tiktoken_ranks(path: str | None, *, count: int) -> dict[bytes, int]:
    """The first ``count`` tokens of a Megatron-LM tiktoken vocabulary file → their ranks."""
    if not path:
        raise ValueError(
            "TikTokenizer needs --tokenizer-model PATH, a local tiktoken vocabulary .json file"
        )
    if not Path(path).is_file():
        raise ValueError(
            f"--tokenizer-model {path} is not a file; give the local tiktoken vocabulary .json "
            "file TikTokenizer reads (nothing is downloaded)"
        )
    # fewer than the 256 byte tokens and tiktoken aborts on text with a byte it lacks
    if count < 256:
        raise ValueError(
            f"TikTokenizer: --vocab-size minus --tiktoken-num-special-tokens is {count}, fewer "
            "than the 256 byte tokens; raise --vocab-size"
        )
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))[:count]
        ranks = {_tiktoken_token(entry, rank): rank for rank, entry in enumerate(entries)}
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, ValueError) as err:
        raise ValueError(
            f"TikTokenizer: {path} is not a tiktoken vocabulary in Megatron-LM's format, a JSON "
            f'list of {{"rank": i, "token_bytes": base64, "token_str": text}} ({err})'
        ) from None
    if len(ranks) < len(entries):
        raise ValueError(f"TikTokenizer: {path} lists a token twice; give a valid vocabulary")
    if len(entries) < count:
        raise ValueError(
            f"TikTokenizer: {path} holds {len(entries)} tokens but --vocab-size minus "
            f"--tiktoken-num-special-tokens asks for {count}; lower --vocab-size to "
            f"{len(entries)} plus the special tokens"
        )
    return ranks


def _tiktoken_token(entry: dict, rank: int) -> bytes:
    if set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != rank:
        raise ValueError(f"entry {rank} is not {{rank: {rank}, token_bytes, token_str}}")
    try:
        token = base64.b64decode(entry["token_bytes"], validate=True)
    except binascii.Error:
        raise ValueError(f"entry {rank}'s token_bytes is not base64") from None
    if rank < 256 and token != bytes([rank]):
        raise ValueError(f"entry {rank} must be the single byte {rank} (ranks 0-255 are bytes)")
    return token


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
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: Sequence[str] = (),
) -> MegatronTokenizerBase:
    """Build a tokenizer by its ``--tokenizer-type`` name; nothing is ever downloaded.

    The trainer (:func:`tokenizer_for`) and ``tools/preprocess_data.py`` both build through
    here, so data and training agree on every id.

    Args:
        tokenizer_type: One of :data:`TOKENIZER_TYPES`.
        vocab_size: ``--vocab-size``; required by ``NullTokenizer``, ``TikTokenizer``'s size.
        tokenizer_model: ``--tokenizer-model``; a local ``tokenizer.json`` or its directory
            (``HuggingFaceTokenizer``), a SentencePiece ``tokenizer.model``
            (:data:`SENTENCEPIECE_TOKENIZERS`), a tiktoken vocabulary (``TikTokenizer``).
        vocab_file: ``--vocab-file`` (``GPT2BPETokenizer``).
        merge_file: ``--merge-file`` (``GPT2BPETokenizer``).
        tiktoken_pattern: ``--tiktoken-pattern`` ``v1`` or ``v2`` (``TikTokenizer``).
        tiktoken_num_special_tokens: ``--tiktoken-num-special-tokens`` (``TikTokenizer``).
        tiktoken_special_tokens: ``--tiktoken-special-tokens`` (``TikTokenizer``).

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
    if tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        return SENTENCEPIECE_TOKENIZERS[tokenizer_type](tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        if tiktoken_pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(
                f"TikTokenizer needs --tiktoken-pattern v1 or v2, got {tiktoken_pattern}."
            )
        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=tiktoken_special_tokens,
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
        return build_tokenizer(
            tokenizer_type=data.tokenizer_type,
            vocab_size=data.vocab_size,
            tokenizer_model=data.tokenizer_model,
            vocab_file=data.vocab_file,
            merge_file=data.merge_file,
            tiktoken_pattern=data.tiktoken_pattern,
            tiktoken_num_special_tokens=data.tiktoken_num_special_tokens,
            tiktoken_special_tokens=data.tiktoken_special_tokens,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
