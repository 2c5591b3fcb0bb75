"""torch's CPU allocations through the allocator core, so plans are served (and tested) on CPU.

PyTorch has no Python hook for its CPU allocator, but ``c10::SetCPUAllocator(allocator,
priority)`` is in the wheel's C++ headers. The torch shim (``torch_shim.cpp``,
:mod:`memo_ext.allocator.shim`) defines a ``c10::Allocator`` whose ``allocate`` calls the core's
``memo_alloc(nbytes, -1, NULL)`` and whose deleter calls ``memo_free(ptr, 0, -1, NULL)``.

Tensors allocated before the install keep their own deleter, and tensors allocated while the
shim was installed keep the shim's (which calls the core) after an uninstall: installing late
and uninstalling early are both safe. The install is process-wide: every thread's CPU
allocations go through the core while it is installed (other threads' are ``miss_thread`` in a
pass). Example::

    core = AllocatorCore()
    core.init("host")
    with cpu_allocator_installed(core):
        x = torch.empty(1024)          # served by the core (core.stats()["fallback_requests"])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memo_ext.allocator.core import AllocatorCore, AllocatorCoreError
from memo_ext.allocator.shim import ShimBuildError, build_shim, loaded_shim

DEFAULT_PRIORITY = 200
"""c10 keeps the allocator set with the highest priority (ties: the latest); torch's own CPU
allocator registers with 0."""


def install_cpu_allocator(core: AllocatorCore, *, priority: int = DEFAULT_PRIORITY) -> None:
    """Makes torch's CPU allocator the core (``c10::SetCPUAllocator``), keeping the previous one
    for ``uninstall_cpu_allocator``.

    Raises:
        AllocatorCoreError: the core's backend is not ``host``, the shim is already installed,
            or an allocator of higher priority holds the CPU.
        ShimBuildError: the shim cannot be compiled.
    """
    if core.backend() != "host":
        raise AllocatorCoreError(
            f"the CPU shim needs the core on the host backend, not {core.backend()!r}; call "
            "core.init('host') first"
        )
    shim = build_shim()
    if shim.memo_shim_install(core.so_path().encode(), int(priority)) != 0:
        raise AllocatorCoreError(shim.memo_shim_last_error().decode())


def uninstall_cpu_allocator() -> None:
    """Restores the CPU allocator that was current before ``install_cpu_allocator``.

    Raises:
        AllocatorCoreError: the shim is not installed.
    """
    shim = build_shim()
    if shim.memo_shim_uninstall() != 0:
        raise AllocatorCoreError(shim.memo_shim_last_error().decode())


def cpu_allocator_installed_now() -> bool:
    """Whether torch's CPU allocator is the shim at this moment."""
    shim = loaded_shim()
    return shim is not None and bool(shim.memo_shim_installed())


@contextlib.contextmanager
def cpu_allocator_installed(
    core: AllocatorCore, *, priority: int = DEFAULT_PRIORITY
) -> Iterator[None]:
    """Routes torch's CPU allocations through ``core`` inside the block."""
    install_cpu_allocator(core, priority=priority)
    try:
        yield
    finally:
        uninstall_cpu_allocator()


__all__ = [
    "ShimBuildError",
    "cpu_allocator_installed",
    "install_cpu_allocator",
    "uninstall_cpu_allocator",
]
