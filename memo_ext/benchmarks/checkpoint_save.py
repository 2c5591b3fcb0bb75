"""Seconds per checkpoint save: our ``save_checkpoint`` against Megatron-LM's, same model.

Builds a small GPT the way the trainer does (flags parsed into a ``RunConfig``, megatron's
parallel state, ``build_gpt_model``, megatron-core DDP, the optimizer after one step so that its
moments exist, the LR schedule) on ``--nproc`` gloo processes (data parallel), then saves it
``--saves`` times with ``memo_ext.training.checkpoint.save_checkpoint``. With
``--megatron-lm PATH`` (a Megatron-LM source checkout whose ``megatron/core`` is the installed
megatron-core's version) the same model, built again in fresh processes, is saved as many times
with Megatron-LM's ``megatron.training.checkpointing.save_checkpoint`` (torch_dist, its
defaults). Each implementation runs in processes of its own, so each pays its own first-save
costs, as a training run would. Run from the repository root:

    python -m benchmarks.checkpoint_save --megatron-lm /path/to/Megatron-LM --json save.json
    python -m benchmarks.checkpoint_save --nproc 1 --saves 2      # ours alone, the smallest run

It prints the median, fastest and first save of each (rank 0's seconds, from a barrier to the
return of ``save_checkpoint``) and the ratio ours / Megatron-LM's. Defaults: 2 processes, 5 saves
each, a 2-layer GPT of 175,584 parameters; about 10 s of start-up per implementation here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import logging
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memo_ext.device import on_gpu

MODEL_FLAGS = [
    "--num-layers", "2",
    "--hidden-size", "96",
    "--ffn-hidden-size", "144",
    "--num-attention-heads", "4",
    "--group-query-attention",
    "--num-query-groups", "2",
    "--seq-length", "128",
    "--position-embedding-type", "rope",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
]  # fmt: skip
"""The model every rank builds (175,584 parameters); flags that Megatron-LM takes too."""

RUN_FLAGS = [
    "--tokenizer-type", "ByteTokenizer",
    "--mock-data",
    "--micro-batch-size", "2",
    "--train-iters", "10",
    "--lr", "1e-3",
]  # fmt: skip
"""Our trainer's data and schedule flags for it."""


@dataclass(frozen=True)
class TrainingState:
    """What a save writes: the trainer's model, optimizer and LR schedule on this rank."""

    model: torch.nn.Module
    optimizer: object
    scheduler: object
    parameters: int
    """Parameters of the whole model (every rank holds all of them: data parallelism)."""


@contextlib.contextmanager
def build_training_state(
    *, nproc: int, flags: list[str] = MODEL_FLAGS + RUN_FLAGS
) -> Iterator[TrainingState]:
    """The trainer's model, optimizer (after one step on zero gradients, so that its moments
    exist) and LR schedule for ``flags`` on this rank of ``nproc``; the process groups and
    megatron's parallel state live for the block. ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` must be
    in the environment, as torchrun sets them."""
    from memo_ext.arguments import parse_args
    from memo_ext.data.tokenizers import tokenizer_for
    from memo_ext.features.megatron import run_transformer_config
    from memo_ext.training.initialize import (
        device_environment,
        init_distributed,
        init_model_parallel,
        shutdown,
    )
    from memo_ext.training.model import build_gpt_model, count_parameters, wrap_for_data_parallel
    from memo_ext.training.optimizer import build_lr_scheduler, build_optimizer
    from memo_ext.training.resolve import resolve_run

    run = parse_args(flags, world_size=nproc)
    run = resolve_run(run, tokenizer=tokenizer_for(run.data), extensions=[])
    init_distributed()
    try:
        with device_environment() as device:
            init_model_parallel(layout=run.layout, seed=run.train.seed)
            config = run_transformer_config(run)
            bare = build_gpt_model(run=run, config=config, device=device)
            model = wrap_for_data_parallel(model=bare, run=run, config=config)
            optimizer = build_optimizer(
                model_chunks=[model], train=run.train, bf16=run.train.bf16, fp16=run.train.fp16
            )
            optimizer.step()  # DDP's gradient buffers start at zero: only the moments change
            scheduler = build_lr_scheduler(optimizer=optimizer, train=run.train)
            yield TrainingState(model, optimizer, scheduler, count_parameters(bare))
    finally:
        shutdown()


def time_saves(save: Callable[[int], None], *, saves: int) -> list[float]:
    """Seconds of each of ``saves`` calls of ``save(iteration)``, from a barrier that every rank
    leaves together to this rank's return."""
    seconds = []
    for iteration in range(1, saves + 1):
        dist.barrier()
        start = time.perf_counter()
        save(iteration)
        seconds.append(time.perf_counter() - start)
    return seconds


def save_ours(state: TrainingState, save_dir: Path) -> Callable[[int], None]:
    """``save(iteration)`` with this project's ``save_checkpoint``."""
    from memo_ext.training.checkpoint import TrainProgress, save_checkpoint

    def save(iteration: int) -> None:
        save_checkpoint(
            save_dir=str(save_dir),
            progress=TrainProgress(iteration, iteration * 8),
            model=state.model,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
        )

    return save


# --- Megatron-LM -----------------------------------------------------------------------------

# Imported by Megatron-LM's tokenizers only, which a save never builds: stand-ins when absent.
_TOKENIZER_ONLY_MODULES = ("six", "regex")


def check_megatron_lm(checkout: Path) -> None:
    """Refuse a ``--megatron-lm`` that is no Megatron-LM checkout, or one whose megatron-core is
    not the installed one (its training code would run over another core than it was written
    for).

    Raises:
        SystemExit: saying which.
    """
    installed = importlib.metadata.version("megatron-core")
    if not (checkout / "megatron" / "training" / "checkpointing.py").is_file():
        raise SystemExit(
            f"--megatron-lm {checkout}: no megatron/training/checkpointing.py there; give the "
            "root of a Megatron-LM checkout"
        )
    package_info = checkout / "megatron" / "core" / "package_info.py"
    info = package_info.read_text() if package_info.is_file() else ""
    found = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", info, flags=re.MULTILINE))
    version = ".".join(found.get(part, "?") for part in ("MAJOR", "MINOR", "PATCH"))
    if version != installed:
        raise SystemExit(
            f"--megatron-lm {checkout} holds megatron-core {version}, but {installed} is "
            f"installed; check out its core_v{installed} tag"
        )


def import_megatron_lm_checkpointing(checkout: Path) -> types.ModuleType:
    """Megatron-LM's ``megatron.training.checkpointing`` from ``checkout``, over the installed
    megatron-core (``megatron`` is a namespace package: the checkout's ``megatron/training`` and
    ``megatron/legacy`` join the installed ``megatron/core``, which stays the one imported).

    ``megatron/training/__init__.py`` is not run: it imports the whole trainer (Triton kernels,
    the training loop), none of which a save uses; the package gets the ``get_*`` accessors of
    ``global_vars`` that its modules import from it.
    """
    training = checkout / "megatron" / "training"
    if str(checkout) not in sys.path:
        sys.path.append(str(checkout))  # after site-packages: the installed megatron.core wins
    package = types.ModuleType("megatron.training")
    package.__path__ = [str(training)]
    sys.modules["megatron.training"] = package
    for name in _TOKENIZER_ONLY_MODULES:
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    from megatron.training import global_vars

    for name in dir(global_vars):
        if name.startswith("get_"):
            setattr(package, name, getattr(global_vars, name))
    from megatron.training import checkpointing

    return checkpointing


def megatron_lm_args(save_dir: Path, nproc: int) -> argparse.Namespace:
    """Megatron-LM's arguments for a torch_dist save to ``save_dir``: its parser's defaults for
    the same model flags, then what ``validate_args`` and its dist-checkpointing tests set for
    the save path (``tests/unit_tests/dist_checkpointing/utils.py``)."""
    from megatron.training.arguments import parse_args

    argv = sys.argv
    sys.argv = ["pretrain_gpt.py", *MODEL_FLAGS]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.world_size = nproc
    args.save = str(save_dir)
    args.ckpt_format = "torch_dist"
    args.use_dist_ckpt = True
    args.async_save = False
    args.non_persistent_ckpt_type = None
    args.use_distributed_optimizer = False  # as ours here: megatron-core's FP32Optimizer
    args.data_parallel_random_init = False
    args.no_save_optim = False
    args.no_save_rng = False
    args.log_progress = False
    return args


class _MegatronLMOptimizer:
    """Our optimizer as Megatron-LM's ``save_checkpoint`` calls it (with its metadata, which
    our save passes too), so both saves write the same Adam moments."""

    is_stub_optimizer = False

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def sharded_state_dict(self, state_dict: dict, metadata: dict | None = None) -> dict:
        return self.optimizer.sharded_state_dict(state_dict["model"], metadata=metadata)


@contextlib.contextmanager
def _cuda_rng_state_on_cpu() -> Iterator[None]:
    """Megatron-LM's save reads ``torch.cuda.get_rng_state()``, which fails without CUDA; on a
    CPU it gets the empty state that our save writes there."""
    if on_gpu():
        yield
        return
    original = torch.cuda.get_rng_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    try:
        yield
    finally:
        torch.cuda.get_rng_state = original


def _without_rank(common: dict) -> dict:
    """The common state that every rank must agree on, as Megatron-LM's training loop gives it
    to ``save_checkpoint``: its arguments but each process's own rank."""
    args = {k: v for k, v in vars(common["args"]).items() if k not in ("rank", "local_rank")}
    return {**common, "args": args}


def save_megatron_lm(
    state: TrainingState, save_dir: Path, *, checkout: Path, nproc: int
) -> Callable[[int], None]:
    """``save(iteration)`` with Megatron-LM's ``save_checkpoint`` (torch_dist, its defaults:
    fully parallel save, save strategy kept across saves as its training loop keeps it)."""
    checkpointing = import_megatron_lm_checkpointing(checkout)
    from megatron.core.rerun_state_machine import initialize_rerun_state_machine
    from megatron.training import global_vars

    global_vars.set_args(megatron_lm_args(save_dir, nproc))
    initialize_rerun_state_machine()  # as Megatron-LM's start-up does (disabled by default)
    optimizer = _MegatronLMOptimizer(state.optimizer)
    context: dict = {}  # Megatron-LM's training loop passes one dict to every save

    def save(iteration: int) -> None:
        # its two progress lines per save would break up the table
        with _cuda_rng_state_on_cpu(), contextlib.redirect_stdout(io.StringIO()):
            checkpointing.save_checkpoint(
                iteration,
                [state.model],
                optimizer,
                state.scheduler,
                0,  # floating-point operations so far
                checkpointing_context=context,
                preprocess_common_state_dict_fn=_without_rank,
            )

    return save


# --- processes, table, JSON --------------------------------------------------------------------

IMPLEMENTATIONS = ("ours", "megatron_lm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, which: str, options: argparse.Namespace, port: int, out: str) -> None:
    """One rank: build, save ``options.saves`` times with ``which``; rank 0 writes its seconds
    and the model's size to ``out``."""
    nproc = options.nproc
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    logging.basicConfig(level=logging.WARNING)
    # megatron-core's import-time notices that the fused kernels (Apex / TE) are absent
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    save_dir = Path(options.save_dir) / which
    with build_training_state(nproc=nproc) as state:
        if which == "ours":
            save = save_ours(state, save_dir)
        else:
            save = save_megatron_lm(
                state, save_dir, checkout=Path(options.megatron_lm), nproc=nproc
            )
        seconds = time_saves(save, saves=options.saves)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "parameters": state.parameters}))


def measure(which: str, options: argparse.Namespace) -> dict:
    """Seconds per save of ``which`` (rank 0's) in a fresh set of ``options.nproc`` processes:
    each implementation pays its own first-save costs, as a training run would."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "rank0.json")
        mp.start_processes(
            _rank_main,
            args=(which, options, _free_port(), out),
            nprocs=options.nproc,
            start_method="spawn",
        )
        return json.loads(Path(out).read_text())


def summarize(seconds: list[float]) -> dict:
    """Median, fastest and first of ``seconds``, and the list."""
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "first_s": seconds[0],
        "seconds": seconds,
    }


def table(results: dict) -> str:
    """A markdown table of ``results["implementations"]`` and the ratio ours / Megatron-LM's."""
    lines = [
        "| save_checkpoint | median s | min s | first s |",
        "|---|---|---|---|",
    ]
    names = {"ours": "ours (memo_ext)", "megatron_lm": "Megatron-LM"}
    for which, row in results["implementations"].items():
        figures = [row["median_s"], row["min_s"], row["first_s"]]
        lines.append(f"| {names[which]} | " + " | ".join(f"{x:.3f}" for x in figures) + " |")
    ratio = results.get("ratio_median")
    if ratio is None:
        lines.append(f"\nMegatron-LM comparison skipped: {results['skipped']}")
    else:
        lines.append(f"\nours / Megatron-LM (median): {ratio:.2f}")
    return "\n".join(lines)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=_at_least_one, default=5, help="saves per implementation")
    parser.add_argument(
        "--nproc", type=_at_least_one, default=2, help="gloo processes (data parallel)"
    )
    parser.add_argument(
        "--megatron-lm",
        metavar="PATH",
        help="a Megatron-LM checkout to compare with (its megatron/core must match the "
        "installed megatron-core); without it only ours is timed",
    )
    parser.add_argument(
        "--save-dir", metavar="DIR", help="where the checkpoints go (default: a temporary folder)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    return parser


def run(options: argparse.Namespace) -> dict:
    """Time ours (and Megatron-LM's with ``--megatron-lm``); the results as written to JSON."""
    if options.megatron_lm:
        check_megatron_lm(Path(options.megatron_lm))
    with contextlib.ExitStack() as stack:
        if options.save_dir is None:
            options.save_dir = stack.enter_context(tempfile.TemporaryDirectory())
        implementations, parameters = {}, None
        for which in IMPLEMENTATIONS if options.megatron_lm else IMPLEMENTATIONS[:1]:
            measured = measure(which, options)
            implementations[which] = summarize(measured["seconds"])
            parameters = measured["parameters"]
    results = {
        "nproc": options.nproc,
        "saves": options.saves,
        "parameters": parameters,
        "implementations": implementations,
    }
    if options.megatron_lm:
        ours, theirs = implementations["ours"], implementations["megatron_lm"]
        results["ratio_median"] = ours["median_s"] / theirs["median_s"]
        results["ratio_min"] = ours["min_s"] / theirs["min_s"]
    else:
        results["skipped"] = "no --megatron-lm PATH given"
    return results


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    results = run(options)
    print(
        f"{results['parameters']:,} parameters, {options.nproc} processes, "
        f"{options.saves} saves each"
    )
    print(table(results))
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
