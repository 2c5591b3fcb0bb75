"""Hugging Face tokenizer.json and GPT-2 BPE files: round trips, eod, errors, preprocessing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from memo_ext.config import TokenizerSpec
from memo_ext.data.preprocess import preprocess_jsonl
from memo_ext.data.tokenizers import build_tokenizer
from tests.launch import cli

TEXTS = ["def f(x):\n    return x * 2  # double", "naïve café — ünïcödé", "", "a" * 50]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A small byte-level BPE trained here on a few lines (nothing downloaded)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    directory = tmp_path_factory.mktemp("bpe")
    tok.save(str(directory / "tokenizer.json"))
    tok.model.save(str(directory))  # vocab.json + merges.txt
    return directory


@pytest.mark.parametrize("kind", ["file", "dir", "gpt2"])
def test_round_trip_and_eod(bpe_dir, kind):
    if kind == "gpt2":
        tok = build_tokenizer(
            TokenizerSpec(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=str(bpe_dir / "vocab.json"),
                merge_file=str(bpe_dir / "merges.txt"),
            )
        )
    else:
        path = bpe_dir / "tokenizer.json" if kind == "file" else bpe_dir
        tok = build_tokenizer(
            TokenizerSpec(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path))
        )
    for text in TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    vocab = json.loads((bpe_dir / "vocab.json").read_text())
    assert tok.eod == vocab["<|endoftext|>"]
    assert tok.vocab_size == len(vocab)
    assert len(tok.tokenize("a" * 50)) < 50  # merges are applied


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        build_tokenizer(
            TokenizerSpec(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
        )
    with pytest.raises(ValueError, match="--vocab-file .* is not a file"):
        build_tokenizer(
            TokenizerSpec(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=str(tmp_path / "v.json"),
                merge_file=str(tmp_path / "m.txt"),
            )
        )


@pytest.mark.parametrize("tokenizer_type", ["HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_preprocess_with_tokenizer_files(bpe_dir, tmp_path, tokenizer_type):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS if t))
    files = {
        "HuggingFaceTokenizer": {"tokenizer_model": str(bpe_dir / "tokenizer.json")},
        "GPT2BPETokenizer": {
            "vocab_file": str(bpe_dir / "vocab.json"),
            "merge_file": str(bpe_dir / "merges.txt"),
        },
    }[tokenizer_type]
    summary = preprocess_jsonl(
        input_path=corpus,
        output_prefix=str(tmp_path / "out"),
        append_eod=True,
        show_progress=False,
        tokenizer=TokenizerSpec(tokenizer_type=tokenizer_type, **files),
    )
    tok = build_tokenizer(TokenizerSpec(tokenizer_type=tokenizer_type, **files))
    dataset = IndexedDataset(summary.prefixes["text"])
    for i, text in enumerate(t for t in TEXTS if t):
        assert np.array_equal(dataset[i], np.array(tok.tokenize(text) + [tok.eod]))


def test_a_tokenizer_that_gives_no_token_is_named_not_the_text(tmp_path, capsys):
    from memo_ext.commands.preprocess_data import main

    # a BPE without byte fallback or unknown token drops every character outside its vocabulary
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=50, special_tokens=["</s>"])
    tok.train_from_iterator(["aaa bbb"] * 10, trainer=trainer)
    model = tmp_path / "tokenizer.json"
    tok.save(str(model))
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(model)]
    corpus = tmp_path / "c.jsonl"
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--no-progress", *flags]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["xyz", "", "hello world"]))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no document" not in err
    assert f"{' '.join(flags)} produced no tokens for any of the 2 texts" in err
    # no text at all is the other case, named as such
    corpus.write_text(json.dumps({"text": ""}) + "\n")
    assert main(argv) == 2
    assert "holds no document with text under --json-keys text" in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*"))  # nothing half-written is left


def test_trainer_flags_check_the_tokenizer(bpe_dir):
    from memo_ext.arguments import parse_args
    from memo_ext.errors import UsageError

    base = cli(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        seq_length=8,
        micro_batch_size=1,
        train_iters=1,
        lr=1,
        mock_data=True,
        tokenizer_type="HuggingFaceTokenizer",
    )
    with pytest.raises(UsageError, match="needs --tokenizer-model"):
        parse_args(base, world_size=1)
    with pytest.raises(UsageError, match="tokens but --vocab-size says 7"):
        parse_args([*base, "--tokenizer-model", str(bpe_dir), "--vocab-size", "7"], world_size=1)
    run = parse_args([*base, "--tokenizer-model", str(bpe_dir)], world_size=1)
    assert run.data.tokenizer_model == str(bpe_dir)


def test_gpt2_files_without_a_tokenizer_type_mean_gpt2_bpe(bpe_dir):
    """Megatron-LM's GPT-3 scripts give --vocab-file and --merge-file and no --tokenizer-type."""
    from memo_ext.arguments import parse_args
    from tests.launch import SMALL_GPT

    files = cli(vocab_file=bpe_dir / "vocab.json", merge_file=bpe_dir / "merges.txt")
    assert parse_args([*SMALL_GPT, *files], world_size=1).data.tokenizer_type == "GPT2BPETokenizer"
    bytes_run = parse_args([*SMALL_GPT, *files, "--tokenizer-type", "ByteTokenizer"], world_size=1)
    assert bytes_run.data.tokenizer_type == "ByteTokenizer"


def test_the_tokenizers_own_post_processor_adds_bos_as_transformers_does(bpe_dir, tmp_path):
    """A Llama-3-style tokenizer.json (a post-processor that starts every text with BOS):
    HuggingFaceTokenizer's ids equal transformers' tokenizer call, Megatron-LM's
    HuggingFaceTokenizer.tokenize; without such a post-processor no special token is added."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, processors

    tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|begin_of_text|>", special=True)])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"})
    )
    ours = build_tokenizer(
        TokenizerSpec(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    )
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs(text).input_ids
        assert ids[0] == bos == ours.bos
    plain = build_tokenizer(
        TokenizerSpec(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(bpe_dir))
    )
    assert plain.tokenize("") == []
