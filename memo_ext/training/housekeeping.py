"""What the trainer does around its steps that changes no result: Python garbage collection at
fixed points (``--manual-gc``), handing cached device memory back
(``--empty-unused-memory-level``), profiling a window of steps (``--profile``), and the
one-line notices of flags that cannot act on this machine.

The step loop (``memo_ext.training.loop``) calls :class:`Housekeeping` at the start, before and
after each step, around each evaluation and at the end; :func:`maybe_empty_cache` inside a step.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from memo_ext import device
from memo_ext.config import CleanupConfig, ProfileConfig, RunConfig
from memo_ext.features.extensions import own_layouts

logger = logging.getLogger(__name__)


def maybe_empty_cache(cleanup: CleanupConfig, *, level: int) -> None:
    """``torch.cuda.empty_cache()`` when --empty-unused-memory-level is at least ``level``
    (1: after the forward / backward passes and each validation batch; 2: also after the
    optimizer step), as Megatron-LM. There is no caching allocator to empty on CPU."""
    if cleanup.empty_unused_memory_level >= level:
        device.empty_cache()


class ManualGC:
    """--manual-gc: the automatic collector off while training; full collections every
    ``manual_gc_interval`` steps and before each evaluation, a young-generation collection
    after it (the evaluation's own garbage), as Megatron-LM. Ranks then pause together instead
    of one stalling the others' collectives at a random step."""

    def __init__(self, cleanup: CleanupConfig):
        self.cleanup = cleanup
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.cleanup.manual_gc:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        interval = self.cleanup.manual_gc_interval
        if self.cleanup.manual_gc and interval and iteration % interval == 0:
            gc.collect()

    @contextmanager
    def around_evaluation(self) -> Iterator[None]:
        collect = self.cleanup.manual_gc and self.cleanup.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)

    def stop(self) -> None:
        """The collector as it was before :meth:`start`."""
        if self.cleanup.manual_gc and self._was_enabled:
            gc.enable()


def trace_path(trace_dir: str | Path, *, rank: int, first: int, last: int) -> Path:
    """Where a rank's torch.profiler trace of iterations ``first``–``last`` goes: a Chrome trace
    (JSON) that Perfetto opens and TensorBoard's profiler plugin finds (``*.pt.trace.json``)."""
    return Path(trace_dir) / f"rank{rank}_iter{first}-{last}.pt.trace.json"


class StepProfiler:
    """--profile on the ranks of --profile-ranks: iterations [start, end) under torch.profiler
    (with the step before as its warm-up, as Megatron-LM's schedule), or, on CUDA without
    --use-pytorch-profiler, inside a cudaProfilerStart / Stop range with NVTX ranges for nsys."""

    def __init__(self, profile: ProfileConfig, *, rank: int, trace_dir: str | Path, cuda: bool):
        self.profile = profile
        self.active = profile.enabled and rank in profile.ranks
        self.use_torch = profile.use_pytorch_profiler or not cuda
        self.rank, self.trace_dir, self.cuda = rank, Path(trace_dir), cuda
        self.written: Path | None = None
        """The trace file, once written."""
        self._torch: torch.profiler.profile | None = None
        self._nvtx = None
        self._started = False
        self._first = self._last_run = profile.first_iteration

    def before_step(self, iteration: int) -> None:
        if not self.active or self._started:
            return
        first, end = self.profile.first_iteration, self.profile.step_end
        if self.use_torch and iteration == first - 1:
            self._start_torch(first=first, warmup=1)
        elif first <= iteration < end:  # also a run resumed inside the window: no warm-up
            if self.use_torch:
                self._start_torch(first=iteration, warmup=0)
            else:
                self._start_nsys()

    def after_step(self, iteration: int) -> None:
        self._last_run = iteration
        if self._torch is not None:
            self._torch.step()  # the last recorded step's end writes the trace
            if iteration >= self.profile.step_end - 1:
                self.close()
        elif self._nvtx is not None and iteration >= self.profile.step_end - 1:
            self.close()

    def close(self) -> None:
        """Stop a window still open (a run that stopped inside it writes what it recorded)."""
        if self._torch is not None:
            self._torch.stop()
            self._torch = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.profiler.stop()
            logger.info("profiler: nsys capture range closed")

    def _last(self) -> int:
        """The window's last iteration, or the last one run when the run stopped inside it."""
        return min(self.profile.step_end - 1, self._last_run)

    def _start_torch(self, *, first: int, warmup: int) -> None:
        self._started, self._first = True, first
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        active = self.profile.step_end - first
        self._torch = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
            with_stack=True,
        )
        self._torch.start()

    def _write(self, prof: torch.profiler.profile) -> None:
        path = trace_path(self.trace_dir, rank=self.rank, first=self._first, last=self._last())
        prof.export_chrome_trace(str(path))
        self.written = path
        logger.info(
            "profiler: rank %d, iterations %d-%d: trace written to %s (open it in Perfetto, "
            "ui.perfetto.dev, or TensorBoard's profiler plugin)",
            self.rank,
            self._first,
            self._last(),
            path,
        )

    def _start_nsys(self) -> None:
        self._started = True
        torch.cuda.profiler.start()  # cudaProfilerStart: nsys --capture-range=cudaProfilerApi
        self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
        self._nvtx.__enter__()
        logger.info(
            "profiler: nsys capture range open from iteration %d to %d (run under nsys profile "
            "--capture-range=cudaProfilerApi to record it)",
            self.profile.first_iteration,
            self.profile.step_end - 1,
        )


class Housekeeping:
    """:class:`ManualGC` and :class:`StepProfiler` of a run, as the step loop calls them."""

    def __init__(self, run: RunConfig, *, rank: int):
        self.gc = ManualGC(run.cleanup)
        cuda = device.on_gpu()
        self.profiler = StepProfiler(run.profile, rank=rank, trace_dir=run.profile_dir, cuda=cuda)
        profile = run.profile
        if profile.enabled and rank == 0:  # the other ranks' own lines are not shown
            where = "an nsys capture range"
            if self.profiler.use_torch:
                where = f"torch.profiler traces in {run.profile_dir}"
            logger.info(
                "profiler: ranks %s record iterations %d-%d: %s",
                " ".join(map(str, profile.ranks)),
                profile.first_iteration,
                profile.step_end - 1,
                where,
            )

    def start(self) -> None:
        self.gc.start()

    def before_step(self, iteration: int) -> None:
        self.profiler.before_step(iteration)

    def after_step(self, iteration: int) -> None:
        self.profiler.after_step(iteration)
        self.gc.after_step(iteration)

    def around_evaluation(self):
        return self.gc.around_evaluation()

    def close(self) -> None:
        self.profiler.close()
        self.gc.stop()


def notices_for_this_machine(run: RunConfig, *, cuda: bool) -> list[str]:
    """One line per given flag that cannot act here; the run goes on without it."""
    notes = []
    d = run.distributed
    if run.cleanup.empty_unused_memory_level and not cuda:
        notes.append(
            "--empty-unused-memory-level does nothing on CPU: there is no CUDA caching allocator"
        )
    layouts = own_layouts(run)
    for flag, given in (
        ("--overlap-grad-reduce", d.overlap_grad_reduce),
        ("--overlap-param-gather", d.overlap_param_gather),
    ):
        if given and layouts is not None:
            notes.append(
                f"{flag} is not applicable with {layouts.flag}; training goes on without it"
            )
    fusion = run.model.cross_entropy_loss_fusion
    if fusion and not cuda:
        notes.append(
            "--cross-entropy-loss-fusion is not applicable on CPU; training goes on without it"
        )
    elif fusion and layouts is not None:
        notes.append(
            f"--cross-entropy-loss-fusion is not applicable with {layouts.flag}; training goes "
            "on without it"
        )
    if d.grad_reduce_in_bf16 and not run.train.bf16:
        notes.append("--grad-reduce-in-bf16 applies with --bf16: fp32 weights get fp32 gradients")
    if run.profile.enabled and not run.profile.use_pytorch_profiler and not cuda:
        notes.append(
            "--profile without --use-pytorch-profiler opens an nsys range, which needs CUDA; "
            "writing a torch.profiler trace instead"
        )
    return notes
