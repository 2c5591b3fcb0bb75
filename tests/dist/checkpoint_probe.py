"""What a checkpoint load leaves behind, and checkpoints in Megatron-LM's layout, for the tests.

``main`` is ``pretrain_gpt_memo.py`` that records what the trainer's ``load_checkpoint`` left
(``run_pretrain(..., module="tests.dist.checkpoint_probe")``); ``--probe-dump DIR`` says where:
each rank writes ``DIR/rank_R.pt`` right after the load returns, holding

- ``progress``: (iteration, consumed samples) the load returned;
- ``weights`` / ``moments``: for every sharded tensor of the model / of the optimizer's state,
  its global key → [(its slice of the global tensor, this rank's values)];
- ``optimizer_states``: parameters with optimizer state (0: fresh), ``scheduler``: the LR
  schedule's state, ``torch_rng``: the CPU generator's state.

``write_megatron_lm`` (``run_job(..., entry="tests.dist.checkpoint_probe:write_megatron_lm")``)
builds the trainer's model of the flags it is given on every rank, moves its weights and Adam
moments away from their initial values (deterministically, the same under every layout) and
writes them as Megatron-LM's ``save_checkpoint`` lays a torch_dist checkpoint out: megatron-core's
own ``dist_checkpointing.save`` of ``args`` (an ``argparse.Namespace`` of Megatron-LM's names),
``checkpoint_version``, ``iteration``, ``model``, ``optimizer``, ``opt_param_scheduler`` (counted
in samples, as Megatron-LM steps it), ``rng_state`` (a sharded object per PP × TP rank) and
``num_floating_point_operations_so_far``, then the tracker file. Its own options:

- ``--writer-out DIR`` (required), ``--writer-iteration N`` (default 5);
- ``--writer-divisible-by N``: the --make-vocab-size-divisible-by recorded in ``args`` (128);
  give the trainer flags ``--make-vocab-size-divisible-by`` N × TP so that the model has the
  rows Megatron-LM pads to;
- ``--writer-mixed-precision``: the optimizer's common state nested as megatron-core's
  mixed-precision optimizer keeps it (``optimizer`` / ``grad_scaler``) around an fp32 run's;
- with the trainer flags ``--bf16 --use-distributed-optimizer``: the distributed optimizer's
  state in Megatron-LM's default layout (``dp_reshardable``, :data:`MEGATRON_LM_METADATA`, also
  written as the checkpoint's content metadata, as Megatron-LM writes it);
- ``--writer-also-ours DIR``: the same state saved by this trainer's ``save_checkpoint`` too.

``save_with_megatron_lm`` (a job entry: ``OUT CHECKOUT``) saves the model of
``memo_ext/benchmarks/checkpoint_save.py``, moved away from its initial weights, at iteration 3 with
Megatron-LM's own ``save_checkpoint`` from a Megatron-LM checkout.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from memo_ext.training import loop


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT model inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def sharded_tensors(sharded: dict) -> list[ShardedTensor]:
    """The sharded tensors of a sharded state dict, factories built."""
    found = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            found += sharded_tensors(built if isinstance(built, dict) else {"": built})
        elif isinstance(value, ShardedTensor):
            found.append(value)
    return found


def _by_key(parts: list[ShardedTensor]) -> dict[str, list]:
    out: dict[str, list] = {}
    for part in parts:
        out.setdefault(part.key, []).append((part.global_slice(), part.data.detach().clone()))
    return out


def _record(dump: Path, progress, *, model, optimizer, scheduler, **_) -> None:
    sharded = _gpt(model).sharded_state_dict()
    moments = optimizer.sharded_state_dict(sharded) if optimizer.optimizer.state else {}
    record = {
        "progress": (progress.iteration, progress.consumed_samples),
        "weights": _by_key(sharded_tensors(sharded)),
        "moments": _by_key(sharded_tensors(moments)),
        "optimizer_states": len(optimizer.optimizer.state),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    dump.mkdir(parents=True, exist_ok=True)
    torch.save(record, dump / f"rank_{dist.get_rank()}.pt")


def main(argv: list[str]) -> int:
    """The trainer, recording what its checkpoint load left (see the module docstring); the
    patch is undone when it returns (the tests' workers run other jobs next)."""
    from pretrain_gpt_memo import main as pretrain_main

    at = argv.index("--probe-dump")
    dump, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2 :]
    load = loop.load_checkpoint

    def load_and_record(**kwargs):
        progress = load(**kwargs)
        _record(dump, progress, **kwargs)
        return progress

    with mock.patch.object(loop, "load_checkpoint", load_and_record):
        return pretrain_main(argv)


def read_records(dump: Path) -> list[dict]:
    """Every rank's record of a probed run, rank 0 first."""
    paths = sorted(dump.glob("rank_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return [torch.load(path, weights_only=False) for path in paths]


def read_checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole, read by torch's own reader alone (an
    independent reference: neither megatron-core nor the trainer's loader)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(directory))
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


# --- a checkpoint in Megatron-LM's layout ----------------------------------------------------


def _writer_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--writer-out", required=True)
    parser.add_argument("--writer-iteration", type=int, default=5)
    parser.add_argument("--writer-divisible-by", type=int, default=128)
    parser.add_argument("--writer-mixed-precision", action="store_true")
    parser.add_argument("--writer-also-ours")
    return parser.parse_known_args(argv)


MEGATRON_LM_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
"""What Megatron-LM 0.16's ``_build_sharded_state_dict_metadata`` gives its optimizer and writes as
the checkpoint's content metadata, by default (no --dist-ckpt-optim-fully-reshardable); its
``dp_cp_group`` is not written, and megatron-core takes the same group without it."""


def _move_away_from_init(model: torch.nn.Module, optimizer) -> None:
    """Weights and Adam moments that no fresh model or optimizer has, the same element for
    element under every layout (a function of each element alone)."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25).add_(0.01)
    optimizer.reload_model_params()  # mixed precision: the fp32 main weights follow
    megatron = optimizer.optimizer  # megatron-core's, behind the loop's adapter
    for inner in getattr(megatron, "chained_optimizers", [megatron]):
        inner.init_state_fn(inner.optimizer, inner.config)  # Adam's moments, as a load makes
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state[param]
                state["exp_avg"].copy_(param.detach() * 0.1)
                state["exp_avg_sq"].copy_(param.detach() ** 2 * 0.01)
                state["step"] = torch.tensor(7.0)


def megatron_lm_args(run, *, iteration: int, divisible_by: int) -> argparse.Namespace:
    """What Megatron-LM's ``args`` say about ``run`` (after its ``validate_args``), under its
    own names."""
    shape, layout, train = run.shape, run.layout, run.train
    return argparse.Namespace(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_size,
        num_attention_heads=shape.num_attention_heads,
        group_query_attention=shape.num_query_groups is not None,
        num_query_groups=shape.query_groups,
        kv_channels=shape.head_dim,
        normalization=shape.normalization,
        apply_layernorm_1p=run.model.apply_layernorm_1p,
        swiglu=shape.swiglu,
        squared_relu=False,
        quick_geglu=False,
        add_bias_linear=shape.add_bias_linear,
        # validate_args: the linear layers' biases imply the QKV's (Megatron-LM's default GPT)
        add_qkv_bias=shape.add_bias_linear or shape.add_qkv_bias,
        position_embedding_type=shape.position_embedding_type,
        untie_embeddings_and_output_weights=run.model.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=divisible_by,
        padded_vocab_size=run.model.padded_vocab_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        data_parallel_size=layout.dp,
        world_size=run.world_size,
        seq_length=run.data.seq_length,
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
        rampup_batch_size=None,
        train_iters=train.train_iters,
        train_samples=None,
        lr=train.lr,
        min_lr=train.min_lr,
        iteration=iteration,
        consumed_train_samples=iteration * train.global_batch_size,
        consumed_valid_samples=0,
        no_save_optim=None,
        no_save_rng=None,
        use_distributed_optimizer=train.use_distributed_optimizer,
        ckpt_format="torch_dist",
        params_dtype=torch.bfloat16 if train.bf16 else torch.float32,
        bf16=train.bf16,
        fp16=train.fp16,
    )


def _schedule_in_samples(scheduler, *, iteration: int, global_batch: int) -> dict:
    """The LR schedule's state as Megatron-LM's scheduler holds it at ``iteration``: it steps by
    the global batch, so every count is in samples."""
    state = scheduler.state_dict()
    for key in ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
        state[key] = state[key] * global_batch
    state["num_steps"] = iteration * global_batch
    return state


def _rng_state() -> ShardedObject:
    """This rank's RNG states as Megatron-LM saves them (one object per PP × TP rank)."""
    ps = parallel_state
    states = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.empty(0, dtype=torch.uint8),
        "rng_tracker_states": {},
    }
    return ShardedObject(
        "rng_state",
        [states],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def write_megatron_lm(argv: list[str]) -> int:
    """Write a checkpoint in Megatron-LM's layout (see the module docstring)."""
    from memo_ext.arguments import parse_args
    from memo_ext.benchmarks.checkpoint_save import build_training_state
    from memo_ext.data.tokenizers import tokenizer_for
    from memo_ext.training.resolve import resolve_run

    options, flags = _writer_options(argv)
    world = int(os.environ["WORLD_SIZE"])
    run = parse_args(flags, world_size=world)
    run = resolve_run(run, tokenizer=tokenizer_for(run.data), extensions=[])
    out, iteration = Path(options.writer_out), options.writer_iteration
    directory = out / f"iter_{iteration:07d}"
    with build_training_state(nproc=world, flags=flags) as state:
        _move_away_from_init(state.model, state.optimizer)
        model_sharded = _gpt(state.model).sharded_state_dict()
        distributed = run.train.use_distributed_optimizer
        metadata = MEGATRON_LM_METADATA if distributed else None
        optimizer = state.optimizer.sharded_state_dict(model_sharded, metadata=metadata)
        if options.writer_mixed_precision:
            optimizer = {"optimizer": optimizer, "grad_scaler": None}
        sharded = {
            "args": megatron_lm_args(
                run, iteration=iteration, divisible_by=options.writer_divisible_by
            ),
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model_sharded,
            "optimizer": optimizer,
            "opt_param_scheduler": _schedule_in_samples(
                state.scheduler, iteration=iteration, global_batch=run.train.global_batch_size
            ),
            "rng_state": _rng_state(),
            "num_floating_point_operations_so_far": 0,
        }
        if dist.get_rank() == 0:
            directory.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(sharded, str(directory), content_metadata=metadata)
        if dist.get_rank() == 0:
            (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        dist.barrier()
        if options.writer_also_ours:
            _save_ours(state, run, Path(options.writer_also_ours), iteration=iteration)
    return 0


def _save_ours(state, run, out: Path, *, iteration: int) -> None:
    """The same weights, moments and position saved as this trainer saves them."""
    from memo_ext.training.checkpoint import TrainProgress, save_checkpoint

    state.scheduler.step(increment=iteration)  # an iteration-based run counts steps
    progress = TrainProgress(iteration, iteration * run.train.global_batch_size)
    save_checkpoint(
        save_dir=str(out),
        progress=progress,
        model=state.model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
    )


def save_with_megatron_lm(argv: list[str]) -> int:
    """Save the benchmark's model with Megatron-LM's ``save_checkpoint`` (see the module
    docstring)."""
    from memo_ext.benchmarks.checkpoint_save import build_training_state, save_megatron_lm

    out, checkout = Path(argv[0]), Path(argv[1])
    world = int(os.environ["WORLD_SIZE"])
    with build_training_state(nproc=world) as state:
        with torch.no_grad():
            for param in state.model.parameters():
                param.mul_(1.25)
        save_megatron_lm(state, out, checkout=checkout, nproc=world)(3)
    return 0
