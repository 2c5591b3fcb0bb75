"""A corpus where the retrieval task appears, and a word-level tokenizer for it: a tiny model
learns to copy the number from it in a few hundred CPU steps (a byte-level one takes thousands).

The tokenizer's vocabulary is the prompts' own words, punctuation and the ten digits, one token
each (``tokenizers``' WordLevel); the corpus is prompts of the evaluation's own format (its
texts, random numbers and depths), at lengths around the ones the tests evaluate.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

from memo_ext.data import retrieval

ROOT = Path(__file__).resolve().parents[1]


def word_tokenizer(path: Path) -> Path:
    """Write a WordLevel ``tokenizer.json`` over the prompts' words to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    texts = [retrieval.INTRO, *retrieval.FILLER, *retrieval.QUESTIONS.values()]
    texts += [part for parts in retrieval.STATEMENTS.values() for part in parts]
    words = sorted(set(re.findall(r"\w+|[^\w\s]", " ".join(texts))) - set("0123456789"))
    names = ["[UNK]", "<|endoftext|>", *"0123456789", *words]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.decoder = decoders.WordPiece()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def task_corpus(
    folder: Path, *, digits: int, documents: int = 4000, seed: int = 987654
) -> list[str]:
    """Tokenizer and indexed dataset of ``documents`` prompts with their answers in ``folder``;
    the flags that train on them."""
    from memo_ext.data.tokenizers.huggingface import HuggingFaceTokenizer

    tokenizer_file = word_tokenizer(folder / "tokenizer.json")
    tokenizer = HuggingFaceTokenizer(str(tokenizer_file))
    parts = retrieval.PromptParts(tokenizer.tokenize, digits=digits)
    rng = random.Random(seed)
    with open(folder / "corpus.jsonl", "w") as out:
        for index in range(documents):
            sample = retrieval.make_sample(
                parts,
                task=rng.choice(retrieval.TASKS),
                length=rng.choice([48, 64, 80]),
                depth=rng.random(),
                index=index,
                seed=seed,
            )
            text = tokenizer.detokenize(sample.tokens.tolist())
            out.write(json.dumps({"text": text}) + "\n")
    tokenizer_flags = [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_file),
    ]  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "tools.preprocess_data", "--input", str(folder / "corpus.jsonl"),
         "--output-prefix", str(folder / "corpus"), *tokenizer_flags, "--append-eod",
         "--no-progress"],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return ["--data-path", str(folder / "corpus_text_document"), *tokenizer_flags]
