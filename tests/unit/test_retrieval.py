"""Retrieval evaluation: the prompts, the greedy scoring in the model, and the accuracies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memo_ext.data.retrieval import PromptParts, check_tokenizer, make_sample, shortest_length
from memo_ext.data.tokenizers import ByteTokenizer, NullTokenizer
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


@pytest.mark.parametrize("digits", [1, 5, 7])
@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_the_shortest_length_is_the_shortest_every_prompt_of_it_fits(task, digits):
    """Against make_sample itself: at the shortest length every prompt builds (no filler left),
    one token shorter none does; the byte tokenizer writes every number in as many tokens."""
    shortest = shortest_length(parts(digits), task=task)
    for depth, index in ((0.0, 0), (0.5, 3), (1.0, 7)):
        sample = make_sample(
            parts(digits), task=task, length=shortest, depth=depth, index=index, seed=1
        )
        assert sample.tokens.shape == (shortest + 1,)
        with pytest.raises(UsageError, match="too short"):
            make_sample(
                parts(digits), task=task, length=shortest - 1, depth=depth, index=index, seed=1
            )


def test_the_tool_prints_the_shortest_length_of_its_tokenizer_and_tasks(capsys):
    """What scripts check their lengths with, before an import or a launch: the needle prompt of
    the byte tokenizer by hand, 40 (intro) + 20 + 1 (statement) + 46 (question) + 2 × 6 (the
    answer " 12345", stated and asked) - 1 (the id no model reads)."""
    from memo_ext.commands.eval_retrieval import main

    for argv, expected in (
        ([], 118),
        (["--eval-retrieval-tasks", "passkey", "--bf16", "--tensor-model-parallel-size", "8"], 106),
        (["--eval-retrieval-digits", "3"], 114),
    ):
        assert main(["--shortest-length", "--tokenizer-type", "ByteTokenizer", *argv]) == 0
        assert capsys.readouterr().out == f"{expected}\n"
    assert main(["--shortest-length", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"])
    assert "writes text with digits" in capsys.readouterr().err


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


# ---- bad input: one sentence each, before any work ------------------------------------------

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
    "--mock-data", "--eval-interval", "1",
]  # fmt: skip


def refusal(*flags: str, world_size: int = 1) -> str:
    from memo_ext.arguments import parse_args

    with pytest.raises(UsageError) as err:
        parse_args([*BASE, *flags], world_size=world_size)
    return str(err.value)


def test_lengths_past_a_learned_position_table_are_refused():
    message = refusal("--eval-retrieval-lengths", "128,512")
    assert "512 is past the 128 positions" in message and "--max-position-embeddings" in message
    # rotary positions reach any length
    from memo_ext.arguments import parse_args

    rope = ["--position-embedding-type", "rope", "--eval-retrieval-lengths", "128,4096"]
    assert parse_args([*BASE, *rope], world_size=1).evaluation.eval_retrieval_lengths[1] == 4096


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--eval-retrieval-depths", "0,1.5"], "must lie in [0, 1]"),
        (["--eval-retrieval-depths", "-0.1"], "must lie in [0, 1]"),
        (["--eval-retrieval-depths", "0,nan"], "comma-separated fractions"),
        (["--eval-retrieval-depths", "0.5,0.5"], "distinct depths"),
        (["--eval-retrieval-samples", "0"], "--eval-retrieval-samples must be at least 1"),
        (["--eval-retrieval-digits", "0"], "--eval-retrieval-digits must be in [1, 18]"),
        (["--eval-retrieval-tasks", "passkey,essay"], "tasks of passkey, needle"),
    ],
)
def test_a_bad_grid_is_one_sentence(flags, expected):
    message = refusal("--eval-retrieval-lengths", "128", *flags)
    assert expected in message and "\n" not in message


def test_grid_flags_without_lengths_or_evaluations_are_refused():
    assert "only apply with --eval-retrieval-lengths" in refusal("--eval-retrieval-samples", "2")
    from memo_ext.arguments import parse_args

    no_interval = BASE[: BASE.index("--eval-interval")]
    with pytest.raises(UsageError, match="add --eval-interval N"):
        parse_args([*no_interval, "--eval-retrieval-lengths", "128"], world_size=1)


def test_a_length_the_layout_cannot_cut_is_refused():
    cp = ["--context-parallel-size", "2", "--position-embedding-type", "rope"]
    message = refusal("--eval-retrieval-lengths", "130", *cp, world_size=2)
    assert "130 is not a multiple of 4" in message


def test_the_trainer_refuses_a_digitless_tokenizer_and_a_short_length_before_any_work():
    """The checks the trainer makes once its tokenizer is built, before any process group."""
    import dataclasses

    from memo_ext.arguments import parse_args
    from memo_ext.training.retrieval import check_retrieval

    run = parse_args(
        [*BASE, "--position-embedding-type", "rope", "--eval-retrieval-lengths", "2048"],
        world_size=1,
    )
    with pytest.raises(UsageError, match="NullTokenizer"):
        check_retrieval(run, NullTokenizer(vocab_size=100))
    check_retrieval(run, BYTES)
    short = dataclasses.replace(
        run, evaluation=dataclasses.replace(run.evaluation, eval_retrieval_lengths=(64,))
    )
    with pytest.raises(UsageError, match="64 is too short for the passkey prompt"):
        check_retrieval(short, BYTES)


def test_the_preflight_refuses_a_grid_longer_than_the_device_holds():
    """A 7B model trained at 8K under TP 8 fits an 80 GB device, and the estimator prices a 1M-
    token prompt of it at 13.5 GiB of model states + 19 GiB of working set; a 4M-token prompt
    (76 GiB of working set) does not fit."""
    from memo_ext.arguments import parse_args
    from memo_ext.data.tokenizers import tokenizer_for
    from memo_ext.features.preflight import preflight
    from memo_ext.hardware import DEVICES
    from memo_ext.training.resolve import resolve_run

    def run_with(lengths: str):
        argv = [
            "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--seq-length", "8192", "--position-embedding-type", "rope",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
            "--tensor-model-parallel-size", "8", "--sequence-parallel", "--eval-interval", "1",
            "--eval-retrieval-lengths", lengths,
        ]  # fmt: skip
        run = parse_args(argv, world_size=8)
        return resolve_run(run, tokenizer=tokenizer_for(run.data))

    device = DEVICES["a800-80g"]
    assert preflight(run_with("4096,1048576"), device=device).fits
    report = preflight(run_with("8192,1048576,4194304"), device=device)
    assert report.checked and not report.fits
    assert report.message.startswith("--eval-retrieval-lengths 4194304 does not fit")
    assert "keep 8192,1048576, or use a larger --context-parallel-size" in report.message


def test_the_tool_refuses_bad_input_in_one_sentence_and_touches_nothing(tmp_path, capsys):
    from memo_ext.commands.eval_retrieval import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "retrieval.json").write_text("{}")  # an earlier evaluation's: kept on bad input
    bare = tmp_path / "ckpt"
    bare.mkdir()
    not_a_grid = tmp_path / "other.json"
    not_a_grid.write_text('{"a": 1}')
    cases = [
        (["--load", str(tmp_path / "none"), "--eval-retrieval-lengths", "64"], "not a folder"),
        (["--load", str(bare), "--eval-retrieval-lengths=64"], "has no model_flags.txt"),
        (["--load", str(bare), "--eval-retrieval-lengths", "64,x"], "got '64,x'"),
        (["--load", str(bare)], "give --eval-retrieval-lengths"),
        (["--load", str(bare), "--nproc", "0", "--eval-retrieval-lengths", "64"], "--nproc"),
        (["--plot", str(not_a_grid)], "is no retrieval.json"),
        (["--plot", str(not_a_grid), "--num-layers", "2"], "takes no trainer flags"),
    ]
    for argv, expected in cases:
        assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err
    assert (out / "retrieval.json").read_text() == "{}"


def fake_record(*, iteration: int, acc: float, token_acc: float) -> dict:
    """The trainer's --skip-train record of a 2 × 2 passkey grid, every cell at ``acc``."""
    cells = {f"{n}@{d:g}": acc for n in (64, 128) for d in (0.0, 1.0)}
    return {
        "iteration": iteration,
        "consumed_samples": 0,
        "val_passkey_acc": acc,
        "val_passkey_acc_by_cell": cells,
        "val_passkey_token_acc": token_acc,
    }


def test_the_tool_s_help_lists_the_trainer_flags_that_pass_through():
    from memo_ext.commands.eval_retrieval import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--eval-retrieval-lengths N1,N2,... Required: the context lengths to test" in text
    for flag in ("--eval-retrieval-depths", "--eval-retrieval-digits", "--data-path", "--memo"):
        assert f" {flag} " in text
    assert "--tensor-model-parallel-size" in text


def test_the_grid_shows_token_accuracy_and_notes_a_score_at_chance():
    from memo_ext.commands.eval_retrieval import grid_of, side_by_side

    untrained = grid_of(fake_record(iteration=0, acc=0.0, token_acc=0.11), checkpoint="a", digits=2)
    # one cell in 100: what guessing a 2-digit number scores
    guessing = grid_of(fake_record(iteration=0, acc=0.01, token_acc=0.1), checkpoint="g", digits=2)
    trained = grid_of(fake_record(iteration=9, acc=0.75, token_acc=0.9), checkpoint="b", digits=2)
    assert trained["tasks"]["passkey"]["token_accuracy"] == 0.9
    lines = side_by_side([("a", untrained), ("b", trained)]).splitlines()
    assert lines[0] == "passkey: accuracy 0.00 / 0.75, token accuracy 0.11 / 0.90  (a / b)"
    assert lines[2].split() == ["64", "0.00", "/", "0.75", "0.00", "/", "0.75"]
    (note,) = [line for line in lines if line.startswith("note:")]
    assert note.startswith("note: passkey of a is at chance (a guess of the 2-digit number")
    assert "note:" in side_by_side([("g", guessing)])
    assert "note:" not in side_by_side([("b", trained)])
    older = dict(untrained, tasks={"passkey": {"accuracy": 0.0, "grid": [[0.0] * 2] * 2}})
    del older["digits"]  # a retrieval.json of an earlier version
    assert "token accuracy -  (o)" in side_by_side([("o", older)])
    assert "no prompt is answered exactly" in side_by_side([("o", older)])


def test_without_matplotlib_the_tool_says_so_first_and_still_writes_the_grid(
    tmp_path, monkeypatch, capsys
):
    import json
    import sys

    import memo_ext.launch
    from memo_ext.commands.eval_retrieval import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as Python knows
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    (ckpt / "model_flags.txt").write_text("--num-layers 2 --hidden-size 64")

    def trainer(argv: list[str]) -> int:  # the evaluation the tool launches, as a record
        print("evaluating")
        record = fake_record(iteration=200, acc=0.5, token_acc=0.8)
        (out / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return 0

    monkeypatch.setattr(memo_ext.launch, "main", trainer)
    assert main(["--load", str(ckpt), "--out", str(out), "--eval-retrieval-lengths", "64,128"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("note: matplotlib is not installed (pip install matplotlib")
    assert printed[1] == "evaluating"
    grid = json.loads((out / "retrieval.json").read_text())
    assert grid["iteration"] == 200 and grid["tasks"]["passkey"]["token_accuracy"] == 0.8
    assert not (out / "retrieval.png").exists()
    assert f"--plot {out / 'retrieval.json'} --out {out / 'retrieval.png'}" in printed[-1]
    assert "pip install matplotlib" in printed[-1]
    # asked for a picture alone: refused before any reading
    assert main(["--plot", str(out / "retrieval.json"), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memo-eval-retrieval: error: --plot draws with matplotlib")
