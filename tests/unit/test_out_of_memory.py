"""An allocation failure is exit 3 with the bytes, however a library wraps it."""

from __future__ import annotations

import numpy as np
import pytest

from memo_ext.errors import OutOfMemory, out_of_memory


def _numpy_failure() -> MemoryError:
    # numpy's own exception type and message, as an array allocation under a limit raises it
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved it
    return core._exceptions._ArrayMemoryError((100000,), np.dtype(np.int32))


def test_a_failure_wrapped_by_megatron_s_dataset_builder_is_found_by_its_cause():
    try:
        try:
            raise _numpy_failure()
        except MemoryError as inner:
            raise Exception("MockGPTDataset failed to build as a mock data generator") from inner
    except Exception as wrapped:  # noqa: BLE001 - what the builder raises
        oom = out_of_memory(wrapped)
    assert isinstance(oom, OutOfMemory)
    assert oom.requested_bytes == int(391.0 * 2**10)  # "Unable to allocate 391. KiB"


@pytest.mark.parametrize(
    "error",
    [ValueError("bad value"), Exception("failed to build"), RuntimeError("shape mismatch")],
)
def test_other_errors_are_not_out_of_memory(error):
    assert out_of_memory(error) is None


def test_a_cause_cycle_ends_the_search():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert out_of_memory(a) is None
