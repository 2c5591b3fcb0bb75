"""``TikTokenizer``: a local tiktoken vocabulary in Megatron-LM's JSON format, with the ids of
Megatron-LM's ``CustomTikTokenizer``, through the ``tiktoken`` package.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from pathlib import Path

from memo_ext.data.tokenizers.base import LocalTokenizer

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


class TikTokenizer(LocalTokenizer):
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
