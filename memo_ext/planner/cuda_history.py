"""Traces of a real CUDA step, from PyTorch's allocator history.

With ``torch.cuda.memory._record_memory_history()`` on, the caching allocator logs every block
it hands out (``alloc``) and takes back (``free_requested``: the program released it;
``free_completed``: every stream that used it is done), with the block's address and size.
``torch.cuda.memory._snapshot()`` returns the log per device as ``device_traces`` and
``torch.cuda.memory._dump_snapshot(path)`` pickles it. This module turns one device's log into a
``memo-trace/1`` trace, so that a plan can be made from what a real step allocated, or the
fake-tensor trace of the same step compared with it.

A block's lifetime runs from its ``alloc`` to the program's release (``free_requested``, or
``free_completed`` when no request was logged). Blocks allocated before the history was switched
on are not in the log; their frees are skipped and counted in the trace's ``meta``. Sizes are
what the program asked for (the log's ``size`` is the request): the caching allocator's own
figures (``max_memory_allocated``) count its blocks, each request rounded up to 512 bytes, which
``problem_from_trace(trace, alignment=512)`` reproduces.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from memo_ext.device import on_gpu
from memo_ext.planner.errors import PlannerInputError
from memo_ext.planner.trace import Alloc, Event, Free, Trace

RELEASES = ("free_requested", "free_completed")


def _frame_name(entry: dict) -> str | None:
    """The innermost Python frame of an entry's stack, as ``function (file:line)``."""
    for frame in entry.get("frames") or []:
        filename = str(frame.get("filename", ""))
        if filename.endswith(".py"):
            return f"{frame.get('name')} ({Path(filename).name}:{frame.get('line')})"
    return None


def trace_from_cuda_snapshot(snapshot: object, *, device: int = 0) -> Trace:
    """Converts one device's allocator history into a trace.

    Args:
        snapshot: what ``torch.cuda.memory._snapshot()`` returns (or a pickle of it loaded).
        device: the CUDA device whose history to convert.

    Raises:
        PlannerInputError: not a snapshot with history, no such device, or an alloc at an
            address whose block is still live.
    """
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise PlannerInputError(
            "not a PyTorch memory snapshot with allocator history (record one with "
            "torch.cuda.memory._record_memory_history() and torch.cuda.memory._snapshot())"
        )
    histories = snapshot["device_traces"]
    if not 0 <= device < len(histories):
        raise PlannerInputError(
            f"the snapshot has the history of {len(histories)} device(s); there is no device "
            f"{device}"
        )
    events: list[Event] = []
    live: dict[int, str] = {}
    skipped = 0
    for k, entry in enumerate(histories[device]):
        action, address = entry.get("action"), entry.get("addr")
        if action == "alloc":
            if address in live:
                raise PlannerInputError(
                    f"CUDA history entry {k}: alloc at {address:#x} while block "
                    f"{live[address]!r} there is live"
                )
            live[address] = f"b{len(events)}"
            events.append(Alloc(id=live[address], size=int(entry["size"]), name=_frame_name(entry)))
        elif action in RELEASES:
            if address in live:
                events.append(Free(id=live.pop(address)))
            elif action == "free_requested":
                skipped += 1  # allocated before the history started
    meta = {"source": "cuda-allocator-history", "device": device, "frees_before_history": skipped}
    return Trace(events=events, meta=meta)


class _DataOnlyUnpickler(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: a pickle that names any class or function
    (which unpickling would import and may call) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(
            f"it names {module}.{name}; a memory snapshot holds only plain data, and loading "
            "what it names could run code"
        )


def load_cuda_snapshot(path: str | Path, *, device: int = 0) -> Trace:
    """Reads a snapshot pickled by ``torch.cuda.memory._dump_snapshot`` as a trace.

    Only plain data is unpickled (:class:`_DataOnlyUnpickler`): a file that names a class or
    function is refused, so a crafted file cannot run code.
    """
    try:
        with Path(path).open("rb") as handle:
            snapshot = _DataOnlyUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise PlannerInputError(f"{str(path)!r} is not a pickled memory snapshot ({err})") from None
    trace = trace_from_cuda_snapshot(snapshot, device=device)
    trace.meta["path"] = str(path)
    return trace


def trace_cuda_step(step: Callable[[], object], *, max_entries: int = 1_000_000) -> Trace:
    """Runs ``step`` once with the allocator history on and returns its trace (needs CUDA).

    The current device's history is converted; blocks allocated before ``step`` (weights,
    optimizer state) are not in it.
    """
    if not on_gpu():
        raise RuntimeError("trace_cuda_step needs CUDA; trace on CPU with fake tensors instead")
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return trace_from_cuda_snapshot(snapshot, device=torch.cuda.current_device())
