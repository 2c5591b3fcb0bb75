"""Retrieval evaluation: the prompts, the greedy scoring in the model, and the accuracies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memo_ext.data.retrieval import PromptParts, check_tokenizer, make_sample
from memo_ext.data.tokenizers.local import ByteTokenizer, NullTokenizer
from memo_ext.errors import UsageError
from memo_ext.mcore.gpt import greedy_hits
from memo_ext.training.retrieval import accuracy
from tests.unit.test_chunked_loss import SEQ, VOCAB, build

BYTES = ByteTokenizer()


def parts(digits: int = 5) -> PromptParts:
    return PromptParts(BYTES.tokenize, digits=digits)


@pytest.mark.parametrize("task", ["passkey", "needle"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_a_prompt_is_its_length_and_asks_for_the_number_it_states(task, depth):
    sample = make_sample(parts(), task=task, length=300, depth=depth, index=3, seed=1)
    assert sample.tokens.shape == (301,)
    text = BYTES.detokenize(sample.tokens.tolist())
    answer = BYTES.detokenize(sample.tokens[-sample.answer_length :].tolist())
    assert answer[0] == " " and answer[1:].isdigit() and len(answer) == 6
    # stated once in the haystack, asked for at the end
    assert text.count(answer) == 2 and text.endswith(" is" + answer)
    batch = sample.batch()
    assert batch["tokens"].shape == batch["labels"].shape == (1, 300)
    np.testing.assert_array_equal(batch["labels"][0, -sample.answer_length :], sample.tokens[-6:])
    assert batch["loss_mask"].sum() == sample.answer_length
    assert batch["loss_mask"][0, -sample.answer_length :].all()


def test_depth_moves_the_statement_through_the_filler():
    where = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        sample = make_sample(parts(), task="passkey", length=600, depth=depth, index=0, seed=1)
        text = BYTES.detokenize(sample.tokens.tolist())
        where.append(text.index(" The pass key is") / len(text))
    assert where == sorted(where) and where[0] < 0.1 and where[-1] > 0.8, where


def test_needle_hides_in_the_given_haystack_at_its_depth():
    haystack = list(range(300, 340)) * 20  # ids no prompt text uses
    sample = make_sample(
        parts(), task="needle", length=500, depth=0.5, index=0, seed=2, haystack=haystack
    )
    ids = sample.tokens.tolist()
    filler = [i for i in ids if i >= 300]
    assert len(filler) > 300  # everything but the prompt's own text is haystack
    statement = BYTES.tokenize(" The magic number is")
    start = next(k for k in range(len(ids)) if ids[k : k + len(statement)] == statement)
    before = sum(1 for i in ids[:start] if i >= 300)
    assert abs(before / len(filler) - 0.5) < 0.01


def test_samples_are_the_same_for_the_same_cell_and_seed_and_differ_otherwise():
    def number(**kw):
        args = {"task": "passkey", "length": 200, "depth": 0.5, "index": 0, "seed": 1} | kw
        sample = make_sample(parts(), **args)
        return BYTES.detokenize(sample.tokens[-sample.answer_length :].tolist())

    assert number() == number()
    assert len({number(index=i) for i in range(20)}) > 15
    assert number(seed=2) != number() or number(seed=3) != number()


def test_a_length_too_short_for_the_prompt_says_how_long_it_must_be():
    with pytest.raises(UsageError, match=r"--eval-retrieval-lengths 64 is too short .* above \d+"):
        make_sample(parts(), task="passkey", length=64, depth=0.5, index=0, seed=1)


def test_a_tokenizer_that_cannot_write_digits_is_refused_by_name():
    null = NullTokenizer(vocab_size=100)
    with pytest.raises(UsageError, match="NullTokenizer"):
        check_tokenizer(null.tokenize, null.detokenize, name="--tokenizer-type NullTokenizer")

    def no_digits(text):
        return [ord(c) for c in text if not c.isdigit()]

    with pytest.raises(UsageError, match="writes text with digits"):
        check_tokenizer(no_digits, lambda ids: "".join(map(chr, ids)), name="letters")
    check_tokenizer(BYTES.tokenize, BYTES.detokenize, name="bytes")


def test_greedy_hits_follow_torch_argmax_first_of_equal_maxima(megatron_cpu):
    """A hand-made case: ties go to the lowest id (torch.argmax's rule), and ids at or past the
    real vocabulary (the table's padding rows) are never the answer."""
    import torch.distributed as dist

    group = dist.group.WORLD
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 9.0],  # padding id 3 is largest: the answer is id 1
            [2.0, 2.0, 1.0, 0.0],  # a tie between 0 and 1: argmax is 0
            [0.0, 1.0, 5.0, 0.0],
        ]
    )
    labels = torch.tensor([1, 1, 2])
    assert greedy_hits(logits, labels, group, vocab_size=3).tolist() == [True, False, True]
    assert torch.argmax(logits[:, :3], dim=-1).tolist() == [1, 0, 2]


def test_the_scoring_model_answers_as_a_greedy_decoder(megatron_cpu):
    """One forward pass under greedy_scoring: per token, whether the label is the argmax of the
    plain model's logits; and a prompt is right exactly when step-by-step greedy decoding writes
    its answer."""
    model = build(3).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        logits = model(tokens, positions, None)  # [b, s, V]
        with model.greedy_scoring(VOCAB):
            hits = model(tokens, positions, None, labels=labels)
    assert hits.shape == (2, SEQ)
    torch.testing.assert_close(hits, (logits.argmax(-1) == labels).float())

    # make the last 4 labels the model's own greedy continuation of the first SEQ - 4 tokens:
    # every one of them is a hit; change one answer token and the prompt is wrong from there
    prompt = tokens[:1, : SEQ - 4]
    with torch.no_grad():
        for _ in range(5):
            pos = torch.arange(prompt.size(1))[None]
            step = model(prompt, pos, None)[:, -1].argmax(-1, keepdim=True)
            prompt = torch.cat([prompt, step], dim=1)
    row, label_row = prompt[:, :SEQ], prompt[:, 1:]
    with torch.no_grad(), model.greedy_scoring(VOCAB):
        hits = model(row, positions[:1], None, labels=label_row)
    assert hits[0, -4:].tolist() == [1.0] * 4
    wrong = label_row.clone()
    wrong[0, -3] = (wrong[0, -3] + 1) % VOCAB
    with torch.no_grad(), model.greedy_scoring(VOCAB):
        hits = model(row, positions[:1], None, labels=wrong)
    assert hits[0, -3].item() == 0.0


def test_accuracy_is_the_share_of_exact_answers_per_cell_and_its_mean():
    samples = [
        make_sample(parts(2), task="passkey", length=200, depth=d, index=i, seed=0)
        for d in (0.0, 1.0)
        for i in range(4)
    ]
    # (hits, answer tokens); TP replicas double both, which keeps a whole answer whole
    counts = [(3, 3), (6, 6), (2, 3), (3, 3), (1, 3), (0, 3), (4, 6), (3, 3)]
    figures = accuracy(samples, counts)
    assert figures == {
        "val_passkey_acc": 0.5,
        "val_passkey_acc_by_cell": {"200@0": 0.75, "200@1": 0.25},
        "val_passkey_token_acc": 22 / 30,
    }
