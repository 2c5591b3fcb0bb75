"""What every tokenizer here shares (:class:`TokenizerFace`: how messages name it, what
identifies it in megatron-core's dataset cache, no chat template), the base of those without a
megatron-core library behind them (:class:`LocalTokenizer`), and how an end-of-document id is found
in a vocabulary.
"""

from __future__ import annotations

from collections import OrderedDict

from megatron.core.tokenizers import MegatronTokenizerBase


class TokenizerFace:
    """What this package adds to megatron-core's tokenizer classes; listed first among a
    tokenizer's bases, so that its members win over megatron-core's."""

    _files = ""
    """The flags naming the files it was read from (``--tokenizer-model PATH``), for messages."""

    def apply_chat_template(self, *args, **kwargs):
        """Chat templates are not supported by pretraining tokenizers."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template.")

    @property
    def description(self) -> str:
        """The tokenizer as its flags name it, for messages: ``--tokenizer-type NAME`` and the
        files or sizes it was built from."""
        return f"--tokenizer-type {type(self).__name__} {self._files}".rstrip()

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies this tokenizer in megatron-core's dataset cache descriptions: its class
        and vocabulary size."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("vocab_size", self.vocab_size),
            ]
        )


class LocalTokenizer(TokenizerFace, MegatronTokenizerBase):
    """A tokenizer of this package's own: megatron-core's ``MegatronTokenizerBase`` with nothing
    downloaded."""

    def __init__(self) -> None:
        super().__init__(path="", config={})


EOD_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")

# Beside a tokenizer.json: the files where Hugging Face exports name their special tokens (which
# one wins: ``_named_special_tokens``).


def find_eod(vocab: dict[str, int], *, source: str) -> int:
    for name in EOD_TOKEN_NAMES:
        if name in vocab:
            return vocab[name]
    raise ValueError(
        f"{source} has no end-of-text token (looked for {', '.join(EOD_TOKEN_NAMES)}); "
        "add one to the tokenizer"
    )


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
