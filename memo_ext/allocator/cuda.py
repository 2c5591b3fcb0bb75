"""The allocator core behind torch's CUDA allocator (``--memo-allocator plan`` on a GPU).

``torch.cuda.memory.CUDAPluggableAllocator(shim, "memo_cuda_alloc", "memo_cuda_free")`` routes
every CUDA allocation of the process through the torch shim (``torch_shim.cpp``) to the core.
torch wraps whatever pointer a pluggable ``alloc`` returns, NULL included, so the shim raises
``torch.OutOfMemoryError`` (with the bytes asked for) where the core runs out, instead of letting
the first kernel fault on an illegal address.

What torch 2.13 gives up under a pluggable allocator, and what stands in:

* ``torch.cuda.memory_stats``, ``memory_allocated``, ``max_memory_allocated``,
  ``reset_peak_memory_stats``, ``memory_snapshot`` and the allocator history raise: the core
  reports its own figures (the run's ``plan_*`` metrics and ``mem_*_bytes``), and our code calls
  none of torch's while :func:`cuda_allocator_installed` is true.
* ``empty_cache`` and ``Tensor.record_stream`` do nothing (no reset or record-stream function is
  set). The rule that keeps blocks safe without ``record_stream``: a freed block is handed out
  again only on the stream it was allocated on (the arena serves one stream, the fallback's free
  lists are per stream), so work queued there is ordered after its last use on that stream; work
  on another stream must be ordered before the free by whoever queued it. MEMO's copies keep
  their sources alive until the compute stream has waited for them (its ping-pong slots). NCCL
  records no streams: since torch 2.8 its process group runs a synchronous collective on the
  current stream and stashes an asynchronous one's tensors until it is waited for or ends (there
  ``TORCH_NCCL_AVOID_RECORD_STREAMS`` is deprecated and left alone); an older torch does so only
  with that variable at 1, which :func:`install_cuda_allocator` sets before any process group
  exists. Megatron's own activation offloading records streams and is refused with ``--memo``.
"""

from __future__ import annotations

import os

from memo_ext.allocator.core import AllocatorCore
from memo_ext.allocator.shim import bind_shim
from memo_ext.errors import UsageError

_installed: list[AllocatorCore] = []

NCCL_HOLDS_TENSORS = "TORCH_NCCL_AVOID_RECORD_STREAMS"
"""Before torch 2.8: at 1, NCCL holds a collective's tensors instead of recording streams."""

NCCL_STASHES_SINCE = (2, 8)
"""The first torch whose NCCL process group records no streams whatever the variable says (it
warns once per rank that the variable is deprecated when it is set)."""


def install_cuda_allocator(core: AllocatorCore) -> None:
    """Make ``core`` (on its CUDA backend) this process's CUDA allocator, before CUDA is used.

    Raises:
        UsageError: on a torch before 2.8, ``TORCH_NCCL_AVOID_RECORD_STREAMS`` set to something
            else than 1.
        AllocatorCoreError: the core or the shim cannot be used (a sentence from them).
    """
    import torch

    maybe_hold_nccl_tensors(torch_version=torch.__version__)
    core.init("cuda")
    shim = bind_shim(core)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        shim.path, "memo_cuda_alloc", "memo_cuda_free"
    )
    torch.cuda.memory.change_current_allocator(allocator)
    _installed.append(core)


def maybe_hold_nccl_tensors(*, torch_version: str) -> None:
    """On a torch before 2.8, make NCCL hold a collective's tensors (``record_stream`` does
    nothing under a pluggable allocator, so a block NCCL still reads could be handed out again);
    a newer torch always does, and the environment is left as it is.

    Raises:
        UsageError: on a torch before 2.8, the variable set to something else than 1.
    """
    from torch.torch_version import TorchVersion

    if TorchVersion(torch_version) >= NCCL_STASHES_SINCE:
        return
    if os.environ.setdefault(NCCL_HOLDS_TENSORS, "1") != "1":
        raise UsageError(
            f"--memo-allocator plan on torch {torch_version} needs {NCCL_HOLDS_TENSORS}=1 "
            f"(NCCL's record_stream does nothing under a pluggable allocator); unset it or set "
            f"it to 1, not {os.environ[NCCL_HOLDS_TENSORS]!r}"
        )


def cuda_allocator_installed() -> bool:
    """Whether this process's CUDA allocations go through the allocator core (torch's own
    memory statistics raise then)."""
    return bool(_installed)
