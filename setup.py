"""Builds the allocator core (``memo_ext/allocator/core.c``) next to the Python package.

``pyproject.toml`` holds the metadata; this file only adds the compiled part::

    pip install -e . --no-deps --no-build-isolation     # or: make install

The core is plain C11 with no Python, CUDA or torch headers: the result is a shared library that
``memo_ext.allocator.core`` loads with ctypes (the ``.cpython-*.so`` name is setuptools'; there is
no ``PyInit`` function). Without a build, ``memo_ext.allocator.core`` compiles the same source on
first use into a per-user cache.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

CORE_SOURCE = "memo_ext/allocator/core.c"
# The library carries its source's digest, so memo_ext.allocator.core can tell a stale build.
CORE_DIGEST = hashlib.sha256((Path(__file__).parent / CORE_SOURCE).read_bytes()).hexdigest()[:16]

ALLOCATOR_CORE = Extension(
    "memo_ext.allocator._core",
    sources=[CORE_SOURCE],
    define_macros=[("MEMO_SOURCE_DIGEST", f'"{CORE_DIGEST}"')],
    extra_compile_args=["-std=c11", "-O2", "-fvisibility=default"],
    extra_link_args=["-pthread"],
    # dlopen / dlsym for the CUDA runtime (in libc itself from glibc 2.34 on).
    libraries=["dl"],
    # Without a C compiler the install still succeeds; the core is then compiled on first use
    # (or its absence is reported in one sentence) by memo_ext.allocator.core.
    optional=True,
)

setup(
    ext_modules=[ALLOCATOR_CORE],
    package_data={
        "memo_ext.allocator": ["core.c", "torch_shim.cpp"],
        "memo_ext.simulate": ["cuda_shim.cpp", "site/sitecustomize.py", "bin/nvidia-smi"],
    },
)
