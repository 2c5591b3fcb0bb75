"""Shared fixtures: a one-process megatron-core environment on the CPU."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from memo_ext.simulate import runtime as emulated_runtime
from tests.workers import close_pool, free_port

# the emulated-device tier runs in a process of its own (python -m tests.emulated; make test)
collect_ignore = [] if emulated_runtime.loaded() else ["emulated"]


def pytest_report_header(config):
    if not emulated_runtime.loaded():
        return "tests/emulated is not collected here: it runs as python -m tests.emulated"


def pytest_collection_modifyitems(config, items):
    """Every test of a tier's folder carries the tier's marker (``-m "not dist"`` and the like
    need no marker in each file), and the long tests run first: pytest-xdist hands tests out in
    this order, so a long one started last would keep one core busy while the others idle."""
    for item in items:
        tier = item.path.relative_to(config.rootpath).parts[1:2]
        if tier == ("dist",):
            item.add_marker(pytest.mark.dist)
        elif tier == ("gpu",):
            item.add_marker(pytest.mark.gpu)

    def rank(item) -> int:
        return (
            0 if item.get_closest_marker("launch") else 1 if item.get_closest_marker("slow") else 2
        )

    items.sort(key=rank)  # stable: files and parameters keep their order within a rank


def pytest_configure(config):
    """The estimator's trace cache of this test run: a fresh folder the xdist workers and every
    process they start share (set before the workers start), never the user's own, so no test
    reads figures an earlier run or another checkout left."""
    from memo_ext.estimate.trace_cache import ENV

    if ENV not in os.environ and not hasattr(config, "workerinput"):
        folder = tempfile.mkdtemp(prefix="memo-estimate-cache-")
        os.environ[ENV] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_sessionfinish(session, exitstatus):
    close_pool()


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """A folder shared by every pytest-xdist worker of this run (``tests.launch.reference_run``
    trains each reference there once)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a child of the run's
        base = base.parent
    folder = base / "reference_runs"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture
def megatron_cpu():
    """gloo world of one process, megatron's parallel state (all sizes 1), CUDA-isms redirected."""
    from megatron.core import parallel_state

    from memo_ext.mcore.compat import cpu_compat, seed_cpu_rng_tracker

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with cpu_compat():
            parallel_state.initialize_model_parallel()
            seed_cpu_rng_tracker(seed=0, tp_rank=0)
            torch.manual_seed(0)
            yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
