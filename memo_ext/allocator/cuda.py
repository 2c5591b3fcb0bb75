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
  their sources alive until the compute stream has waited for them (its ping-pong slots), and
  NCCL holds a collective's tensors until the collective ends instead of recording streams
  (``TORCH_NCCL_AVOID_RECORD_STREAMS=1``, set here before any process group exists). Megatron's
  own activation offloading records streams and is refused with ``--memo``.
"""

from __future__ import annotations

import os

from memo_ext.allocator.core import AllocatorCore
from memo_ext.allocator.shim import bind_shim
from memo_ext.errors import UsageError

_installed: list[AllocatorCore] = []

NCCL_HOLDS_TENSORS = "TORCH_NCCL_AVOID_RECORD_STREAMS"


def install_cuda_allocator(core: AllocatorCore) -> None:
    """Make ``core`` (on its CUDA backend) this process's CUDA allocator, before CUDA is used.

    Raises:
        UsageError: ``TORCH_NCCL_AVOID_RECORD_STREAMS`` is set to something else than 1.
        AllocatorCoreError: the core or the shim cannot be used (a sentence from them).
    """
    import torch

    if os.environ.setdefault(NCCL_HOLDS_TENSORS, "1") != "1":
        raise UsageError(
            f"--memo-allocator plan needs {NCCL_HOLDS_TENSORS}=1 (NCCL's record_stream does "
            f"nothing under a pluggable allocator); unset it or set it to 1, not "
            f"{os.environ[NCCL_HOLDS_TENSORS]!r}"
        )
    core.init("cuda")
    shim = bind_shim(core)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        shim.path, "memo_cuda_alloc", "memo_cuda_free"
    )
    torch.cuda.memory.change_current_allocator(allocator)
    _installed.append(core)


def cuda_allocator_installed() -> bool:
    """Whether this process's CUDA allocations go through the allocator core (torch's own
    memory statistics raise then)."""
    return bool(_installed)
