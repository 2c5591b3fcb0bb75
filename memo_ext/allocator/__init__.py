"""The run-time side of a memory plan: tensors served at their planned offsets in one region.

``memo_ext.planner`` makes plans (``tools/plan_memory.py``); this package serves them
(``--memo-allocator plan``, through ``memo_ext.memo.planned_memory``).

Modules:
    core.c: the allocator core in plain C (arena, passes, hit / miss rules, exact-size caching
        fallback); built by ``setup.py`` as ``memo_ext.allocator._core`` or compiled on first use.
    core: ``AllocatorCore``, the core driven from Python through ctypes; its docstring is the
        design.
    shim: the torch shim (``torch_shim.cpp``, compiled on first use) between torch's allocators
        and the core.
    cuda: ``install_cuda_allocator``, the core behind torch's CUDA allocator (a pluggable
        allocator that raises ``torch.OutOfMemoryError`` where the core runs out); what torch's
        own memory statistics and ``record_stream`` become under it.
    cpu: ``install_cpu_allocator``, the same core behind torch's CPU allocator, so plans are
        served and tested on CPU.
"""

from memo_ext.allocator.core import (
    AllocatorCore,
    AllocatorCoreError,
    CoreBuildError,
    PlanRefused,
    load_core,
    so_path,
)
from memo_ext.allocator.cpu import (
    ShimBuildError,
    cpu_allocator_installed,
    install_cpu_allocator,
    uninstall_cpu_allocator,
)

__all__ = [
    "AllocatorCore",
    "AllocatorCoreError",
    "CoreBuildError",
    "PlanRefused",
    "ShimBuildError",
    "cpu_allocator_installed",
    "install_cpu_allocator",
    "load_core",
    "so_path",
    "uninstall_cpu_allocator",
]
