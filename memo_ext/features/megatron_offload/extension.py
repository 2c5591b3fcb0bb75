"""megatron-core's own activation offloading (``--cpu-offloading-num-layers``,
``--fine-grained-activation-offloading``) as an extension of the trainer: megatron-core does
the work through the ``TransformerConfig`` fields its section sets (``megatron_fields``), so all the
trainer needs to know is that the estimator does not model it."""

from __future__ import annotations

from memo_ext.config import RunConfig
from memo_ext.extension import Extension


class MegatronOffload(Extension):
    """megatron-core's layer-level or fine-grained activation offloading (a baseline)."""

    name = "megatron-offload"

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return run.offload.enabled

    def preflight_skip_reason(self, run: RunConfig) -> str | None:
        # the preflight would check the run without offloading and refuse too much
        return f"the estimator does not model {run.offload.flag}"
