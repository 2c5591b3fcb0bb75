"""Checkpoints with megatron-core ``dist_checkpointing``: exact resume, any layout, safe loading.

A checkpoint directory looks like Megatron-LM's::

    SAVE/latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    SAVE/iter_0000100/                          megatron-core sharded checkpoint (torch_dist)
        manifest.json                           SHA-256 of every file, written last
        rng/rank_00000.pt                       per-process RNG states (tensors only)

Model weights and optimizer moments are saved as sharded tensors with global keys, so a
checkpoint written under one TP / PP / CP / DP layout loads under another. Iteration, consumed
samples, the LR schedule and the optimizer step live in megatron's common state.

Writes are atomic: everything goes to ``iter_N.tmp``; only when all ranks are done does rank 0
write the manifest, rename the directory and then replace the tracker file, so a crash at any
point leaves the previous checkpoint as the latest one. The tensors are written in megatron-core's
``torch_dist`` format by threads of each process (the ranks holding the same replicas share the
writing out), fsync'ed, and hashed as they are written: the manifest reads back only megatron's
two small common files.

Loading never runs code from a checkpoint: file checksums are verified first, megatron's common
state is read with ``torch.load(weights_only=True)``, the one pickle that torch's checkpoint
format keeps (``.metadata``) is unpickled with an allow-list of its own data classes before
megatron reads it, and the RNG files are tensors read with ``weights_only=True``.

A load takes the model weights always and, per :class:`LoadScope`, the iteration and data
position, the optimizer's moments with the LR schedule, and the RNG states (``--finetune``,
``--no-load-optim``, ``--no-load-rng``); :func:`checkpoint_source` says which folder a run loads
(``--load``, else ``--pretrained-checkpoint``). Megatron-LM's own torch_dist checkpoints (no
manifest; their common state holds Megatron-LM's ``args``) load too:
:mod:`~memo_ext.training.checkpoint.megatron_lm` checks and describes them.

Modules: ``source`` (the folder's layout, what a load takes and from where), ``identity`` (the
model a checkpoint holds), ``state`` (the sharded state), ``rng``, ``integrity`` (checksums, the
metadata allow-list), ``writer`` (threads, hashing as it writes), ``save`` (lock, atomic
commit), ``load``, ``megatron_lm`` (Megatron-LM's checkpoints).
"""

from memo_ext.training.checkpoint.identity import normalized_identity
from memo_ext.training.checkpoint.integrity import (
    is_megatron_lm_checkpoint,
    padded_vocab_to_load,
    verify_checkpoint,
    verify_megatron_lm_checkpoint,
)
from memo_ext.training.checkpoint.load import load_checkpoint, schedule_policy
from memo_ext.training.checkpoint.save import LOCK, hold_save_dir, save_checkpoint
from memo_ext.training.checkpoint.source import (
    CARRIED_FILES,
    FORMAT,
    MANIFEST,
    MODEL_FLAGS_FILE,
    SOURCE_CONFIG_FILE,
    TRACKER,
    WEIGHTS_ONLY,
    CheckpointError,
    CheckpointSource,
    LoadScope,
    TrainProgress,
    check_save_target,
    checkpoint_source,
    iteration_dir,
    latest_iteration,
    saved_iterations,
)
from memo_ext.training.checkpoint.state import CONTENT_METADATA

__all__ = [
    "CARRIED_FILES",
    "CONTENT_METADATA",
    "FORMAT",
    "LOCK",
    "MANIFEST",
    "MODEL_FLAGS_FILE",
    "SOURCE_CONFIG_FILE",
    "TRACKER",
    "WEIGHTS_ONLY",
    "CheckpointError",
    "CheckpointSource",
    "LoadScope",
    "TrainProgress",
    "check_save_target",
    "checkpoint_source",
    "hold_save_dir",
    "is_megatron_lm_checkpoint",
    "iteration_dir",
    "latest_iteration",
    "saved_iterations",
    "load_checkpoint",
    "normalized_identity",
    "padded_vocab_to_load",
    "save_checkpoint",
    "schedule_policy",
    "verify_checkpoint",
    "verify_megatron_lm_checkpoint",
]
