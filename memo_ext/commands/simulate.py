"""Time the trainer's own schedule on a modeled GPU, on a machine without one.

    memo-simulate --gpu h100-80g --gpus 8 --steps 3 --out runs/sim -- \\
        --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 131072 \\
        --tensor-model-parallel-size 8 --sequence-parallel --bf16 --mock-data --memo

Runs the trainer, with the trainer flags after ``--``, as rank 0 of ``--gpus`` GPUs on the
emulated device (``memo_ext.simulate``): every kernel, copy, collective, event wait and host
sync the code issues is placed on the modeled GPU's clock (``memo_ext.simulate.timing``), so
the step time is the one the code's schedule gives, not the estimator's ideal one. The other
ranks are emulated (their collectives take the ring model's time, they move nothing), so a
layout is simulated as one rank of symmetric groups; pipeline parallelism, whose stages differ,
is not simulated. Prints the step time, MFU, peak device and pinned host memory, where the
compute stream stood idle and the host synced, and writes ``timeline.json``, ``trace.json``
(Perfetto / chrome://tracing), ``metrics.jsonl`` and ``simulate.json`` to ``--out``.
docs/simulate.md says what is and is not modeled.

A separate command rather than a mode of ``memo-compare``: one configuration is the unit here,
the output is a timeline to read, and memo-compare's jobs, searches and calibration mean real
devices.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from memo_ext.arguments import OneSentenceParser
from memo_ext.errors import OutOfMemory, UsageError
from memo_ext.hardware import DEVICES, GIB
from memo_ext.plugins import with_plugins

PROG = "memo-simulate"
"""The installed command: its usage line and error prefix."""

OWN_FLAGS = {"--train-iters": 1, "--metrics-file": 1, "--log-interval": 1, "--save": 1,
             "--save-interval": 1, "--exit-interval": 1, "--load": 1,
             "--use-flash-attn": 0}  # fmt: skip
"""Trainer flags the simulation sets itself or leaves out (with how many values each takes):
its own steps and metrics, no checkpoint read or written (the values computed are not real,
a step costs the same from any weights), and attention through torch's SDPA, whose flash
kernel the clock prices as flash-attn's (a Megatron-LM script's --use-flash-attn needs the
flash_attn package, which a machine without CUDA does not have)."""


def trainer_flags(flags: list[str], *, steps: int, out: Path) -> tuple[list[str], list[str]]:
    """The trainer's flags for the simulation, and the user's flags it replaced.

    Raises:
        UsageError: for pipeline parallelism (not simulated).
    """
    kept, dropped, i = [], [], 0
    while i < len(flags):
        flag = flags[i].split("=", 1)[0]
        if flag == "--pipeline-model-parallel-size":
            value = flags[i].split("=", 1)[1] if "=" in flags[i] else flags[i + 1]
            if value != "1":
                raise UsageError(
                    "--pipeline-model-parallel-size above 1 is not simulated (its stages differ "
                    "and their schedule is not modeled); simulate one stage's layers with PP 1"
                )
        if flag in OWN_FLAGS:
            width = 0 if "=" in flags[i] else OWN_FLAGS[flag]
            dropped.append(" ".join(flags[i : i + 1 + width]))
            i += 1 + width
            continue
        kept.append(flags[i])
        i += 1
    own = ["--train-iters", str(steps), "--log-interval", "1", "--log-throughput"]
    return [*kept, *own, "--metrics-file", str(out / "metrics.jsonl")], dropped


def environment(*, gpu: str, gpus: int, out: Path, calibration: Path | None, trace: bool):
    """The trainer process's environment: the emulated device of ``gpus // node`` GPUs as rank
    0 of ``gpus``, its timeline written to ``out``."""
    from memo_ext.simulate import process, run
    from memo_ext.simulate.parts import part

    node = min(gpus, DEVICES[part(gpu)].gpus_per_node)
    env = run.environment(gpu=gpu, gpus=node)
    env.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(gpus), LOCAL_WORLD_SIZE=str(node),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=env.get("MASTER_PORT", "29517"),
        PYTHONUNBUFFERED="1",
    )  # fmt: skip
    env[process.OUT_VARIABLE] = str(out)
    env[process.WORLD_VARIABLE] = str(gpus)
    env[process.TRACE_VARIABLE] = "1" if trace else "0"
    if calibration is not None:
        env[process.CALIBRATION_VARIABLE] = str(calibration)
    return env


def summary(out: Path) -> dict:
    """The figures of a finished simulation, from its timeline and metrics files."""
    timeline = json.loads((out / "timeline.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = timeline["steps"]
    measured = steps[1:] or steps
    median = {
        key: statistics.median(s[key] for s in measured)
        for key in ("step_s", "compute_idle_s", "exposed_copy_s")
    }
    kernels = {
        kind: statistics.median(s["compute_by_kernel_s"].get(kind, 0.0) for s in measured)
        for kind in measured[0]["compute_by_kernel_s"]
    }
    causes: dict[str, float] = {}
    syncs: dict[str, float] = {}
    for s in measured:
        for why, seconds in s["compute_idle_by_cause_s"].items():
            causes[why] = causes.get(why, 0.0) + seconds / len(measured)
        for site, count in s["host_syncs"].items():
            syncs[site] = syncs.get(site, 0) + count / len(measured)
    steady = records[1:] or records
    mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {
        "steps": len(steps),
        "step_s": median["step_s"],
        "mfu": statistics.median(mfu) if mfu else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "compute_by_kernel_s": kernels,
        "compute_idle_s": median["compute_idle_s"],
        "exposed_copy_s": median["exposed_copy_s"],
        "idle_by_cause_s": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
        "host_syncs_per_step": dict(sorted(syncs.items(), key=lambda kv: -kv[1])),
        "peak_device_bytes": max(s["peak_device_bytes"] for s in measured),
        "peak_device_bytes_first_step": steps[0]["peak_device_bytes"],
        "device_capacity_bytes": timeline["device_capacity_bytes"],
        "peak_pinned_host_bytes": timeline["peak_pinned_host_bytes"],
        "rates": timeline["rates"],
    }


def report(s: dict, *, gpu: str, gpus: int, out: Path, trace: bool) -> str:
    step = s["step_s"]
    idle, exposed = s["compute_idle_s"], s["exposed_copy_s"]
    lines = [
        f"simulated on {gpus} × {gpu} (rank 0; rates: {s['rates']['source']}), medians of "
        f"{max(s['steps'] - 1, 1)} step(s) after the first:",
        f"  step                 {step:.4f} s",
        f"  MFU                  {100 * s['mfu']:.1f}%" if s["mfu"] is not None else "  MFU  —",
        f"  tokens/s             {s['tokens_per_s']:,.0f} (the job)",
        f"  peak device memory   {s['peak_device_bytes'] / GIB:.2f} GiB of "
        f"{s['device_capacity_bytes'] / GIB:.2f} (first step: "
        f"{s['peak_device_bytes_first_step'] / GIB:.2f})",
        f"  peak pinned host     {s['peak_pinned_host_bytes'] / GIB:.2f} GiB",
        "  compute stream busy  " + ", ".join(
            f"{kind} {s['compute_by_kernel_s'][kind]:.4f} s"
            for kind in ("matmul", "attention", "memory-bound")
            if kind in s["compute_by_kernel_s"]
        ),
        f"  compute stream idle  {idle:.4f} s ({100 * idle / step:.1f}% of the step)",
        f"  exposed copies       {exposed:.4f} s ({100 * exposed / step:.1f}% of the step)",
    ]  # fmt: skip
    shown = [(why, seconds) for why, seconds in s["idle_by_cause_s"].items() if seconds >= 1e-4]
    for why, seconds in shown[:5]:
        lines.append(f"    idle: {why:<60} {seconds:.4f} s")
    total = sum(s["host_syncs_per_step"].values())
    lines.append(f"  host syncs per step  {total:g}")
    for site, count in list(s["host_syncs_per_step"].items())[:5]:
        lines.append(f"    {count:>5g} × {site}")
    if trace:
        lines.append(f"  trace                {out / 'trace.json'} (ui.perfetto.dev opens it)")
    lines.append(f"  timeline             {out / 'timeline.json'}")
    return "\n".join(lines)


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (
        argv, [])  # fmt: skip
    from memo_ext.simulate.parts import ALIASES, GPUS, part

    parser = OneSentenceParser(prog=PROG, description=__doc__.split("\n\n")[2].split(".")[0])
    parser.add_argument(
        "--gpu",
        choices=[*GPUS, *ALIASES],
        default="h100-80g",
        help="The modeled GPU: a device preset (h100 and h200 for short; default h100-80g).",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs of the job (default 1; the world size the flags' layout divides; 8 per node).",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="Training steps to simulate (default 3; the first is not counted).",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="A calibration file (memo-compare --calibrate, gpu_check.sh) whose "
        "kernel rates and host link replace the preset's.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/simulate"),
        help="Folder for timeline.json, trace.json, metrics.jsonl, "
        "simulate.json (default runs/simulate).",
    )
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="Skip trace.json (every op of every step; large for big models).",
    )
    parser.epilog = "Trainer flags follow --, as pretrain_gpt_memo.py takes them."  # fmt: skip
    try:
        args = parser.parse_args(ours)
        args.gpu = part(args.gpu)
        if not flags:
            raise UsageError("give the trainer's flags after --")
        if args.gpus < 1 or args.steps < 1:
            raise UsageError("--gpus and --steps must be at least 1")
        if args.calibration is not None and not args.calibration.is_file():
            raise UsageError(f"--calibration {args.calibration} is not a file")
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        for name in ("timeline.json", "trace.json", "metrics.jsonl", "simulate.json"):
            (out / name).unlink(missing_ok=True)
        command, dropped = trainer_flags(flags, steps=args.steps, out=out)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if dropped:
        print(f"{PROG}: left to the simulation: {', '.join(dropped)} (its own steps and "
              "metrics, no checkpoint read or written, attention through SDPA)")  # fmt: skip
    from memo_ext.simulate import runtime

    runtime.build()
    env = environment(
        gpu=args.gpu, gpus=args.gpus, out=out, calibration=args.calibration,
        trace=not args.no_trace,
    )  # fmt: skip
    status = subprocess.call(
        [sys.executable, "-m", "memo_ext.commands.pretrain_gpt_memo", *command], env=env
    )
    if status == OutOfMemory.exit_status:
        print(f"{PROG}: the run does not fit the modeled {args.gpu}: out of device memory (the "
              "trainer's sentence above says where)", file=sys.stderr)  # fmt: skip
        return status
    if status != 0 or not (out / "timeline.json").exists():
        print(f"{PROG}: the simulated run ended with status {status}", file=sys.stderr)
        return status or 1
    s = summary(out)
    (out / "simulate.json").write_text(json.dumps(s, indent=1) + "\n")
    print(report(s, gpu=args.gpu, gpus=args.gpus, out=out, trace=not args.no_trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "summary", "trainer_flags"]
