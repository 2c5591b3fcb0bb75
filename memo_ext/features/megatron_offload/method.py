"""megatron-core's offloading as the method comparisons run (``megatron-offload``; the
estimator does not model it)."""

from __future__ import annotations

from memo_ext.config import OFFLOAD_MODULES, megatron_offload_missing
from memo_ext.features.compared import ComparedMethod

MEGATRON_OFFLOAD_FLAGS = (
    "--fine-grained-activation-offloading",
    "--offload-modules",
    *OFFLOAD_MODULES,
)
"""The trainer's flags of ``megatron-offload``: megatron-core's fine-grained activation
offloading of every dense module it offers, the more usable of its two variants. It runs with
pipeline parallelism, and its saved-tensor hooks move whatever those modules save for backward
(attention's inputs and output included) whichever layer spec built them, our SDPA and flash core
attention too. The layer-level variant (``--cpu-offloading-num-layers``, a trainer flag) refuses
PP and moves what transformer-engine's offload context selects. Both need CUDA and
transformer-engine."""


class ComparedOffload(ComparedMethod):
    """megatron-core's fine-grained offloading in a comparison: not modelled, not traced, and
    refused (no job starts) where CUDA or transformer-engine is missing."""

    def untraced_note(self) -> str:
        return "megatron-core's offloading is not traced on fake tensors"

    def refusal(self) -> str | None:
        missing = megatron_offload_missing()
        if missing is None:
            return None
        return f"{self.name} needs {missing}, which this machine lacks"


COMPARED: tuple[ComparedMethod, ...] = (
    ComparedOffload("megatron-offload", MEGATRON_OFFLOAD_FLAGS),
)
