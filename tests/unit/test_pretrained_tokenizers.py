"""A pretrained model's tokenizers (SentencePiece, tiktoken, a Hugging Face export's config):
ids against Megatron-LM's own classes, round trips, preprocessing, Hugging Face BOS / EOS, errors.

Every tokenizer file is made here (nothing downloaded). Megatron-LM's classes are read from its
source at ``$MEGATRON_LM`` (default ``/tmp/megatron-lm``, as in
``tests/dist/test_checkpoint_finetune.py``).
"""

from __future__ import annotations

import ast
import base64
import collections
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDataset

from memo_ext.arguments import parse_args
from memo_ext.commands.preprocess_data import main as preprocess_main
from memo_ext.config import TokenizerSpec
from memo_ext.data.tokenizers import SENTENCEPIECE_TOKENIZERS, build_tokenizer
from memo_ext.errors import UsageError
from tests.launch import SMALL_GPT

MEGATRON_LM = os.environ.get("MEGATRON_LM", "/tmp/megatron-lm")
ROOT = Path(__file__).resolve().parents[2]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "hello world, this is a test of 123 numbers and 4567 more",
    "naïve café: ünïcödé text, déjà vu",
    "Sphinx of black quartz, judge my vow.",
]
"""What the SentencePiece models are trained on (round trips use these characters only)."""

TEXTS = [
    *CORPUS,
    "",
    "  leading and   repeated spaces\nand a newline",
    "specials inside: <s> x </s> <EOD> y<SEP><CLS> <PAD> <MASK> <unk>",
    "unseen characters 🌍 日本語 ~{}",
]
"""What ids are compared on: special tokens' texts and characters no model has seen included."""

TIKTOKEN_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


# ---- tokenizer files made here ---------------------------------------------------------------


def _train_sentencepiece(path: Path, **options: object) -> Path:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=model,
        vocab_size=80,
        hard_vocab_limit=False,  # a corpus this small holds fewer pieces than asked for
        minloglevel=2,
        num_threads=1,
        **options,
    )
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module", params=["plain", "with_pad"])
def sp_model(request, tmp_path_factory) -> Path:
    """A unigram model without a pad piece (Llama's setting) and a BPE model with one."""
    folder = tmp_path_factory.mktemp("sp")
    if request.param == "plain":
        return _train_sentencepiece(folder / "tokenizer.model")
    return _train_sentencepiece(folder / "tokenizer.model", model_type="bpe", pad_id=3)


def _bpe_merges(texts: list[str], count: int) -> list[bytes]:
    """``count`` byte-pair merges learned greedily from ``texts`` (ties: the smaller pair)."""
    words = [[bytes([b]) for b in text.encode()] for text in texts]
    merges: list[bytes] = []
    for _ in range(count):
        pairs = collections.Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best[0] + best[1])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [best[0] + best[1]]
                i += 1
    return merges


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory) -> Path:
    """Megatron-LM's tiktoken vocabulary format: the 256 bytes, then 40 merges."""
    tokens = [bytes([i]) for i in range(256)] + _bpe_merges(CORPUS * 3, 40)
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode(),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for rank, token in enumerate(tokens)
    ]
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.json"
    path.write_text(json.dumps(entries))
    return path


TIKTOKEN_FILE_TOKENS = 296
"""256 bytes and 40 merges."""


def _tiktoken_options(pattern: str, specials: list[str] | None) -> dict:
    num_special = 10 if specials is None else len(specials) + 3
    return {
        "pattern": pattern,
        "num_special_tokens": num_special,
        "special_tokens": specials,
        "vocab_size": TIKTOKEN_FILE_TOKENS + num_special,
    }


# ---- Megatron-LM's own classes ---------------------------------------------------------------


class _DropTrainingImports(ast.NodeTransformer):
    """Megatron-LM's ``megatron.training`` package imports triton and its whole trainer on
    import; the tokenizer classes need from it only ``print_rank_0`` (given as a no-op) and
    their sibling modules (BERT, multimodal, SFT), which these classes never call."""

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if node.level or (node.module or "").startswith("megatron.training"):
            return ast.Pass()
        return node


@pytest.fixture(scope="module")
def megatron_lm() -> dict:
    """The names of Megatron-LM's ``megatron/training/tokenizer/tokenizer.py``, run from its
    source (its base class comes from the installed megatron-core 0.16, the same file)."""
    source = Path(MEGATRON_LM) / "megatron" / "training" / "tokenizer" / "tokenizer.py"
    if not source.is_file():
        pytest.skip(f"no Megatron-LM checkout at {MEGATRON_LM} (set MEGATRON_LM)")
    tree = _DropTrainingImports().visit(ast.parse(source.read_text()))
    names = {"__name__": "megatron_lm_tokenizer", "print_rank_0": lambda *args, **kwargs: None}
    exec(compile(ast.fix_missing_locations(tree), str(source), "exec"), names)
    return names


def _megatron_lm_tokenizer(megatron_lm: dict, tokenizer_type: str, path: Path, **options):
    if tokenizer_type == "TikTokenizer":
        pattern = {"v1": "PATTERN_TIKTOKEN", "v2": "PATTERN_TIKTOKEN_V2"}[options.pop("pattern")]
        return megatron_lm["CustomTikTokenizer"](str(path), pattern=megatron_lm[pattern], **options)
    name = {
        "SentencePieceTokenizer": "_SentencePieceTokenizer",
        "GPTSentencePieceTokenizer": "_GPTSentencePieceTokenizer",
        "Llama2Tokenizer": "_Llama2Tokenizer",
    }[tokenizer_type]
    return megatron_lm[name](str(path))


def _pad_of(tokenizer) -> int:
    """The pad id megatron-core's GPTDataset uses with ``tokenizer``: -1 where it has none."""
    try:
        return tokenizer.pad
    except AttributeError:  # Megatron-LM's Llama2Tokenizer and CustomTikTokenizer have none
        return -1


def _bos_of(tokenizer) -> int:
    try:
        return tokenizer.bos
    except AttributeError:  # Megatron-LM's Llama2Tokenizer keeps it in bos_id, not _bos_id
        return tokenizer.bos_id


def _assert_same_ids(ours, theirs) -> None:
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.tokenize(text), text
        ids = theirs.tokenize(text)
        assert ours.detokenize(ids) == theirs.detokenize(ids), text
    assert (ours.eod, ours.bos, ours.vocab_size) == (theirs.eod, _bos_of(theirs), theirs.vocab_size)
    assert ours.pad == _pad_of(theirs)
    assert ours.vocab == theirs.vocab


# ---- ids against Megatron-LM -----------------------------------------------------------------


@pytest.mark.parametrize("tokenizer_type", list(SENTENCEPIECE_TOKENIZERS))
def test_sentencepiece_ids_equal_megatron_lms(megatron_lm, sp_model, tokenizer_type):
    ours = build_tokenizer(
        TokenizerSpec(tokenizer_type=tokenizer_type, tokenizer_model=str(sp_model))
    )
    _assert_same_ids(ours, _megatron_lm_tokenizer(megatron_lm, tokenizer_type, sp_model))


@pytest.mark.parametrize("specials", [None, TIKTOKEN_SPECIALS], ids=["default", "listed"])
@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_ids_equal_megatron_lms(megatron_lm, tiktoken_file, pattern, specials):
    options = _tiktoken_options(pattern, specials)
    ours = build_tokenizer(
        TokenizerSpec(
            tokenizer_type="TikTokenizer",
            tokenizer_model=str(tiktoken_file),
            vocab_size=options["vocab_size"],
            tiktoken_pattern=pattern,
            tiktoken_num_special_tokens=options["num_special_tokens"],
            tiktoken_special_tokens=specials or (),
        )
    )
    theirs = _megatron_lm_tokenizer(megatron_lm, "TikTokenizer", tiktoken_file, **options)
    _assert_same_ids(ours, theirs)


# ---- what each type does, by hand ------------------------------------------------------------


def test_sentencepiece_types_by_hand(sp_model):
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    pieces = len(processor)
    build = lambda kind: build_tokenizer(
        TokenizerSpec(tokenizer_type=kind, tokenizer_model=str(sp_model))
    )
    gpt, llama = build("GPTSentencePieceTokenizer"), build("Llama2Tokenizer")
    megatron = build("SentencePieceTokenizer")
    text = CORPUS[0]
    assert gpt.tokenize(text) == processor.encode_as_ids(text)
    assert llama.tokenize(text) == [processor.bos_id(), *processor.encode_as_ids(text)]
    assert llama.tokenize("") == [processor.bos_id()]
    assert gpt.eod == llama.eod == processor.eos_id()
    assert gpt.vocab_size == llama.vocab_size == pieces
    assert (gpt.pad, llama.pad) == (processor.pad_id(), -1)
    # Megatron's four, and <PAD> where the model has no pad piece, follow the model's pieces
    added = 4 + (processor.pad_id() < 0)
    assert megatron.vocab_size == pieces + added
    assert megatron.eod == megatron.vocab["<EOD>"] == pieces + 2
    assert megatron.tokenize("a<EOD>b") == [
        *processor.encode_as_ids("a"),
        megatron.eod,
        *processor.encode_as_ids("b"),
    ]


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_a_gpt_sentencepiece_tokenizer_has_no_bert_tokens(sp_model, tokenizer_type):
    tokenizer = build_tokenizer(
        TokenizerSpec(tokenizer_type=tokenizer_type, tokenizer_model=str(sp_model))
    )
    assert not any(hasattr(tokenizer, name) for name in ("cls", "sep", "mask", "cls_id"))


@pytest.mark.parametrize("tokenizer_type", list(SENTENCEPIECE_TOKENIZERS))
def test_sentencepiece_round_trip(sp_model, tokenizer_type):
    tokenizer = build_tokenizer(
        TokenizerSpec(tokenizer_type=tokenizer_type, tokenizer_model=str(sp_model))
    )
    for text in CORPUS:  # the model's own characters, single spaces: nothing is normalised away
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_tiktoken_round_trips_any_text(tiktoken_file):
    options = _tiktoken_options("v2", None)
    tokenizer = build_tokenizer(
        TokenizerSpec(
            tokenizer_type="TikTokenizer",
            tokenizer_model=str(tiktoken_file),
            vocab_size=options["vocab_size"],
            tiktoken_pattern="v2",
            tiktoken_num_special_tokens=options["num_special_tokens"],
        )
    )
    for text in TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos, tokenizer.pad) == (306, 2, 1, -1)
    assert tokenizer.tokenize("a") == [10 + ord("a")]  # the file's ranks follow the 10 specials
    assert len(tokenizer.tokenize(CORPUS[0])) < len(CORPUS[0])  # merges are applied


# ---- preprocessing ---------------------------------------------------------------------------


def _tokenizer_flags(tokenizer_type: str, sp_model: Path, tiktoken_file: Path) -> list[str]:
    if tokenizer_type != "TikTokenizer":
        return ["--tokenizer-type", tokenizer_type, "--tokenizer-model", str(sp_model)]
    return [
        *("--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_file)),
        *("--tiktoken-pattern", "v1", "--vocab-size", str(TIKTOKEN_FILE_TOKENS + 7)),
        *("--tiktoken-num-special-tokens", "7", "--tiktoken-special-tokens", *TIKTOKEN_SPECIALS),
    ]


@pytest.mark.parametrize("tokenizer_type", [*SENTENCEPIECE_TOKENIZERS, "TikTokenizer"])
def test_preprocess_writes_the_tokenizers_ids(tmp_path, sp_model, tiktoken_file, tokenizer_type):
    """The tool and the trainer build the tokenizer from the same flags and agree on each id."""
    texts = [t for t in TEXTS if t]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    flags = _tokenizer_flags(tokenizer_type, sp_model, tiktoken_file)
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--no-progress"]
    assert preprocess_main([*argv, *flags, "--append-eod", "--workers", "2"]) == 0
    trainer = parse_args([*SMALL_GPT, *flags], world_size=1)
    from memo_ext.data.tokenizers import tokenizer_for

    tokenizer = tokenizer_for(trainer.data)
    dataset = IndexedDataset(str(tmp_path / "o_text_document"))
    assert len(dataset) == len(texts)
    for i, text in enumerate(texts):
        assert dataset[i].tolist() == [*tokenizer.tokenize(text), tokenizer.eod]


# ---- Hugging Face BOS / EOS from the export's config files ------------------------------------


@pytest.fixture()
def hf_dir(tmp_path) -> Path:
    """A word-level tokenizer.json with three special tokens, ``<|endoftext|>`` first (what the
    name search alone would take as end of document)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "<s>", "</s>", "<unk>", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def _hf(path: Path):
    return build_tokenizer(
        TokenizerSpec(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path))
    )


def test_hf_bos_and_eos_come_from_tokenizer_config(hf_dir):
    assert (_hf(hf_dir).eod, _hf(hf_dir).bos) == (0, None)  # no config: the name search
    # transformers writes a token as its text or as an AddedToken's fields
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert (_hf(hf_dir).eod, _hf(hf_dir).bos) == (2, 1)
    assert _hf(hf_dir / "tokenizer.json").eod == 2  # the file's folder is read, too


ADDED = {
    str(i): {"content": w, "special": True, "lstrip": False, "rstrip": False}
    | {"normalized": False, "single_word": False}
    for i, w in enumerate(["<|endoftext|>", "<s>", "</s>"])
}


@pytest.mark.parametrize(
    "config, special_map",
    [
        # older exports: special_tokens_map.json wins, tokenizer_config.json fills the rest
        ({"bos_token": "<s>", "eos_token": "</s>"}, {"eos_token": "<|endoftext|>"}),
        ({"eos_token": "</s>"}, {"bos_token": "<s>"}),
        ({}, {"bos_token": "<|endoftext|>", "eos_token": "</s>"}),
        # current exports (added_tokens_decoder): tokenizer_config.json alone
        ({"eos_token": "</s>", "added_tokens_decoder": ADDED}, {"bos_token": "<|endoftext|>"}),
        (
            {"bos_token": "<s>", "eos_token": "</s>", "added_tokens_decoder": ADDED},
            {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        ),
    ],
)
def test_hf_bos_and_eos_as_transformers_reads_them(hf_dir, config, special_map):
    transformers = pytest.importorskip("transformers")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "special_tokens_map.json").write_text(json.dumps(special_map))
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ours = _hf(hf_dir)
    assert ours.bos == reference.bos_token_id
    assert ours.eod == reference.eos_token_id


def test_hf_config_naming_a_token_the_tokenizer_lacks_is_refused(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"names the special token '<\|im_end\|>', which"):
        _hf(hf_dir)
    (hf_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        _hf(hf_dir)


# ---- bad input: one sentence -----------------------------------------------------------------


@pytest.mark.parametrize("tokenizer_type", list(SENTENCEPIECE_TOKENIZERS))
def test_bad_sentencepiece_files_fail_in_one_sentence(tmp_path, tokenizer_type):
    build = lambda path: build_tokenizer(
        TokenizerSpec(tokenizer_type=tokenizer_type, tokenizer_model=path)
    )
    with pytest.raises(ValueError, match="needs --tokenizer-model PATH"):
        build(None)
    with pytest.raises(ValueError, match=r"missing.model is not a file; give the local"):
        build(str(tmp_path / "missing.model"))
    (tmp_path / "text.model").write_text("not a model\n")
    with pytest.raises(
        ValueError, match=rf"^{tokenizer_type}: .*text.model is not a SentencePiece"
    ):
        build(str(tmp_path / "text.model"))
    flags = ["--tokenizer-type", tokenizer_type, "--tokenizer-model", str(tmp_path / "text.model")]
    with pytest.raises(UsageError, match="is not a SentencePiece model") as err:
        parse_args([*SMALL_GPT, *flags], world_size=1)
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match=f"--tokenizer-type {tokenizer_type} needs --tokenizer"):
        parse_args([*SMALL_GPT, "--tokenizer-type", tokenizer_type], world_size=1)


def test_a_model_without_the_pieces_a_type_needs_is_refused(tmp_path):
    model = _train_sentencepiece(tmp_path / "no_bos_eos.model", bos_id=-1, eos_id=-1)
    with pytest.raises(ValueError, match="has no end-of-sentence piece"):
        build_tokenizer(
            TokenizerSpec(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(model))
        )
    model = _train_sentencepiece(tmp_path / "no_bos.model", bos_id=-1)
    with pytest.raises(ValueError, match="has no beginning-of-sentence piece"):
        build_tokenizer(TokenizerSpec(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(model)))
    # Megatron-LM's SentencePieceTokenizer adds <BOS> / <EOS> itself
    tokenizer = build_tokenizer(
        TokenizerSpec(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model))
    )
    assert tokenizer.bos == tokenizer.vocab["<BOS>"]


def test_bad_tiktoken_settings_fail_in_one_sentence(tmp_path, tiktoken_file):
    def build(path=tiktoken_file, **options):
        settings = {"tiktoken_pattern": "v2", "tiktoken_num_special_tokens": 10}
        settings |= {"vocab_size": TIKTOKEN_FILE_TOKENS + 10} | options
        return build_tokenizer(
            TokenizerSpec(tokenizer_type="TikTokenizer", tokenizer_model=str(path), **settings)
        )

    with pytest.raises(ValueError, match="needs --tiktoken-pattern v1 or v2, got None"):
        build(tiktoken_pattern=None)
    with pytest.raises(ValueError, match="missing.json is not a file"):
        build(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps([{"rank": 0, "token_bytes": "AA=="}]))
    with pytest.raises(ValueError, match="bad.json is not a tiktoken vocabulary in Megatron-LM"):
        build(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="holds 296 tokens but --vocab-size minus"):
        build(vocab_size=TIKTOKEN_FILE_TOKENS + 11)
    with pytest.raises(ValueError, match="fewer than the 256 byte tokens"):
        build(vocab_size=200)
    with pytest.raises(ValueError, match="must list distinct tokens including <unk> <s> </s>"):
        build(tiktoken_special_tokens=["<s>", "</s>"])
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_file)]
    with pytest.raises(UsageError, match="needs --tiktoken-pattern v1 or v2"):
        parse_args([*SMALL_GPT, *flags], world_size=1)


# ---- start-up ----------------------------------------------------------------------------------

_PROBE = """
import contextlib, io, runpy, sys
for target in ("pretrain_gpt_memo.py", "tools/preprocess_data.py"):
    sys.argv = [target, "--help"]
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(target, run_name="__main__")
        except SystemExit:
            pass
libraries = ("megatron", "sentencepiece", "tiktoken")
print(sorted(m for m in sys.modules if m.split(".")[0] in libraries))
"""


def test_help_imports_no_tokenizer_library():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]"
