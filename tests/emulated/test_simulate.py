"""The modeled GPU's clock on the trainer's own schedule: a short simulation of 2 GPUs (TP 2 +
SP), its timeline's invariants, and planted schedule defects that must move the step and show
where they are.

The model is small in layers but GPU-sized in its shapes (hidden 2048 at 16K tokens): on fake
tensors shapes cost nothing on this CPU, and kernels then take longer than their launches, as on
a GPU, so the step is the device's time and not the host's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from memo_ext.errors import OutOfMemory
from memo_ext.simulate.device import emulated_cuda
from tests.emulated.test_training import train_on
from tests.launch import alone_env, cli

SHAPED = cli(
    num_layers=4,
    hidden_size=2048,
    num_attention_heads=16,
    seq_length=16384,
    micro_batch_size=1,
    global_batch_size=1,
    train_iters=3,
    lr="1e-4",
    mock_data=True,
    position_embedding_type="rope",
    tensor_model_parallel_size=2,
    attention_backend="sdpa",
) + ["--sequence-parallel", "--bf16"]
MEMO = ["--memo", "--memo-alpha", "auto", "--memo-keep-last-layers", "1",
        "--memo-host-memory-gb", "8", "--skip-preflight"]  # fmt: skip


def simulate(tmp_path, *extra: str):
    """Three steps as rank 0 of 2 GPUs; the device (its clock) and the metrics records."""
    with emulated_cuda(world_size=2, gpus=2, keep_intervals=True) as cuda:
        _, records = train_on(cuda, tmp_path, *extra, base=SHAPED)
    return cuda, records


def later_steps(cuda):
    steps = cuda.clock.steps
    assert [s.name for s in steps] == ["step 1", "step 2", "step 3"]
    return steps[1:]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds of ``a``'s intervals that lie inside some interval of ``b`` (``b`` disjoint)."""
    total = 0.0
    for start, end in a:
        total += sum(max(0.0, min(end, e) - max(start, s)) for s, e in b)
    return total


@pytest.fixture(scope="module")
def memo_run(tmp_path_factory):
    return simulate(tmp_path_factory.mktemp("memo"), *MEMO)


def test_the_timeline_holds_together(memo_run):
    """No stream is busier than the step; the trainer's step time is the clock's; copies run
    on the copy streams beside the compute stream's work, mostly hidden under it."""
    cuda, records = memo_run
    clock = cuda.clock
    for figures, record in zip(later_steps(cuda), records[1:]):
        step = figures.end - figures.start
        assert step > 0
        for stream, busy in figures.busy_s.items():
            assert busy <= step * (1 + 1e-9), (stream, busy, step)
        # every kernel of the compute stream is priced as one of the three
        kernels = figures.compute_s
        assert set(kernels) == {"matmul", "attention", "memory-bound"}
        ran = sum(i.end - i.start for i in clock.intervals if i.stream == clock.compute_stream
                  and i.kind == "compute" and figures.start <= i.start < figures.end)  # fmt: skip
        assert sum(kernels.values()) == pytest.approx(ran)
        assert min(kernels.values()) > 0
        # the trainer timed the step on the same clock (its span sits inside the range)
        assert 0.99 * step <= record["step_time_s"] <= step
        compute = [(i.start, i.end) for i in clock.intervals if i.stream == clock.compute_stream
                   and i.kind != "idle"
                   and figures.start <= i.start < figures.end]  # fmt: skip
        copies = [(i.start, i.end) for i in clock.intervals if i.kind in ("to_host", "to_device")
                  and figures.start <= i.start < figures.end]  # fmt: skip
        copied = sum(e - s for s, e in copies)
        assert copied > 0
        assert overlap(copies, compute) > 0.5 * copied  # the copies ran under compute
        exposed = sum(s for why, s in figures.idle_s.items() if "to_" in why)
        assert exposed < 0.5 * copied


def test_a_sync_planted_in_a_layer_is_host_sync_time_at_its_call_site(memo_run, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    import torch
    from megatron.core.transformer.mlp import MLP

    forward = MLP.forward

    def synchronizing_forward(self, *args, **kwargs):
        torch.cuda.synchronize()  # the planted defect
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(MLP, "forward", synchronizing_forward)
    cuda, _ = simulate(tmp_path, *MEMO)
    base, _ = memo_run
    for planted, clean in zip(later_steps(cuda), later_steps(base)):
        sites = [site for site in planted.host_syncs if "synchronizing_forward" in site]
        assert len(sites) == 1 and "test_simulate.py" in sites[0]
        # once per layer's forward, again where MEMO recomputes a layer's MLP tokens
        assert planted.host_syncs[sites[0]] >= 4
        assert planted.host_sync_s[sites[0]] > 0
        assert planted.end - planted.start > clean.end - clean.start


def test_a_prefetch_waited_for_one_layer_early_lengthens_the_step(memo_run, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """MEMO fetches a layer's host data while the layer after it runs its backward; a compute
    stream that waits for the fetch as soon as it starts (one layer early) stalls for it."""
    from memo_ext.memo.activations import LayerActivations

    prefetch = LayerActivations.prefetch

    def waiting_prefetch(self) -> None:
        prefetch(self)
        if self._prefetched is not None:
            self.engine.wait(self._prefetched[1])  # the planted defect

    monkeypatch.setattr(LayerActivations, "prefetch", waiting_prefetch)
    cuda, _ = simulate(tmp_path, *MEMO)
    base, _ = memo_run
    for planted, clean in zip(later_steps(cuda), later_steps(base)):
        waited = planted.idle_s.get("wait for to_device", 0.0)
        assert waited > clean.idle_s.get("wait for to_device", 0.0)
        assert planted.end - planted.start > clean.end - clean.start


def test_planning_that_reaches_cp_sat_trains_on_the_device(cuda, tmp_path, monkeypatch):
    """OR-Tools' CP-SAT loads and solves in a process that has the emulated device (its
    abseil flags once bound to libc10's global ones, and the import crashed). The passes of
    a tiny model are easy (the greedy placement meets the lower bound), so here the greedy
    placement is moved up by one block and the canonical search reports no proof: every plan
    goes on to CP-SAT."""
    from memo_ext.planner import solvers
    from memo_ext.planner.solvers import cpsat
    from tests.emulated.test_planned_allocator import PLANNED
    from tests.emulated.test_training import TINY

    solved = []
    greedy, canonical, model = solvers.solve_greedy, cpsat.solve_canonical, cpsat.solve_cpsat_model

    def above_the_bound(problem, options):
        found = greedy(problem, options)
        shift = int(problem.sizes.max()) if problem.n else 0
        return dataclasses.replace(found, offsets=found.offsets + shift, peak=found.peak + shift)

    def unproven(problem, options):
        return dataclasses.replace(canonical(problem, options), optimal=False, details={})

    def counted(*args, **kwargs):
        solved.append(1)
        return model(*args, **kwargs)

    monkeypatch.setattr(solvers, "solve_greedy", above_the_bound)
    monkeypatch.setattr(cpsat, "solve_canonical", unproven)
    monkeypatch.setattr(cpsat, "solve_cpsat_model", counted)
    monkeypatch.setattr(cpsat, "setup_units", lambda problem: 0.0)
    summary, _ = train_on(cuda, tmp_path, *PLANNED, "--train-iters", "2",
                          "--memo-plan-cache", str(tmp_path / "plans"), base=TINY)  # fmt: skip
    assert summary.iterations == 2
    assert solved


def memo_simulate(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """The installed command, as a user runs it (its own emulated trainer process)."""
    env = {k: v for k, v in alone_env().items() if not k.startswith("MEMO_")}
    return subprocess.run(
        [sys.executable, "-m", "memo_ext.commands.simulate", *argv],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_memo_simulate_prints_the_step_and_writes_its_timeline_and_trace(tmp_path):
    out = tmp_path / "sim"
    flags = [*SHAPED, *MEMO, "--save", str(tmp_path / "ckpt")]
    flags[flags.index("--seq-length") + 1] = "8192"
    done = memo_simulate(tmp_path, "--gpu", "h200", "--gpus", "2", "--steps", "2",
                         "--out", str(out), "--", *flags)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    left = next(line for line in done.stdout.splitlines() if "left to the simulation" in line)
    assert f"--save {tmp_path / 'ckpt'}" in left and "no checkpoint read or written" in left
    assert not (tmp_path / "ckpt").exists()
    assert "simulated on 2 × h200-141g" in done.stdout
    summary = json.loads((out / "simulate.json").read_text())
    assert summary["steps"] == 2 and summary["step_s"] > 0 and 0 < summary["mfu"] < 1
    assert 0 < summary["peak_device_bytes"] < summary["device_capacity_bytes"]
    assert summary["peak_pinned_host_bytes"] > 0  # MEMO's host buffers
    assert f"step                 {summary['step_s']:.4f} s" in done.stdout
    assert "compute stream busy  matmul " in done.stdout
    timeline = json.loads((out / "timeline.json").read_text())
    assert timeline["format"] == "memo-timeline/1"
    assert [s["name"] for s in timeline["steps"]] == ["step 1", "step 2"]
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    kinds = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert {"compute", "to_host", "to_device", "collective"} <= kinds


@pytest.mark.parametrize("memo", [False, True], ids=["plain", "memo"])
def test_memo_simulate_says_when_the_run_does_not_fit_the_gpu(tmp_path, memo):
    # under MEMO the error unwinds through copies in flight: the process still ends with the
    # out-of-memory status, not the exit check's
    if memo:  # the device's memory capped below the run's peak, reached with copies in flight
        flags = [*SHAPED, *MEMO, "--memory-limit-gb", "2.3"]
        flags[flags.index("--seq-length") + 1] = "8192"
    else:
        flags = [*SHAPED, "--skip-preflight"]
        for flag, value in (("--seq-length", "262144"), ("--num-layers", "8"),
                            ("--tensor-model-parallel-size", "1")):  # fmt: skip
            flags[flags.index(flag) + 1] = value
        flags.remove("--sequence-parallel")
    done = memo_simulate(tmp_path, "--steps", "2", "--gpus", "2" if memo else "1", "--no-trace",
                         "--out", str(tmp_path / "sim"), "--", *flags)  # fmt: skip
    assert done.returncode == OutOfMemory.exit_status, done.stderr[-3000:]
    assert "does not fit the modeled h100-80g: out of device memory" in done.stderr
    assert "Traceback" not in done.stderr


ORDER_DEFECT = """
import sys


def main():
    import torch  # the device comes with it, after sys.exit below was looked up

    side = torch.cuda.Stream()
    x = torch.empty(1 << 20, device="cuda")
    host = torch.empty(1 << 20, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)  # the side stream reads x
    del x  # freed while that copy may still read it
    return int(sys.argv[1])


sys.exit(main())  # as the trainer ends
"""


@pytest.mark.parametrize("status", [0, 5])
def test_the_exit_check_judges_a_process_that_finished_not_one_that_failed(tmp_path, status):
    """A block freed under a copy still reading it fails a process that finished (status 70);
    a process already failing (a trainer's error unwinding through copies in flight) keeps its
    own status."""
    from memo_ext.simulate.process import ORDER_ERROR_STATUS

    script = tmp_path / "defect.py"
    script.write_text(ORDER_DEFECT)
    env = {k: v for k, v in alone_env().items() if not k.startswith("MEMO_")}
    done = subprocess.run(
        [sys.executable, "-m", "memo_ext.simulate.run", "--", sys.executable, str(script),
         str(status)], env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == (ORDER_ERROR_STATUS if status == 0 else status), done.stderr[-2000:]
    assert ("OrderError" in done.stderr) == (status == 0)


def test_an_op_torch_decomposes_is_one_kernel_with_no_intermediates(cuda):
    """FakeTensorMode runs gelu_backward as six element-wise ops in fp32; on a GPU it is one
    kernel that allocates its output only: a first call (its dispatch not yet cached) took
    2 GiB of fp32 intermediates per call at 32K × 16384 and ran a capped run out of memory."""
    import torch

    grad = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    before, ops = (
        torch.cuda.memory_allocated(),
        cuda.clock.totals.ops.get(cuda.clock.compute_stream, 0),
    )
    out = torch.ops.aten.gelu_backward(grad, x)
    assert torch.cuda.max_memory_allocated() - before == out.untyped_storage().nbytes()
    assert cuda.clock.totals.ops[cuda.clock.compute_stream] - ops == 1
