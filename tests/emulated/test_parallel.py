"""The trainer's CUDA branch as one rank of a several-process job (the other ranks are emulated:
collectives move nothing), so every process-group call site meets a device-only NCCL group."""

from __future__ import annotations

import pytest

from memo_ext.simulate.device import emulated_cuda
from tests.emulated.test_training import train_on


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--context-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["tp2-sp", "cp2", "pp2"],
)
def test_memo_auto_in_a_parallel_layout(tmp_path, layout):
    with emulated_cuda(world_size=2) as cuda:
        summary, _ = train_on(
            cuda, tmp_path, *layout, "--memo", "--memo-alpha", "auto", "--memo-keep-last-layers",
            "1", "--log-params-norm",
        )  # fmt: skip
    assert summary.iterations == 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.dist.test_hotspa_training import pareto_texts, preprocess

    return preprocess(tmp_path_factory.mktemp("corpus"), pareto_texts(64, seed=0), "pareto")


def test_hotspa_packed_buckets_on_the_device(tmp_path, corpus):
    """Packed documents in buckets of their own layouts (DP, CP on the home model: the other
    ranks' shards are not known here, so no weight switch; the next test switches)."""
    from tests.dist.test_hotspa_training import BUCKETS, train_args

    with emulated_cuda(world_size=2) as cuda:
        args = [*train_args(corpus), *BUCKETS, "--hotspa-strategies", "dp2;dp2;cp2"]
        summary, records = train_on(cuda, tmp_path, base=args)
    assert summary.iterations == 3
    assert all(sum(r["hotspa_bucket_rows"]) > 0 for r in records)


def test_hotspa_switch_over_a_device_only_group_is_timed_on_the_device():
    """Rank 0 of 2 switches ``w`` from halves (rank r holds rows [4r, 4r + 4)) to whole: it
    copies its own half, sends it to rank 1 and receives the other half, all on the device; the
    switch's time comes from CUDA events around that work, not from the host's clock (which
    would time the launches only)."""
    import torch

    from memo_ext.hotspa.switch import Shard, build_plan

    halves = {"w": [Shard(r, 0, ((4 * r, 4, 0),), 3) for r in (0, 1)]}
    whole = {"w": [Shard(r, 0, ((0, 8, 0),), 3) for r in (0, 1)]}
    with emulated_cuda(world_size=2) as cuda:
        import torch.distributed as dist

        dist.init_process_group("nccl")
        plan = build_plan(halves, whole, rank=0, ranks_per_node=2)
        assert plan.sends.keys() == plan.recvs.keys() == {1}
        src = {"w": torch.randn(4, 3, device="cuda")}
        dst = {"w": torch.empty(8, 3, device="cuda")}
        stats = plan.run(src, dst)
        (timer,) = stats.timers
        start, end = timer.events
        stream = torch.cuda.current_stream().id
        # dst's accesses: its allocation, then the switch's local copy and received half
        created, *switched = sorted(a.tick for a in cuda.storages[cuda._token(dst["w"])].accesses)
        assert created < start.clock[stream] < min(switched)
        assert max(switched) < end.clock[stream]
        assert stats.seconds >= 0 and stats.bytes_sent == 4 * 3 * 4


def test_stop_conditions_agree_over_a_device_only_group():
    """--exit-duration-in-mins / --exit-signal-handler reduce their flags with an all-reduce at
    every step boundary: on NCCL they must travel as device tensors."""
    import signal

    import torch.distributed as dist

    from memo_ext.config import CheckpointConfig
    from memo_ext.training.control import StopConditions

    with emulated_cuda(world_size=2):
        dist.init_process_group("nccl")
        config = CheckpointConfig(exit_duration_in_mins=600, exit_signal_handler=True)
        with StopConditions(config) as stop:
            assert stop.reason(1) is None
            stop._on_signal(signal.SIGTERM, None)
            assert stop.reason(2) == "signal received"


def test_a_rank_outside_the_world_is_refused_before_any_device_group(tmp_path):
    """On the device path too (NCCL's group, the GPU's backend), the environment is checked
    before anything waits on it: no process group is made, no tensor reaches the device."""
    import torch.distributed as dist

    from memo_ext.errors import UsageError

    with emulated_cuda(rank=2, world_size=2) as cuda:
        with pytest.raises(UsageError, match=r"RANK=2 is outside WORLD_SIZE=2 \(ranks 0 to 1\)"):
            train_on(cuda, tmp_path)
        assert not dist.is_initialized()
        assert not cuda.storages  # nothing was allocated on the device
