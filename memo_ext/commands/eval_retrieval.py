"""Passkey and needle-in-a-haystack accuracy of a checkpoint, over a grid of lengths × depths.

    python -m tools.eval_retrieval --load ckpt/run1 --out runs/eval1 \\
        --eval-retrieval-lengths 4096,16384,65536 [trainer flags: layout, precision, data]
    python -m tools.eval_retrieval --hf-dir Meta-Llama-3-8B --out runs/eval0 --nproc 8 \\
        --eval-retrieval-lengths 8192,32768 --bf16 --tensor-model-parallel-size 8
    python -m tools.eval_retrieval --plot runs/eval0/retrieval.json runs/eval1/retrieval.json \\
        --out before_after.png
    python -m tools.eval_retrieval --shortest-length --tokenizer-type ByteTokenizer

A checkpoint of this trainer (``--load``: its model flags are read from the ``model_flags.txt``
the trainer saves beside it) or a Hugging Face folder (``--hf-dir``: imported first into
``OUT/import`` with ``tools.convert_hf``; its tokenizer is the folder's own) is evaluated by the
trainer itself (``pretrain_gpt_memo.py --skip-train`` under ``memo_ext.launch`` with ``--nproc``
processes), so every layout and memory method of the trainer applies: trainer flags after the
tool's pass through (later flags win). Without ``--data-path`` the trainer runs on mock data and
the needle hides in the built-in filler sentences; with it, in the validation split's documents.

Writes ``OUT/metrics.jsonl`` (the trainer's record, at the checkpoint's iteration),
``OUT/retrieval.json`` (the grid: per task, exact-match accuracy per length × depth, its mean and
the token accuracy) and ``OUT/retrieval.png`` (one heatmap per task; needs matplotlib: without
it the grid is still evaluated, printed and written, and the tool says how to draw it later).
``--plot`` draws several ``retrieval.json`` side by side (one column each) and prints their
grids. A task whose mean is no better than guessing the number gets a note.
``--shortest-length`` prints the fewest tokens every task's prompt fits in with the tokenizer the
trainer flags name (``--tokenizer-*``, ``--eval-retrieval-tasks``, ``--eval-retrieval-digits``),
in seconds and with no model: a script checks its lengths with it before an import or a
launch. Exits 2 on bad input, as the trainer does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from memo_ext.arguments import OneSentenceParser
from memo_ext.arguments import build_parser as build_trainer_parser
from memo_ext.config import EvaluationConfig, TokenizerSpec, installed
from memo_ext.errors import UsageError
from memo_ext.files import read_json
from memo_ext.flags import FlagHelpFormatter, add_flags, from_flags
from memo_ext.plugins import with_plugins

PROG = "memo-eval-retrieval"
"""The installed command: its usage line and error prefix."""
RESULT_FILE = "retrieval.json"
TASKS = ("passkey", "needle")
NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib, or the plots extra)"
PASSED_THROUGH = (
    "--eval-retrieval-lengths",
    "--eval-retrieval-depths",
    "--eval-retrieval-samples",
    "--eval-retrieval-tasks",
    "--eval-retrieval-digits",
    "--data-path",
    "--tensor-model-parallel-size",
    "--sequence-parallel",
    "--context-parallel-size",
    "--bf16",
    "--memo",
)
"""The trainer flags --help lists: the grid's, the haystack's, the common layout ones."""
PROMPT_FIELDS = ("eval_retrieval_tasks", "eval_retrieval_digits")
"""The grid's flags that change a prompt's text (--shortest-length reads them)."""
TOOL_HELP = {
    "--eval-retrieval-lengths": "Required: the context lengths to test, in tokens.",
    "--data-path": "The needle's haystack: the validation split's documents (without it: mock "
    "data, and the built-in filler sentences).",
}
"""Where the trainer's help for a passed-through flag says less than the tool needs."""


def build_parser() -> OneSentenceParser:
    parser = OneSentenceParser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog=_passed_through_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", type=Path, help="A checkpoint folder of this trainer.")
    source.add_argument(
        "--hf-dir", type=Path, help="A Hugging Face folder (config.json + *.safetensors)."
    )
    source.add_argument(
        "--plot", type=Path, nargs="+", metavar="JSON", help="Draw these retrieval.json files."
    )
    source.add_argument(
        "--shortest-length",
        action="store_true",
        help="Print the fewest tokens the prompts fit in with the trainer flags' tokenizer.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="Output folder (with --plot: the PNG to write); required but for --shortest-length.",
    )
    parser.add_argument(
        "--nproc", type=int, default=1, help="Processes of the evaluation (default 1)."
    )
    parser.add_argument("--master-port", type=int, default=29533, help="Its rendezvous port.")
    parser.add_argument(
        "--names", nargs="+", default=None, help="With --plot: a title per file (its path)."
    )
    return parser


def _passed_through_help() -> str:
    """The trainer's own --help of the flags in :data:`PASSED_THROUGH`, as the tool's epilog."""
    trainer = build_trainer_parser()._option_string_actions
    listing = argparse.ArgumentParser(
        add_help=False, usage=argparse.SUPPRESS, formatter_class=FlagHelpFormatter
    )
    group = listing.add_argument_group(
        "trainer flags (after the tool's, passed through to the trainer; later flags win)"
    )
    for flag in PASSED_THROUGH:
        action = trainer[flag]
        text = TOOL_HELP.get(flag, action.help)
        if action.nargs == 0:
            group.add_argument(flag, action="store_true", help=text)
        else:
            default = argparse.SUPPRESS if flag in TOOL_HELP else action.default
            group.add_argument(
                flag, metavar=action.metavar, nargs=action.nargs, default=default, help=text
            )
    return listing.format_help() + (
        "  and every other flag of the trainer (python pretrain_gpt_memo.py --help lists them)\n"
    )


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, trainer = parser.parse_known_args(argv)
        # --flag=value as two words: the tool reads --eval-retrieval-lengths among them
        trainer = [part for arg in trainer for part in _split_flag(arg)]
        if args.shortest_length:
            print(shortest_length(trainer))
            return 0
        if args.out is None:
            parser.error("the following arguments are required: --out")
        if args.plot:
            if trainer:
                raise UsageError(f"--plot takes no trainer flags, got {' '.join(trainer)}")
            if not installed("matplotlib"):
                raise UsageError(f"--plot draws with matplotlib, and {NO_MATPLOTLIB}")
            grids = [load_grid(path) for path in args.plot]
            names = args.names or [str(path) for path in args.plot]
            if len(names) != len(grids):
                raise UsageError(f"--names gives {len(names)} titles for {len(grids)} files")
            print(side_by_side(list(zip(names, grids))))
            draw(list(zip(names, grids)), args.out)
            print(f"wrote {args.out}")
            return 0
        return evaluate(args, trainer)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


def evaluate(args, trainer: list[str]) -> int:
    """Run the trainer on the checkpoint and write the grid and its heatmap."""
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if "--eval-retrieval-lengths" not in trainer:
        raise UsageError("give --eval-retrieval-lengths N1,N2,... (the context lengths to test)")
    lengths = _lengths(trainer)
    out: Path = args.out
    source = args.hf_dir if args.hf_dir is not None else args.load
    if not source.is_dir():
        flag = "--hf-dir" if args.hf_dir is not None else "--load"
        raise UsageError(f"{flag} {source} is not a folder")
    if args.load is not None and not (args.load / "model_flags.txt").is_file():
        raise UsageError(
            f"--load {args.load} has no model_flags.txt, the model's trainer flags on one line "
            "(the trainer writes it beside its checkpoints; for another program's checkpoint, "
            "write it)"
        )
    _clear_outputs(out)
    can_draw = installed("matplotlib")  # said now, not after minutes of evaluation
    if not can_draw:
        print(f"note: {NO_MATPLOTLIB}: the grid goes to {out / RESULT_FILE}, without a picture")
    if args.hf_dir is not None:
        load = _imported(args.hf_dir, out / "import")
        tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer"]
        defaults = [*tokenizer, "--tokenizer-model", str(args.hf_dir)]
    else:
        load, defaults = args.load, []
    flags_file = load / "model_flags.txt"
    model = shlex.split(flags_file.read_text())
    argv = [
        "--nproc-per-node", str(args.nproc), "--master-port", str(args.master_port),
        "pretrain_gpt_memo.py", *defaults, *model,
        "--seq-length", str(_seq_length(model, lengths)),
        "--micro-batch-size", "1", "--train-iters", "1",
        "--lr", "1e-5", "--eval-iters", "0", "--load", str(load), "--finetune",
        "--skip-train", "--metrics-file", str(out / "metrics.jsonl"), "--log-interval", "1",
    ]  # fmt: skip
    if not any(flag in trainer for flag in ("--data-path", "--mock-data")):
        argv.append("--mock-data")
    from memo_ext.launch import main as launch

    status = launch([*argv, *trainer])
    if status:
        return status
    # the record is at the checkpoint's iteration (--skip-train's, under --finetune too)
    grid = grid_of(_record(out / "metrics.jsonl"), checkpoint=str(load), digits=_digits(trainer))
    (out / RESULT_FILE).write_text(json.dumps(grid, indent=1) + "\n")
    print(side_by_side([(str(load), grid)]))
    if not can_draw:
        print(
            f"wrote {out / RESULT_FILE}; for the picture, pip install matplotlib (or the plots "
            f"extra), then: {PROG} --plot {out / RESULT_FILE} --out "
            f"{out / 'retrieval.png'}"
        )
        return 0
    draw([(str(load), grid)], out / "retrieval.png")
    print(f"wrote {out / RESULT_FILE} and {out / 'retrieval.png'}")
    return 0


def shortest_length(trainer: list[str]) -> int:
    """The fewest tokens every prompt of the trainer flags' retrieval tasks fits in, with their
    tokenizer (checked to write digits); the longest of
    :func:`~memo_ext.data.retrieval.shortest_length` over the tasks. Other trainer flags are
    ignored, so a script may pass its whole command line.

    Raises:
        UsageError: a tokenizer that cannot be built or writes no digits, or a bad flag value.
    """
    parser = OneSentenceParser(prog=PROG, allow_abbrev=False)
    add_flags(parser, TokenizerSpec, section="data")
    add_flags(parser, EvaluationConfig, section="evaluation", only=PROMPT_FIELDS)
    args, _ = parser.parse_known_args(trainer)
    spec = from_flags(TokenizerSpec, args, section="data")
    if spec.vocab_file and spec.merge_file and "--tokenizer-type" not in trainer:
        spec = dataclasses.replace(spec, tokenizer_type="GPT2BPETokenizer")  # as the trainer's
    evaluation = from_flags(EvaluationConfig, args, section="evaluation", only=PROMPT_FIELDS)
    if not 1 <= evaluation.eval_retrieval_digits <= 18:
        raise UsageError(
            f"--eval-retrieval-digits must be in [1, 18], got {evaluation.eval_retrieval_digits}"
        )
    # megatron-core's tokenizer base: seconds to import, paid here only
    from memo_ext.data.retrieval import PromptParts, check_tokenizer
    from memo_ext.data.retrieval import shortest_length as prompt_tokens
    from memo_ext.data.tokenizers import build_tokenizer

    try:
        tokenizer = build_tokenizer(spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    name = f"--tokenizer-type {spec.tokenizer_type}"
    check_tokenizer(tokenizer.tokenize, tokenizer.detokenize, name=name)
    parts = PromptParts(tokenizer.tokenize, digits=evaluation.eval_retrieval_digits)
    return max(prompt_tokens(parts, task=task) for task in evaluation.eval_retrieval_tasks)


OUTPUTS = ("metrics.jsonl", "metrics.config.json", RESULT_FILE, "retrieval.png")


def _clear_outputs(out: Path) -> None:
    """``out`` made, or emptied of an earlier evaluation's files (its import is kept).

    Raises:
        UsageError: ``out`` is a file, or holds files of something else.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [name for name in held if name not in (*OUTPUTS, "import")]
    if foreign:
        raise UsageError(
            f"--out {out} holds {', '.join(foreign[:3])}, which this tool did not write; give a "
            "new folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)


def _imported(hf_dir: Path, into: Path) -> Path:
    """``hf_dir`` imported into ``into`` (once: a finished import there is reused)."""
    if (into / "latest_checkpointed_iteration.txt").is_file():
        return into
    from memo_ext.commands.convert_hf import main as convert

    status = convert(["import", "--hf-dir", str(hf_dir), "--out", str(into)])
    if status:
        raise SystemExit(status)
    return into


def _split_flag(arg: str) -> list[str]:
    flag, eq, value = arg.partition("=")
    return [flag, value] if eq and flag.startswith("--") else [arg]


def _lengths(trainer: list[str]) -> list[int]:
    value = (trainer[trainer.index("--eval-retrieval-lengths") + 1 :] or [""])[0]
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise UsageError(
            f"--eval-retrieval-lengths must be comma-separated token counts, got {value!r}"
        ) from None


def _digits(trainer: list[str]) -> int:
    """The answer's digits: the last --eval-retrieval-digits given, else the trainer's default
    (its parser reports a value that is no number)."""
    given = [
        value for flag, value in zip(trainer, trainer[1:]) if flag == "--eval-retrieval-digits"
    ]
    if given and given[-1].isdigit():
        return int(given[-1])
    return EvaluationConfig.eval_retrieval_digits


def _seq_length(model: list[str], lengths: list[int]) -> int:
    """The evaluation run's --seq-length (its validation batches' length; retrieval prompts
    have their own): the shortest prompt, within the model's position table when it names one
    (a RoPE model reads prompts past it)."""
    seq = min(lengths)
    if "--max-position-embeddings" in model:
        table = model[model.index("--max-position-embeddings") + 1]
        seq = min(seq, int(table)) if table.isdigit() else seq
    return seq


def _record(path: Path) -> dict:
    from memo_ext.training.metrics import read_metrics

    records = [r for r in read_metrics(path) if "val_passkey_acc" in r or "val_needle_acc" in r]
    if not records:
        raise UsageError(f"{path} holds no retrieval record; the evaluation did not finish")
    return records[-1]


def grid_of(record: dict, *, checkpoint: str, digits: int) -> dict:
    """The trainer's record as a grid: per task, exact-match accuracy ``[length][depth]``, its
    mean, and the share of answer tokens predicted right (partial credit); ``digits``: the
    answer's, which set the accuracy of a guess."""
    tasks = {}
    lengths, depths = set(), set()
    for task in TASKS:
        cells = record.get(f"val_{task}_acc_by_cell")
        if not cells:
            continue
        for cell in cells:
            length, depth = cell.split("@")
            lengths.add(int(length))
            depths.add(float(depth))
        tasks[task] = cells
    lengths, depths = sorted(lengths), sorted(depths)
    return {
        "checkpoint": checkpoint,
        "iteration": record["iteration"],
        "digits": digits,
        "lengths": lengths,
        "depths": depths,
        "tasks": {
            task: {
                "accuracy": record[f"val_{task}_acc"],
                "token_accuracy": record.get(f"val_{task}_token_acc"),
                "grid": [[cells[f"{n}@{d:g}"] for d in depths] for n in lengths],
            }
            for task, cells in tasks.items()
        },
    }


def load_grid(path: Path) -> dict:
    """A ``retrieval.json`` this tool wrote.

    Raises:
        UsageError: a file that is not one.
    """
    grid = read_json(path)
    if not {"lengths", "depths", "tasks"} <= set(grid):
        raise UsageError(f"{path} is no {RESULT_FILE} of this tool (no lengths/depths/tasks)")
    return grid


def side_by_side(grids: list[tuple[str, dict]]) -> str:
    """Each task's grid as text, the files' accuracies side by side per cell (``a / b``), under
    the means and token accuracies; a note under a grid at chance."""
    lines = []
    for task in TASKS:
        present = [(name, g) for name, g in grids if task in g["tasks"]]
        if not present:
            continue
        means = " / ".join(f"{g['tasks'][task]['accuracy']:.2f}" for _, g in present)
        tokens = " / ".join(_token_accuracy(g["tasks"][task]) for _, g in present)
        names = " / ".join(name for name, _ in present)
        lines.append(f"{task}: accuracy {means}, token accuracy {tokens}  ({names})")
        depths = present[0][1]["depths"]
        lines.append("length \\ depth " + "".join(f"{d:>14g}" for d in depths))
        for length in present[0][1]["lengths"]:
            cells = []
            for depth in depths:
                values = [_cell(g, task, length, depth) for _, g in present]
                cells.append(f"{' / '.join(values):>14}")
            lines.append(f"{length:>14} " + "".join(cells))
        lines += [note for name, g in present if (note := chance_note(task, name, g))]
    return "\n".join(lines)


def _token_accuracy(result: dict) -> str:
    value = result.get("token_accuracy")  # absent from a retrieval.json of an older version
    return "-" if value is None else f"{value:.2f}"


def chance_note(task: str, name: str, grid: dict) -> str | None:
    """A line saying that ``task``'s mean in ``grid`` is no better than guessing the number
    (1 in 10**digits; a grid of zeros when the digits are not recorded), else None."""
    mean = grid["tasks"][task]["accuracy"]
    digits = grid.get("digits")
    chance = 10.0**-digits if digits else 0.0
    if mean > chance:
        return None
    guess = "no prompt is answered exactly"
    if digits:
        guess = f"a guess of the {digits}-digit number is right {chance:g} of the time"
    return (
        f"note: {task} of {name} is at chance ({guess}): no retrieval at these lengths; the "
        "token accuracy shows any partial progress"
    )


def _cell(grid: dict, task: str, length: int, depth: float) -> str:
    try:
        row, col = grid["lengths"].index(length), grid["depths"].index(depth)
    except ValueError:
        return "-"
    return f"{grid['tasks'][task]['grid'][row][col]:.2f}"


def draw(grids: list[tuple[str, dict]], out: Path) -> None:
    """One heatmap per (task, file): lengths down, depths across, accuracy as colour and text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(t in g["tasks"] for _, g in grids)]
    fig, axes = plt.subplots(
        len(tasks),
        len(grids),
        figsize=(3.6 * len(grids) + 1.2, 3.0 * len(tasks)),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for row, task in enumerate(tasks):
        for col, (name, grid) in enumerate(grids):
            ax = axes[row][col]
            if task not in grid["tasks"]:
                ax.axis("off")
                continue
            values = grid["tasks"][task]["grid"]
            image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(grid["depths"])), [f"{d:g}" for d in grid["depths"]])
            ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
            for i, line in enumerate(values):
                for j, value in enumerate(line):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
            mean = grid["tasks"][task]["accuracy"]
            ax.set_title(f"{task} · {Path(name).name} · mean {mean:.2f}", fontsize=9)
            ax.set_xlabel("depth")
            ax.set_ylabel("context length")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="exact-match accuracy")
    fig.savefig(out, dpi=120)
    plt.close(fig)
