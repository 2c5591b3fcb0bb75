"""Tokenizers: exact round trips, special ids, Megatron-compatible NullTokenizer, which types are
megatron-core's text tokenizer (and that the others do not load its library wrappers), vocab
padding."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.core.tokenizers import MegatronTokenizerBase

from memo_ext.config import TokenizerSpec
from memo_ext.config.data import TOKENIZER_TYPES
from memo_ext.data.tokenizers import (
    MODULES,
    ByteTokenizer,
    NullTokenizer,
    build_tokenizer,
    tokenizer_class,
)
from memo_ext.megatron_lm.flag_table import megatron_flags
from memo_ext.shapes import padded_vocab_size

DATA_DOCS = Path(__file__).resolve().parents[2] / "docs" / "data.md"

TEXTS = [
    "",
    "hello world",
    "tabs\tand\nnewlines\r\n",
    "héllo — ünïcödé, 日本語, emoji 🌍🚀, combining e\u0301",
    "\x00nul and \ufeffBOM",
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_exactly(text):
    tokenizer = build_tokenizer(TokenizerSpec(tokenizer_type="ByteTokenizer"))
    ids = tokenizer.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.detokenize(ids) == text


def test_byte_tokenizer_special_ids():
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, MegatronTokenizerBase)
    assert (tokenizer.eod, tokenizer.pad, tokenizer.vocab_size) == (256, -1, 257)
    assert len(tokenizer.vocab) == tokenizer.vocab_size
    # Special ids are dropped on decode; a cut multi-byte character does not raise.
    ids = tokenizer.tokenize("ab") + [tokenizer.eod] + tokenizer.tokenize("c")
    assert tokenizer.detokenize(ids) == "abc"
    assert tokenizer.detokenize(tokenizer.tokenize("é")[:1]) == "\ufffd"


def test_null_tokenizer_matches_megatron():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import (
        NullTokenizer as MegatronNull,
    )

    ours = build_tokenizer(TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=1000))
    theirs = MegatronNull(1000)
    assert isinstance(ours, NullTokenizer)
    assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size) == (1000, 1001)
    text = "5 17 999 0"
    assert ours.tokenize(text) == theirs.text_to_ids(text) == [5, 17, 999, 0]
    assert ours.detokenize([5, 17, 999, 0]) == theirs.ids_to_text([5, 17, 999, 0]) == text
    assert ours.tokenize("") == []
    assert ours.tokenize(" 1\n2  3 ") == [1, 2, 3]
    vocab = ours.vocab
    assert len(vocab) == ours.vocab_size and vocab["999"] == 999 and vocab["1000"] == ours.eod
    assert [vocab[field] for field in text.split()] == ours.tokenize(text)


def test_where_megatron_lms_ids_agree_the_tokenizer_is_megatron_cores():
    from megatron.core.tokenizers.text import MegatronTokenizerText

    theirs = {t for t in MODULES if issubclass(tokenizer_class(t), MegatronTokenizerText)}
    assert theirs == {"NullTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"}
    assert all(issubclass(tokenizer_class(t), MegatronTokenizerBase) for t in TOKENIZER_TYPES)
    assert list(MODULES) == list(TOKENIZER_TYPES)
    null = build_tokenizer(TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=10))
    assert null.description == "--tokenizer-type NullTokenizer --vocab-size 10"


_BYTE_RUN = """
import sys
from memo_ext.config import TokenizerSpec
from memo_ext.data.tokenizers import build_tokenizer
build_tokenizer(TokenizerSpec(tokenizer_type="ByteTokenizer")).tokenize("x")
names = ("megatron.core.tokenizers.text.libraries", "transformers", "sentencepiece", "tiktoken")
print(sorted(m for m in sys.modules if m.split(".")[0] in names or m.startswith(names[0])))
"""


def test_a_byte_tokenizer_run_loads_no_library_wrapper():
    # megatron-core's wrappers (and transformers with them) load with the types that use them
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _BYTE_RUN], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]"


def test_null_tokenizer_rejects_bad_ids():
    tokenizer = build_tokenizer(TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=10))
    with pytest.raises(ValueError, match="outside"):
        tokenizer.tokenize("1 11")
    with pytest.raises(ValueError, match="integer ids"):
        tokenizer.tokenize("1 two")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(TokenizerSpec(tokenizer_type="NullTokenizer"))


def test_unknown_tokenizer_type_lists_valid_types():
    with pytest.raises(ValueError, match="ByteTokenizer, NullTokenizer, HuggingFaceTokenizer"):
        build_tokenizer(TokenizerSpec(tokenizer_type="BertWordPieceCase"))


def test_the_data_docs_name_every_tokenizer_type():
    """docs/data.md's table has a row per type built here, in order; its text names each of
    Megatron-LM's other types, which are refused."""
    section = DATA_DOCS.read_text().split("## Tokenizers")[1].split("\n## ")[0]
    assert re.findall(r"^\| `(\w+)`", section, flags=re.MULTILINE) == list(TOKENIZER_TYPES)
    refused = [t for t in megatron_flags()["--tokenizer-type"].choices if t not in TOKENIZER_TYPES]
    assert refused and [t for t in refused if f"`{t}`" not in section] == []


def test_unique_identifiers_distinguish_tokenizers():
    a = build_tokenizer(
        TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=10)
    ).unique_identifiers
    b = build_tokenizer(
        TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=11)
    ).unique_identifiers
    c = build_tokenizer(TokenizerSpec(tokenizer_type="ByteTokenizer")).unique_identifiers
    assert len({str(a), str(b), str(c)}) == 3


@pytest.mark.parametrize(
    "vocab_size, divisible_by, tp_size, expected",
    [
        (258, 128, 1, 384),
        (256, 128, 1, 256),
        (50257, 128, 1, 50304),
        (50257, 128, 8, 51200),
        (1, 1, 1, 1),
        (1001, 64, 2, 1024),
    ],
)
def test_padded_vocab_size(vocab_size, divisible_by, tp_size, expected):
    got = padded_vocab_size(vocab_size, divisible_by=divisible_by, tp_size=tp_size)
    assert got == expected
    assert got % (divisible_by * tp_size) == 0 and got - vocab_size < divisible_by * tp_size


def test_the_estimator_pads_the_vocabulary_as_the_trainer_does():
    """One rule, lcm(--make-vocab-size-divisible-by, every TP degree): the trainer's resolution
    and the estimator price the same embedding rows (Megatron-LM's 128 × TP is its own, read
    only from its checkpoints)."""
    from types import SimpleNamespace

    from memo_ext.estimate.cost_model import params_per_gpu
    from memo_ext.parallel import ParallelLayout
    from memo_ext.shapes import embedding_rows, model_shape

    assert embedding_rows(50257, tp_sizes=(8,)) == 50304  # Megatron-LM's rule: 51,200
    assert embedding_rows(50257, tp_sizes=(8, 3)) == 50304  # a multiple of lcm(128, 8, 3) = 384
    assert embedding_rows(1001, divisible_by=64, tp_sizes=(3,)) == 1152
    layer, layout = SimpleNamespace(param_count=0), ParallelLayout(tp=8)

    def rows(vocab_size: int) -> int:
        shape = model_shape("gpt-7b", vocab_size=vocab_size, position_embedding_type="rope")
        return (params_per_gpu(shape, layout, layer, 1024) - 2 * 4096) * 8 // 4096

    # 50,305 tokens take 50,432 rows here; under Megatron-LM's rule both sizes take 51,200
    assert rows(50257) == 50304 and rows(50305) == 50432
