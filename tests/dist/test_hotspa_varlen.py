"""Variable-length documents, packed: one process and 2 data-parallel processes agree, and both
give the mean over every real token of the documents run one at a time, unpacked.

Each process runs megatron-core's own machinery as the trainer does (DDP with fp32 gradient
buffers, the no-pipelining schedule, ``finalize_model_grads`` dividing by the global token count
under ``calculate_per_token_loss``) on its packed micro-batches from
``memo_ext.data.batches.packed_step_batches``, and writes the step's loss and gradients.
With these settings the first global batch packs into one row (the second rank runs a
padding-only row) and the second into two rows (one per rank).
"""

from __future__ import annotations

import os
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.launch import free_port, run_job
from tests.models import LLAMA_TINY, build_gpt, cpu_config

pytestmark = pytest.mark.dist

VOCAB, SEQ, GBS, SEED, STEPS = 97, 40, 7, 11, 2


def build_model(position_embedding_type: str):
    config = cpu_config(LLAMA_TINY, calculate_per_token_loss=True)
    model = build_gpt(
        config,
        vocab_size=VOCAB,
        max_positions=SEQ,
        position_embedding_type=position_embedding_type,
    )
    return config, model


def mock_documents():
    from memo_ext.data.documents import MockDocuments

    return MockDocuments(num_documents=30, seq_length=SEQ, vocab_size=VOCAB, seed=SEED, sigma=1.0)


def packed_forward_step(data_iterator, model):
    from memo_ext.mcore.packed import build_packed_seq_params
    from memo_ext.training.step import loss_func

    batch = next(data_iterator)
    params = build_packed_seq_params(
        cu_seqlens=batch["cu_seqlens"], cu_seqlens_padded=batch["cu_seqlens_padded"], device="cpu"
    )
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=params,
    )
    return output, lambda out: loss_func(batch["loss_mask"], out)


def packed_job(argv: list[str]) -> int:
    """One data-parallel rank of a job of the tests' worker pool (``RANK``, ``WORLD_SIZE`` and
    the rendezvous in its environment): ``argv`` is the position embedding and the output file.
    STEPS global batches, gradients only (no update between them, so every step is compared
    against the same weights)."""
    position_embedding_type, out = argv
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from memo_ext.data.batches import packed_step_batches
    from memo_ext.mcore.compat import cpu_compat, seed_cpu_rng_tracker

    dist.init_process_group("gloo", rank=rank, world_size=world)
    with cpu_compat():
        parallel_state.initialize_model_parallel()
        seed_cpu_rng_tracker(seed=0, tp_rank=0)
        config, model = build_model(position_embedding_type)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        model = DistributedDataParallel(config, ddp_config, model, disable_bucketing=True)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        steps = packed_step_batches(
            mock_documents(),
            global_batch_size=GBS,
            seq_length=SEQ,
            seed=SEED,
            dp_rank=rank,
            dp_size=world,
        )
        results = []
        for micro_batches in islice(steps, STEPS):
            model.zero_grad_buffer()
            losses = get_forward_backward_func()(
                forward_step_func=packed_forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=SEQ,
                micro_batch_size=1,
                forward_only=False,
            )
            pair = sum(r["lm loss"].double() for r in losses)
            dist.all_reduce(pair)
            grads = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
            results.append({"loss": (pair[0] / pair[1]).item(), "grads": grads})
        if rank == 0:
            torch.save(results, out)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def run_packed(world: int, position_embedding_type: str, out: Path) -> list[dict]:
    job = run_job(
        [position_embedding_type, str(out)],
        nproc=world,
        entry="tests.dist.test_hotspa_varlen:packed_job",
    )
    assert job.status == 0, job.describe()
    return torch.load(out, weights_only=True)


def unpacked_reference(position_embedding_type: str) -> list[dict]:
    """Mean loss and its gradient over the same documents, each run alone (batch 1, unpacked)."""
    from memo_ext.data.documents import global_batches

    _, model = build_model(position_embedding_type)
    results = []
    batches = global_batches(mock_documents(), global_batch_size=GBS, seq_length=SEQ, seed=SEED)
    for documents in islice(batches, STEPS):
        model.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for doc in documents:
            tokens = torch.from_numpy(doc).unsqueeze(0)
            positions = torch.arange(len(doc)).unsqueeze(0)
            losses = model(tokens[:, :-1], positions[:, :-1], None, labels=tokens[:, 1:])
            total, count = total + losses.sum(), count + losses.numel()
        (total / count).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append({"loss": (total / count).item(), "grads": grads})
    return results


def assert_same(got: list[dict], want: list[dict], *, tol: float) -> None:
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g["loss"] - w["loss"]) <= tol * abs(w["loss"]), (step, g["loss"], w["loss"])
        for name, grad in w["grads"].items():
            error = (g["grads"][name] - grad).norm() / grad.norm().clamp(min=1e-12)
            assert error <= tol, (step, name, error.item())


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
def test_dp2_matches_one_process_and_unpacked_documents(tmp_path, position_embedding_type):
    one = run_packed(1, position_embedding_type, tmp_path / "one.pt")
    two = run_packed(2, position_embedding_type, tmp_path / "two.pt")
    # same rows, summed over ranks in another order (gloo all-reduce): fp32 rounding only
    assert_same(two, one, tol=1e-5)
    assert one[0]["loss"] != one[1]["loss"]  # two different global batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state

        from memo_ext.mcore.compat import cpu_compat, seed_cpu_rng_tracker

        with cpu_compat():
            parallel_state.initialize_model_parallel()
            seed_cpu_rng_tracker(seed=0, tp_rank=0)
            reference = unpacked_reference(position_embedding_type)
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    # per-token arithmetic on other matrix shapes, sums in another order: fp32 rounding only
    assert_same(one, reference, tol=1e-5)
    assert np.isfinite([r["loss"] for r in one]).all()
