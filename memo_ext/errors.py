"""The exception bases every entry point reports without a traceback.

An error that derives from :class:`ReportedError` carries a message that is the whole story: what
went wrong and what to do. ``pretrain_gpt_memo.py`` and the tools print it as one line and exit
with its ``exit_status``: 1 for a failure, 2 for bad input (:class:`UsageError`), 3 for out of
memory (:class:`OutOfMemory`, which :func:`out_of_memory` makes of the allocators' own errors).
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re

REPORTS_ERRORS = "MEMO_EXT_LAUNCH_REPORTS_ERRORS"
"""Set by ``memo_ext.launch`` for its workers: a worker's one-sentence error goes to its error
file only, and the launcher prints it once."""


class ReportedError(Exception):
    """A failure the user can act on (a corrupt checkpoint, a diverged run): exit status 1."""

    exit_status = 1


class UsageError(ReportedError, ValueError):
    """A flag, file or setting that cannot run; the message says what to change (exit status 2).

    Raised before any expensive work wherever the problem can be seen that early.
    """

    exit_status = 2


class OutOfMemory(ReportedError):
    """The run asked for more device (or, on CPU, process) memory than there is: exit status 3,
    so that a launcher can tell "too big for this machine" from bad input and from a crash."""

    exit_status = 3

    def __init__(self, message: str, *, requested_bytes: int | None = None) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        """Bytes of the allocation that failed, where the allocator said."""


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate N
# bytes"; its CUDA allocator: "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has ..."
_CPU_REQUEST = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_CUDA_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
# numpy: "Unable to allocate 391. KiB for an array with shape (100000,) and data type int32"
_NUMPY_REQUEST = re.compile(r"Unable to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB) for an array")


def out_of_memory(error: BaseException, *, capped: bool = False) -> OutOfMemory | None:
    """The :class:`OutOfMemory` an exception stands for (torch's CPU or CUDA allocator failing, a
    Python ``MemoryError``), or ``None`` for any other exception. ``capped``: the process runs
    under a memory limit, where oneDNN's "could not create a primitive" is its allocation
    failing too (its scratch memory); without a limit that error has other causes. A library
    that wraps the failure in an error of its own (megatron-core's dataset builder: "failed to
    build") keeps it as the cause: the chain is searched."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = _out_of_memory(error, capped=capped)
        if found is not None:
            return found
        error = error.__cause__ or error.__context__
    return None


def _out_of_memory(error: BaseException, *, capped: bool) -> OutOfMemory | None:
    text = str(error)
    cpu = _CPU_REQUEST.search(text)
    cuda = _CUDA_REQUEST.search(text) or _NUMPY_REQUEST.search(text)
    is_oom = (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"  # torch.OutOfMemoryError, without torch
        or cpu is not None
        or "CUDA out of memory" in text
        or (capped and "could not create a primitive" in text)
    )
    if not is_oom:
        return None
    requested = None
    if cpu:
        requested = int(cpu.group(1))
    elif cuda:
        requested = int(float(cuda.group(1)) * _UNITS[cuda.group(2)])
    asked = "the allocator gave no size"
    if requested is not None:
        asked = f"tried to allocate {requested} bytes, {requested / 2**30:.2f} GiB"
    return OutOfMemory(
        f"out of memory ({asked}); shorten --seq-length or --micro-batch-size, add --memo or "
        "recomputation, or spread the model over more processes",
        requested_bytes=requested,
    )
