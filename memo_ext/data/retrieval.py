"""Synthetic retrieval prompts, made with the run's own tokenizer: does the model use its context?

Two tasks, each a grid of (context length, depth) cells with a number of samples per cell:

- ``passkey``: a number of ``digits`` random digits stated once inside repeated filler sentences,
  asked for at the end (the passkey retrieval test of long-context work).
- ``needle``: a number stated once inside a haystack of the run's validation documents (the
  built-in filler sentences when the run has no validation data), asked for at the end
  (needle-in-a-haystack).

A sample is exactly ``length`` tokens with the answer's tokens last: ``tokens`` holds
``length + 1`` ids, a model reads ``tokens[:-1]`` and is scored on its predictions of the
answer, the last ``len(answer)`` labels. Depth is the share of the haystack before the statement:
0 puts it first, 1 right before the question. The number is tokenized once (``" 40719"``) and
the same ids stand in the statement and the answer, so a model that copies them is right
whatever its tokenizer makes of digits.

Samples depend only on (seed, task, length, depth, index): every rank builds the same ones, and
every evaluation of a run asks the same questions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from memo_ext.errors import UsageError

TASKS = ("passkey", "needle")

INTRO = "Remember the number hidden in this text."
FILLER = (
    "The river runs on to the sea.",
    "The hills stand quiet in the morning light.",
    "Birds cross the field and come back home.",
    "The wind moves the grass, and the grass moves back.",
)
STATEMENTS = {
    "passkey": (" The pass key is", "."),
    "needle": (" The magic number is", "."),
}
"""Per task, the text before and after the number where it is stated."""
QUESTIONS = {
    "passkey": " What is the pass key? The pass key is",
    "needle": " What is the magic number? The magic number is",
}


@dataclass(frozen=True)
class RetrievalSample:
    """One question: ``length`` tokens to read, the answer's ids last in ``tokens``."""

    task: str
    length: int
    depth: float
    tokens: np.ndarray
    """``length + 1`` ids: the prompt, then the answer."""
    answer_length: int
    """The answer's tokens: the last ``answer_length`` of ``tokens``."""

    @property
    def cell(self) -> str:
        return cell_name(self.length, self.depth)

    def batch(self) -> dict[str, np.ndarray]:
        """Inputs, labels, the answer's mask and positions, ``[1, length]`` each."""
        tokens = self.tokens.astype(np.int64)
        mask = np.zeros(self.length, dtype=np.float32)
        mask[self.length - self.answer_length :] = 1.0
        return {
            "tokens": tokens[None, :-1],
            "labels": tokens[None, 1:],
            "loss_mask": mask[None],
            "position_ids": np.arange(self.length, dtype=np.int64)[None],
        }


def cell_name(length: int, depth: float) -> str:
    """A grid cell's key in the metrics file: ``"4096@0.25"``."""
    return f"{length}@{depth:g}"


class PromptParts:
    """The task texts in one tokenizer's ids, tokenized once per evaluation."""

    def __init__(self, tokenize: Callable[[str], list[int]], *, digits: int):
        self.tokenize = tokenize
        self.digits = digits
        self.intro = tokenize(INTRO)
        self.sentences = [tokenize(" " + sentence) for sentence in FILLER]
        self.statements = {
            task: [tokenize(part) for part in parts] for task, parts in STATEMENTS.items()
        }
        self.questions = {task: tokenize(text) for task, text in QUESTIONS.items()}


def check_tokenizer(tokenize: Callable[[str], list[int]], detokenize, *, name: str) -> None:
    """The tokenizer writes text and every digit: ``" 0123456789"`` reads back with its digits
    in order (a word-level decoder may put spaces between them).

    Raises:
        UsageError: naming the tokenizer.
    """
    probe = " 0123456789"
    try:
        back = detokenize(tokenize(probe))
    except (ValueError, KeyError, TypeError, IndexError):
        back = None
    if back is None or "".join(c for c in back if c.isdigit()) != probe.strip():
        raise UsageError(
            f"--eval-retrieval-lengths needs a tokenizer that writes text with digits; {name} "
            f"reads {probe.strip()!r} back as {back!r}; give the tokenizer of a text model "
            "(--tokenizer-type)"
        )


def shortest_length(parts: PromptParts, *, task: str) -> int:
    """The fewest tokens ``task``'s prompt fits in: its intro, statement and question with the
    number twice (stated and asked) and no filler, the shortest ``length`` :func:`make_sample`
    takes. The number counts as the longest of a few probes (each digit repeated, the digits in
    order): exact for a tokenizer that writes every number of ``parts.digits`` digits in as many
    tokens (bytes, SentencePiece's single digits); ``make_sample`` still checks each prompt."""
    digits = parts.digits
    probes = [d * digits for d in "0123456789"] + [("0123456789" * digits)[:digits]]
    answer = max(len(parts.tokenize(" " + number)) for number in probes)
    before, after = parts.statements[task]
    fixed = len(parts.intro) + len(before) + len(after) + len(parts.questions[task])
    # length + 1 ids hold the fixed text and the answer twice (make_sample's room >= 0)
    return fixed + 2 * answer - 1


def make_sample(
    parts: PromptParts,
    *,
    task: str,
    length: int,
    depth: float,
    index: int,
    seed: int,
    haystack: Sequence[int] | None = None,
) -> RetrievalSample:
    """The ``index``-th sample of a cell. ``haystack`` (``needle`` only): token ids of the run's
    validation documents to hide the number in, at least the haystack's length; the filler
    sentences when ``None``.

    Raises:
        UsageError: ``length`` too short to hold the prompt's fixed text.
    """
    rng = random.Random(f"{seed}/{task}/{length}/{depth!r}/{index}")
    number = "".join(rng.choice("0123456789") for _ in range(parts.digits))
    answer = parts.tokenize(" " + number)
    before, after = parts.statements[task]
    statement = before + answer + after
    question = parts.questions[task]
    room = length + 1 - len(parts.intro) - len(statement) - len(question) - len(answer)
    if room < 0:
        raise UsageError(
            f"--eval-retrieval-lengths {length} is too short for the {task} prompt: its "
            f"question and answer take {length + 1 - room} tokens before any filler; give "
            f"lengths above {length + 1 - room}"
        )
    if task == "needle" and haystack is not None:
        start = rng.randrange(len(haystack) - room + 1)
        filler = list(haystack[start : start + room])
        cut = round(depth * room)
    else:
        filler, bounds = _sentences(parts.sentences, room, rng)
        cut = min(bounds, key=lambda bound: abs(bound - depth * room))
    ids = parts.intro + filler[:cut] + statement + filler[cut:] + question + answer
    return RetrievalSample(
        task=task,
        length=length,
        depth=depth,
        tokens=np.asarray(ids, dtype=np.int64),
        answer_length=len(answer),
    )


def _sentences(
    sentences: list[list[int]], room: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """``room`` tokens of filler sentences in a shuffled order and the sentence boundaries
    among them (offsets where a statement may go: 0 and ``room`` included). The first sentence
    is cut from the left to make the count exact."""
    stream: list[list[int]] = []
    total = 0
    while total < room:
        sentence = sentences[rng.randrange(len(sentences))]
        stream.append(sentence)
        total += len(sentence)
    filler = [token for sentence in stream for token in sentence][total - room :]
    bounds, offset = [0], -(total - room)
    for sentence in stream:
        offset += len(sentence)
        if offset > 0:
            bounds.append(offset)
    return filler, bounds
