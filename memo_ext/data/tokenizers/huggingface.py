"""Tokenizers of the ``tokenizers`` library: a local ``tokenizer.json`` (``HuggingFaceTokenizer``)
and GPT-2 byte-level BPE from ``vocab.json`` / ``merges.txt`` (``GPT2BPETokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from memo_ext.data.tokenizers.base import LocalTokenizer, find_eod, first_line

SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HuggingFaceTokenizer(LocalTokenizer):
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
                f"reads ({first_line(err)})"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        named = _named_special_tokens(file.parent)
        self._eod = (
            _named_id(vocab, named["eos_token"], file=file)
            if "eos_token" in named
            else find_eod(vocab, source=str(file))
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
        LocalTokenizer.__init__(self)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not Path(path).is_file():
                raise ValueError(f"GPT2BPETokenizer: {flag} {path} is not a file")
        try:
            self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own kinds
            raise ValueError(
                f"GPT2BPETokenizer: {vocab_file} and {merge_file} are not a GPT-2 vocab.json and "
                f"merges.txt ({first_line(err)})"
            ) from None
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._eod = find_eod(self._tok.get_vocab(with_added_tokens=True), source=vocab_file)
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
