"""What a checkpoint holds: the sharded state of a model, its optimizer and schedule (with the
content metadata that lays out the optimizer's state), and the layout of the run that wrote it.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from megatron.core import parallel_state

from memo_ext.training.checkpoint.identity import unwrap_model
from memo_ext.training.checkpoint.source import FORMAT, TrainProgress

logger = logging.getLogger(__name__)


CONTENT_METADATA = {
    # the distributed optimizer's state in the parameters' own shapes, gathered per DP group on
    # save: it loads into any TP / PP / DP layout (Megatron-LM's
    # --dist-ckpt-optim-fully-reshardable; its default, dp_reshardable, reshards over DP only)
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": False,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
"""How megatron-core lays out the optimizer's sharded state in our checkpoints; written into
each (``content_metadata``), and read back from each on load, as Megatron-LM does."""


def sharded_state(
    model,
    optimizer,
    scheduler,
    progress: TrainProgress,
    *,
    is_loading: bool = False,
    metadata: dict | None = None,
) -> dict:
    """What a checkpoint holds; without ``optimizer`` (--no-save-optim, or a load of the weights
    alone) neither the moments nor the LR schedule. ``metadata``: the optimizer state's layout
    (the checkpoint's content metadata on load, :data:`CONTENT_METADATA` on save)."""
    model_sharded = unwrap_model(model).sharded_state_dict()
    state = {
        "model": model_sharded,
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "format": FORMAT,
    }
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sharded, is_loading=is_loading, metadata=metadata or CONTENT_METADATA
        )
        state["scheduler"] = scheduler.state_dict()
    return state


def run_layout() -> dict:
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
    }
