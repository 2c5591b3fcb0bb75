"""Every rendezvous ends in one sentence: an environment that describes no rank of a world is
refused before anything waits on it, a taken port is named, and a world that never fills up is
reported when the deadline passes (here 3 s), with how many processes came."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from memo_ext.errors import ReportedError, UsageError
from memo_ext.launch import main as launch
from memo_ext.training.initialize import init_distributed, rendezvous_environment
from tests.workers import free_port

WORLD = dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")


@pytest.fixture
def environment(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def given(**changes):
        for name, value in {**WORLD, **changes}.items():
            monkeypatch.setenv(name, value)

    return given


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(RANK="1"), r"RANK=1 is outside WORLD_SIZE=1 \(ranks 0 to 0\): start the job with"),
        (dict(WORLD_SIZE="0"), "RANK=0 is outside WORLD_SIZE=0"),
        (dict(RANK="one"), "RANK='one' in the environment is not a whole number"),
        (dict(LOCAL_RANK="2", LOCAL_WORLD_SIZE="2"), "LOCAL_RANK=2, LOCAL_WORLD_SIZE=2 and"),
        (dict(MASTER_PORT="70000"), r"MASTER_PORT=70000 is not a port \(1-65535\)"),
        (dict(MASTER_ADDR="no-such-host.invalid"), "MASTER_ADDR=no-such-host.invalid does not"),
    ],
)
def test_an_environment_that_is_no_rank_of_a_world_is_one_sentence(environment, changes, match):
    environment(**changes)
    with pytest.raises(UsageError, match=match):
        rendezvous_environment()


def test_a_sound_environment_passes(environment):
    environment(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    where = rendezvous_environment()
    assert (where.rank, where.world_size, where.port) == (1, 4, 29999)


def test_a_taken_master_port_is_named(environment):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environment(MASTER_PORT=str(port))
        with pytest.raises(ReportedError, match=f"MASTER_PORT {port} is in use on this machine"):
            init_distributed(timeout_minutes=0.05)
    assert not dist.is_initialized()


def test_a_world_that_never_fills_up_ends_at_the_deadline(environment):
    environment(WORLD_SIZE="2", MASTER_PORT=str(free_port()))
    with pytest.raises(ReportedError, match=r"waited 0.05 min .* and 1 of 2 processes joined"):
        init_distributed(timeout_minutes=0.05)  # 3 s: rank 1 never comes
    assert not dist.is_initialized()


def test_the_launcher_refuses_no_processes_per_node(capsys):
    assert launch(["--nproc-per-node", "0", "pretrain_gpt_memo.py"]) == 2
    assert "--nproc-per-node 0: a node runs at least one process" in capsys.readouterr().err


def test_the_launcher_names_its_taken_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--nproc-per-node", "1", "--master-port", str(port), "-m", "json.tool", "-h"]
        assert launch(argv) == 1
    assert f"port {port} is in use on this machine" in capsys.readouterr().err


def test_the_launcher_leaves_its_callers_environment_as_it_was(capsys):
    # without --master-port (torchrun's default is None), and with every variable it and
    # torchrun set for the workers gone again: a test process launching later jobs inherits none
    import os

    before = dict(os.environ)
    assert launch(["--nproc-per-node", "1", "-m", "json.tool", "-h"]) == 0
    assert dict(os.environ) == before


@pytest.mark.parametrize("nodes", ["2", "1"])
def test_the_launcher_refuses_a_master_address_that_does_not_resolve(capsys, nodes):
    # on one node too: c10d retried the name lookup until the launch was killed
    argv = ["--nnodes", nodes, "--node-rank", str(int(nodes) - 1), "--nproc-per-node", "1",
            "--master-addr", "no-such-host.invalid", "-m", "json.tool", "-h"]  # fmt: skip
    assert launch(argv) == 2
    err = capsys.readouterr().err
    assert "--master-addr no-such-host.invalid does not resolve" in err
    assert ("this machine's (127.0.0.1)" in err) == (nodes == "1")


def test_a_node_waiting_for_another_that_never_comes_ends_at_the_deadline(capsys):
    argv = ["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
            "--master-port", str(free_port()), "--rdzv-conf", "timeout=2",
            "-m", "json.tool", "-h"]  # fmt: skip
    assert launch(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1 of 2 nodes joined: start every node with the same --master-addr" in err
