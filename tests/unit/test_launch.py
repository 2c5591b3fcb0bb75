"""``python -m memo_ext.launch`` reports the rank that failed, not one torchrun stopped."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from memo_ext.launch import exit_status, first_failure


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")
    failure.timestamp = timestamp
    return failure


def test_a_rank_torchrun_stopped_is_not_the_failure_even_when_seen_first():
    # both ranks refused bad input; torchrun saw rank 0's exit 2 and stopped rank 1 at once
    err = ChildFailedError(
        "pretrain_gpt_memo.py",
        {1: _failure(1, -signal.SIGTERM, timestamp=10), 0: _failure(0, 2, timestamp=11)},
    )
    rank, failure = first_failure(err)
    assert (rank, exit_status(failure.exitcode)) == (0, 2)


def test_a_rank_killed_by_another_signal_comes_before_ranks_stopped_by_torchrun():
    err = ChildFailedError(
        "pretrain_gpt_memo.py",
        {
            0: _failure(0, -signal.SIGTERM, timestamp=5),
            3: _failure(3, -signal.SIGKILL, timestamp=6),
        },
    )
    rank, failure = first_failure(err)
    assert (rank, exit_status(failure.exitcode)) == (3, 128 + 9)


def test_among_failures_of_their_own_the_earliest_is_reported():
    err = ChildFailedError(
        "pretrain_gpt_memo.py",
        {0: _failure(0, 1, timestamp=9), 1: _failure(1, 2, timestamp=7), 2: _failure(2, 3, 8)},
    )
    assert first_failure(err)[0] == 1


def test_a_signal_stop_is_clean_only_when_every_worker_exited_zero(capsys):
    from memo_ext.launch import _stopped_by

    assert _stopped_by(signal.SIGTERM, {0: 0, 1: 0}) == 0
    assert _stopped_by(signal.SIGINT, {0: 0, 1: -15}) == 128 + signal.SIGINT
    assert _stopped_by(signal.SIGTERM, {}) == 128 + signal.SIGTERM
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "stopped by SIGTERM: every rank exited cleanly",
        "stopped by SIGINT: rank 1 did not exit cleanly",
        "stopped by SIGTERM: no rank ran",
    ]


def test_a_signal_stop_quotes_the_sentence_the_workers_left(capsys, tmp_path):
    import json

    from memo_ext.launch import _error_file_sentence, _stopped_by

    sentence = "interrupted (Ctrl-C); the latest complete checkpoint is iteration 4 in ckpt"
    written = tmp_path / "error.json"  # the layout the trainer writes (torch's handler's too)
    written.write_text(json.dumps({"message": {"message": sentence, "extraInfo": {}}}))
    assert _error_file_sentence(str(written)) == sentence
    assert _error_file_sentence(str(tmp_path / "none.json")) is None
    said = {0: sentence, 1: sentence}
    assert _stopped_by(signal.SIGINT, {0: 130, 1: 130}, said) == 128 + signal.SIGINT
    assert capsys.readouterr().err.splitlines() == [f"stopped by SIGINT: {sentence}"]


def test_the_torch_agent_internals_the_launcher_reads_are_there():
    """``memo_ext.launch`` reads the workers' exit codes where torch's agent keeps them."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

    # torch 2.11 has (self, death_sig), 2.13 (self, death_sig, timeout): passed on as given
    assert list(inspect.signature(LocalElasticAgent._shutdown).parameters)[:2] == [
        "self",
        "death_sig",
    ]
    assert "self._pcontext" in inspect.getsource(LocalElasticAgent._shutdown)
    assert "self.subprocess_handlers" in inspect.getsource(SubprocessContext.__init__)
    assert "self.error_files" in inspect.getsource(PContext.__init__)


@pytest.mark.parametrize("release", ["2.11", "2.13"])
def test_the_stopped_workers_are_recorded_whatever_the_agents_shutdown_takes(monkeypatch, release):
    """The wrapper passes the agent's arguments on as given: torch 2.11's ``_shutdown`` takes
    ``death_sig`` alone, 2.13's a ``timeout`` too, and every torchrun run ends through it."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from memo_ext.launch import _recording_stopped_workers

    calls = []
    if release == "2.11":

        def shutdown(self, death_sig=signal.SIGTERM):
            calls.append((death_sig,))
    else:

        def shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            calls.append((death_sig, timeout))

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", shutdown)
    handler = SimpleNamespace(proc=SimpleNamespace(returncode=0))
    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers={0: handler}))
    statuses: dict[int, int | None] = {}
    with _recording_stopped_workers(statuses):
        LocalElasticAgent._shutdown(agent)  # how the agent ends a run that finished
        LocalElasticAgent._shutdown(agent, signal.SIGINT)  # and one stopped by a signal
    assert LocalElasticAgent._shutdown is shutdown
    assert calls[0][0] == signal.SIGTERM and calls[1][0] == signal.SIGINT
    assert statuses == {0: 0}
