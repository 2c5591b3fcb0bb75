"""The run-time side of a memory plan: tensors served at their planned offsets in one region.

``memo_ext.planner`` makes plans (``tools/plan_memory.py``); this package serves them. The
training loop does not use it yet.

Modules:
    core.c: the allocator core in plain C (arena, passes, hit / miss rules, exact-size caching
        fallback); built by ``setup.py`` as ``memo_ext.allocator._core`` or compiled on first use.
    core: ``AllocatorCore``, the core driven from Python through ctypes; its docstring is the
        design. On a GPU, ``torch.cuda.memory.CUDAPluggableAllocator(so_path(), "memo_alloc",
        "memo_free")`` puts the core behind torch's CUDA allocator.
    cpu: ``install_cpu_allocator``, the same core behind torch's CPU allocator through a small
        C++ shim (``cpu_shim.cpp``, compiled on first use), so plans are served and tested on CPU.
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
