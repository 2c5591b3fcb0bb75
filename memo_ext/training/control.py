"""When a run stops, saves or refuses to go on: ``--exit-interval``, ``--exit-duration-in-mins``
and signals (:class:`StopConditions`), ``--save-interval`` (:func:`save_due`), a checkpoint past
the run's end (:func:`check_resumable`), non-finite losses and gradients (:func:`check_finite`).

A scheduler's SIGTERM may reach one rank before the others, and clocks drift, so the decision
is made together: at every step boundary each rank contributes what it saw to one all-reduce,
and all ranks stop (after saving) at the same iteration.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from memo_ext.collectives import all_reduce_values
from memo_ext.config import CheckpointConfig, RunConfig
from memo_ext.errors import ReportedError, UsageError
from memo_ext.training.checkpoint import (
    TRACKER,
    iteration_dir,
    latest_iteration,
    saved_iterations,
)
from memo_ext.training.checkpoint.identity import another_model, identity_of, recorded_identity

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopConditions:
    """Context manager that installs the signal handlers (if asked) and answers ``reason``."""

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.start = time.monotonic()
        self.signal_received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopConditions:
        if self.config.exit_signal_handler:
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only note it: the step in flight finishes, then every rank saves together
        self.signal_received = signum
        logger.warning(
            "received %s; saving and exiting at the next step boundary", signal.Signals(signum).name
        )

    def reason(self, iteration: int) -> str | None:
        """Why the run should stop after ``iteration`` (the same answer on every rank)."""
        c = self.config
        if c.exit_interval and iteration % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        if not (c.exit_signal_handler or c.exit_duration_in_mins):
            return None
        minutes = (time.monotonic() - self.start) / 60.0
        signalled, minutes = all_reduce_values(
            [float(self.signal_received is not None), minutes], op=dist.ReduceOp.MAX
        )
        if signalled > 0:
            return "signal received"
        if c.exit_duration_in_mins and minutes >= c.exit_duration_in_mins:
            return f"--exit-duration-in-mins {c.exit_duration_in_mins}"
        return None


class TrainingDiverged(ReportedError):
    """A non-finite loss or gradient norm; the message points at the last good checkpoint."""


def check_finite(run: RunConfig, iteration: int, loss: float, grad_norm: float | None) -> bool:
    """True when the step is usable; raise (or, when skipping, return False) otherwise."""
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return True
    if not run.train.check_for_nan_in_loss_and_grad:
        return True
    if run.train.skip_iterations_with_nan:
        logger.warning(
            "iteration %d: loss %s, grad norm %s; update skipped", iteration, loss, grad_norm
        )
        return False
    raise TrainingDiverged(
        f"iteration {iteration}: loss {loss}, gradient norm {grad_norm}; "
        + _last_good_checkpoint_hint(run, iteration)
    )


class LossWatch:
    """A loss that blows up while staying finite (too high an LR, say) trains on, and is saved
    like any other: this watches the training loss against its best so far and, when it rises
    far above it (by :data:`RISE` nats or half the best, whichever is more), says which
    checkpoint is the last one saved before the rise, again at every save made during it and at
    the end of the run. It takes the loss back as near its best only once it is within half
    that margin, and counts a save as good only then."""

    RISE = 1.0

    def __init__(self, *, save_dir: str | None, saved_at: int | None = None) -> None:
        self.save_dir = save_dir
        self.best, self.best_at = math.inf, 0
        self.rose_at: int | None = None
        """The step whose loss rose far above the best; None while the loss is near it."""
        self.last_loss = math.inf
        self.good_save = saved_at
        """The last checkpoint saved while the loss was near its best."""

    def step(self, iteration: int, loss: float) -> None:
        if not math.isfinite(loss):
            return  # check_finite's to handle
        self.last_loss = loss
        if loss < self.best:
            self.best, self.best_at = loss, iteration
        margin = max(self.RISE, 0.5 * self.best)
        if self.rose_at is None and loss > self.best + margin:
            self.rose_at = iteration
            logger.warning("iteration %d: %s", iteration, self._rise())
        elif self.rose_at is not None and loss <= self.best + margin / 2:  # not on noise
            logger.info(
                "iteration %d: the loss %.4f is back near its best, %.4f",
                iteration,
                loss,
                self.best,
            )
            self.rose_at = None

    def saved(self, iteration: int) -> None:
        if self.rose_at is not None:
            logger.warning("saved iteration %d during the rise: %s", iteration, self._kept())
        elif self.last_loss <= self.best + max(self.RISE, 0.5 * self.best) / 2:
            self.good_save = iteration

    def closing_note(self) -> str | None:
        """The line that ends a run whose loss is still far above its best, else None."""
        return None if self.rose_at is None else f"at the end: {self._rise()}"

    def _rise(self) -> str:
        return (
            f"the loss {self.last_loss:.4f} is far above its best, {self.best:.4f} at iteration "
            f"{self.best_at}, since iteration {self.rose_at} (diverging? a lower --lr may "
            f"help); {self._kept()}"
        )

    def _kept(self) -> str:
        if self.good_save is None or not self.save_dir:
            return "no checkpoint was saved before the rise"
        return (
            f"the last checkpoint saved before the rise is iteration {self.good_save} in "
            f"{self.save_dir}"
        )


def _last_good_checkpoint_hint(run: RunConfig, iteration: int) -> str:
    """Where to resume from after step ``iteration`` diverged. The checkpoint of step
    ``iteration - 1`` holds the weights that step computed its NaN from (an absurd update
    leaves them finite but huge): only one of an earlier step, whose successor's loss was
    finite, is good."""
    for directory in (run.checkpoint.save, run.checkpoint.load):
        if not directory or (latest := latest_iteration(Path(directory))) is None:
            continue
        if latest < iteration - 1:
            return (
                f"the last good checkpoint is iteration {latest} in {directory} "
                f"(resume with --load {directory}, e.g. with a lower --lr)"
            )
        earlier = [k for k in saved_iterations(Path(directory)) if k < iteration - 1]
        diverged = (
            f"the latest checkpoint in {directory}, iteration {latest}, holds the weights "
            f"this step diverged from"
        )
        if not earlier:
            return f"{diverged}, and no earlier one was kept: start again with a lower --lr"
        return (
            f"{diverged}; the last good one is iteration {earlier[-1]} (resume from it: write "
            f"{earlier[-1]} to {Path(directory) / TRACKER} and --load {directory}, e.g. with "
            "a lower --lr)"
        )
    return "no checkpoint was saved (use --save DIR --save-interval N to keep one)"


def check_resumable(run: RunConfig) -> None:
    """A checkpoint to resume must fit the run, every misfit named in one message: one past
    --train-iters would train nothing and exit as if it had; one of another model (by the
    model its manifest records) would not load. Checked on the tracker and the manifest,
    before the checkpoint is read (the load checks the model again on the built model, and
    checks Megatron-LM's checkpoints, which record theirs elsewhere).

    Raises:
        UsageError: naming each problem and what to change.
    """
    root = Path(run.checkpoint.load)
    iteration = latest_iteration(root)
    if iteration is None:
        return
    problems = [
        problem
        for problem in (_past_the_end(run, iteration), _another_model(run, root, iteration))
        if problem is not None
    ]
    if len(problems) > 1:
        listed = "; ".join(f"({n}) {problem}" for n, problem in enumerate(problems, 1))
        raise UsageError(f"--load {root} does not fit this run on {len(problems)} counts: {listed}")
    if problems:
        raise UsageError(problems[0])
    if iteration == run.train.train_iters:
        logger.info("the checkpoint is at iteration %d: training is complete", iteration)


def _past_the_end(run: RunConfig, iteration: int) -> str | None:
    if iteration <= run.train.train_iters:
        return None
    length = f"--train-iters {run.train.train_iters}"
    if run.train.sample_based:
        length = f"the {run.train.train_iters} steps of --train-samples {run.train.train_samples}"
    flag = "--train-samples" if run.train.sample_based else "--train-iters"
    return (
        f"the checkpoint in {run.checkpoint.load} is at iteration {iteration}, past "
        f"{length}; raise {flag} to train further"
    )


def _another_model(run: RunConfig, root: Path, iteration: int) -> str | None:
    directory = iteration_dir(root, iteration)
    here = identity_of(
        run.shape,
        zero_centred_norms=run.model.apply_layernorm_1p,
        embedding_rows=run.model.padded_vocab_size,
        tied=not run.model.untie_embeddings_and_output_weights,
    )
    return another_model(directory, saved=recorded_identity(directory), here=here)


def save_due(iteration: int, run: RunConfig) -> bool:
    """At every ``--save-interval`` and at the end of training, when ``--save`` is set."""
    ckpt = run.checkpoint
    if not ckpt.save:
        return False
    if iteration == run.train.train_iters:
        return True
    return bool(ckpt.save_interval) and iteration % ckpt.save_interval == 0
