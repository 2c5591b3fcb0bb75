"""MEMO's CUDA transfer engine and host memory on the emulated device: copies on their own
streams, ordered by events (the device's timeline raises on a copy consumed before its event
was waited on), and host buffers pinned within the budget, counted as the driver pins them."""

from __future__ import annotations

import pytest
import torch

from memo_ext.simulate.device import OrderError, emulated_cuda


def test_host_pool_pins_what_it_counts_within_its_budget(cuda):
    from memo_ext.memo.alpha import HostMemoryError
    from memo_ext.memo.transfer import HostPool

    before = cuda.pinned_bytes()
    pool = HostPool(budget_bytes=40_000, pin_memory=True)
    # sizes that are not powers of two: torch's pinned allocator would lock 4096 + 8192 + 16384
    # + 16384 bytes for them, past the budget; whole pages are 4096 + 8192 + 12288 + 12288
    buffers = [pool.acquire(n) for n in (3_000, 5_000, 12_000, 9_000)]
    assert all(b.data.is_pinned() for b in buffers)
    assert cuda.pinned_bytes() - before == pool.allocated_bytes <= pool.budget_bytes
    with pytest.raises(HostMemoryError, match="host budget of 40,000 bytes"):
        pool.acquire(10_000)


def test_the_bandwidth_probe_is_counted_and_returned(cuda):
    from memo_ext.memo.transfer import HostPool, build_transfer_engine, measure_copy_gbps

    pool = HostPool(budget_bytes=1 << 20, pin_memory=True)
    engine = build_transfer_engine(torch.device("cuda", 0))
    probe = pool.scratch(3 << 20)  # more than the budget: it takes what is left
    assert probe.numel() == 1 << 20 and pool.allocated_bytes == 1 << 20
    assert measure_copy_gbps(engine, device=torch.device("cuda", 0), dst=probe) > 0
    del probe
    assert pool.allocated_bytes == 0 and cuda.shim.memo_emulated_registered_bytes() == 0


def _memo_training(cuda, tmp_path):
    from tests.emulated.test_training import train_on

    return train_on(cuda, tmp_path, "--memo", "--memo-keep-last-layers", "1", "--memo-alpha", "1")


def test_a_copy_read_before_its_event_is_caught(tmp_path, monkeypatch):
    """The timeline is the check: with the compute stream not waiting for the host → device
    copies of a prefetch, the backward reads tensors whose copy may still be running."""
    from memo_ext.memo.transfer import CudaTransferEngine

    wait = CudaTransferEngine.wait

    def wait_for_device_to_host_only(self, completion):
        if completion.event is None or completion.event.stream != self.h2d.id:
            wait(self, completion)

    monkeypatch.setattr(CudaTransferEngine, "wait", wait_for_device_to_host_only)
    caught = pytest.raises(OrderError, match=r"reads bytes that aten.copy_.* wrote, with no event")
    with caught, emulated_cuda() as cuda:
        _memo_training(cuda, tmp_path)


def test_a_source_freed_under_its_copy_is_caught(tmp_path, monkeypatch):
    """Without the ping-pong slots a layer's copy sources die while the device → host copy still
    reads them, and their blocks could be handed out again."""
    from memo_ext.memo import runtime

    def drop_sources(self, acts, pairs):
        pairs = self.engine.stage(pairs)
        acts.offloaded = self.engine.to_host(pairs, reuse=[b.last_read for b in acts.host_buffers])
        self.track(acts)

    monkeypatch.setattr(runtime.MemoRuntime, "offload", drop_sources)
    with pytest.raises(OrderError, match="freed .* while aten.copy_"), emulated_cuda() as cuda:
        _memo_training(cuda, tmp_path)


def test_memo_training_keeps_every_copy_ordered(cuda, tmp_path):
    summary, _ = _memo_training(cuda, tmp_path)
    assert summary.iterations == 3


@pytest.mark.parametrize("chunk", [[], ["--memo-chunk-tokens", "24"]], ids=["whole", "chunked"])
def test_attention_host_scalars_stay_on_the_host(cuda, tmp_path, chunk):
    """In fp32 SDPA runs its memory-efficient kernel, which keeps its philox seed and offset on
    the host and, with dropout, reads them there in backward: MEMO must give them back as they
    were, not copied to the device with the rest of the layer. (No preflight: pricing 24-token
    chunks traces hundreds of chunks, a minute of CPU, and is not what is checked here.)"""
    from tests.emulated.test_training import train_on

    summary, records = train_on(
        cuda, tmp_path, "--memo", "--memo-alpha", "0.5", "--memo-keep-last-layers", "1",
        "--attention-dropout", "0.1", "--train-iters", "1", "--skip-preflight", *chunk,
    )  # fmt: skip
    assert summary.iterations == 1 and records[-1]["host_offload_bytes"] > 0


@pytest.mark.parametrize(
    "layout",
    [[], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
    ids=["tp1", "tp2-sp"],
)
@pytest.mark.parametrize("chunk", [[], ["--memo-chunk-tokens", "32"]], ids=["whole", "chunked"])
def test_no_device_memory_is_taken_on_the_copy_streams(tmp_path, layout, chunk):
    """Token-wise heads are strided (V is a view of the fused QKV output; under SP the gathered
    tensors' heads have a gap per rank): a device ↔ host copy of a strided tensor makes CUDA
    gather it into a temporary on the current stream, which would be MEMO's copy stream, whose
    memory the compute stream's pool (and a planned allocator) never sees. Every device
    allocation of a MEMO step happens on the compute stream."""
    from tests.emulated.test_training import train_on

    with emulated_cuda(world_size=2 if layout else 1) as cuda:
        summary, records = train_on(
            cuda, tmp_path, "--memo", "--memo-alpha", "0.5", "--memo-keep-last-layers", "1",
            "--train-iters", "1", "--skip-preflight", *layout, *chunk,
        )  # fmt: skip
        streams = dict(cuda.allocations_by_stream)
    assert records[-1]["memo_recomputed_tokens"] > 0  # α = 0.5: token-wise heads were copied
    assert set(streams) == {cuda.default.id}, streams
