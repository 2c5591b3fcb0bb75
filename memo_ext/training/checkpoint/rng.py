"""Per-process RNG states (Python, NumPy, torch, the device, megatron-core's tracker), saved as
tensors only and restored where the layout is the same.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
from megatron.core.tensor_parallel import random as mrandom

from memo_ext.device import gpu_rng_state, set_gpu_rng_state

logger = logging.getLogger(__name__)


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    tracker = mrandom.get_cuda_rng_tracker()
    return {
        "torch": torch.get_rng_state(),
        "cuda": gpu_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
        "tracker": tracker.get_states() if tracker.is_initialized() else {},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    set_gpu_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if state["tracker"]:
        mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
