"""The simulator held against measurement: step times of the one H200 run, re-run on its model.

Each configuration of docs/gpu.md's "Measured on one H200" tables runs through ``memo-simulate``
(the trainer itself, on an emulated H200, timed by ``memo_ext.simulate.timing``) with only the
constants of that run's kernel microbenchmark (matmul 792 TFLOP/s, attention 456 TFLOP/s at 8K
tokens, host link 54.7 GB/s, as a ``memo-calibration/1`` file) and the H200 preset; the
estimator (``memo-estimate``) prices the same configuration with the same constants. Printed:
measured / simulated / estimator per configuration, their ratios, and whether the simulation
orders the methods of each table as the measurement does. The last column is the simulated
compute stream's memory-bound kernel time (element-wise ops, norms, the optimizer), which the
estimator counts as free inside its efficiencies: most of the estimator's distance from the
simulation. Exits 1 when a case is more than ``TOLERANCE`` (15%) from its measured step or a
table's methods come out in another order. ``--paper`` adds the MEMO paper's 7B
on 8 × A800 at 1M tokens (MEMO) beside the paper's MFU, with Megatron's full recomputation at
the longest length the estimator gives it, with the preset's (the estimator's fitted)
constants. Run from anywhere::

    python -m memo_ext.benchmarks.simulated_steps --json simulated_steps.json [--paper]

About a minute of CPU per configuration (the 1M-token ones: several). The measured figures are
docs/gpu.md's (scripts/gpu_check.sh on one H200, torch 2.11, medians of steps 2-5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from memo_ext.compare.comparison import layout_flags, model_flags
from memo_ext.compare.jobs import parse_method
from memo_ext.errors import OutOfMemory
from memo_ext.hardware import Calibration
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import MODELS

H200_MICROBENCHMARK = Calibration(
    device="h200-141g",
    peak_tflops=989.0,
    matmul_efficiency=792.0 / 989.0,
    attention_efficiency=456.0 / 989.0,
    host_link_gbps=54.7,
    host_link_gpus=1,
    source="microbenchmark",
    details={
        "from": "docs/gpu.md, Measured on one H200: the kernel microbenchmark of memo-compare"
    },
)
"""The one H200 run's microbenchmark (its layer matmuls, causal attention at 8K tokens, host
copies), the only constants the simulation and the estimator get here."""

ONE_B = [
    "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--ffn-hidden-size", "8192", "--vocab-size", "50256", "--loss-chunks", "8",
    "--seq-length", "32768", "--position-embedding-type", "rope", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--lr", "1e-4", "--bf16", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--no-create-attention-mask-in-dataloader",
    "--attention-backend", "sdpa",
]  # fmt: skip
"""scripts/gpu_check.sh's ~1B GPT (its MODEL_FLAGS at SEQ=32768)."""
ONE_B_ESTIMATE = [
    "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--ffn-hidden-size", "8192", "--vocab-size", "50257", "--loss-chunks", "8",
    "--seq-length", "32768",
]  # fmt: skip
MEMO = ["--memo", "--memo-alpha", "auto", "--memo-host-memory-gb", "48"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]  # fmt: skip


def seven_b_width(method: str, seq: int) -> list[str]:
    """memo-compare's job for ``method`` at ``seq`` tokens on the 7B width with 4 layers, as
    scripts/gpu_check.sh ran it (``compare_methods --model gpt-7b --num-layers 4 --loss-chunks
    16 --memo-keep-last-layers 1 --memory-limit-gb 40 -- --bf16``)."""
    model = dataclasses.replace(MODELS["gpt-7b"], num_layers=4)
    flags = model_flags(model) + layout_flags(ParallelLayout())
    flags += parse_method(method).trainer_flags(keep_last_layers=1)
    flags += ["--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1"]
    flags += ["--lr", "1e-4", "--mock-data", "--skip-preflight", "--loss-chunks", "16"]
    return flags + ["--memory-limit-gb", "40", "--bf16"]


def seven_b_width_estimate(method: str, seq: int, *extra: str) -> list[str]:
    return ["--model", "gpt-7b", "--num-layers", "4", "--method", method, "--seq-length",
            str(seq), "--loss-chunks", "16", *extra]  # fmt: skip


@dataclass(frozen=True)
class Case:
    table: str
    label: str
    flags: list[str]
    estimate: list[str]
    measured_s: float | None
    gpu: str = "h200-141g"
    gpus: int = 1
    measured_mfu: float | None = None
    """A figure measured elsewhere (the paper's), when there is no step time."""


H200_CASES = (
    Case("~1B GPT, 32K", "full recomputation", ONE_B + FULL_UNIFORM,
         ONE_B_ESTIMATE + ["--method", "full"], 1.176),
    Case("~1B GPT, 32K", "MEMO α auto", ONE_B + MEMO,
         ONE_B_ESTIMATE + ["--method", "memo"], 1.042),
    Case("~1B GPT, 32K", "MEMO chunked", ONE_B + MEMO + ["--memo-chunk-tokens", "auto"],
         ONE_B_ESTIMATE + ["--method", "memo", "--memo-chunk-tokens", "auto"], 1.120),
    Case("~1B GPT, 32K", "MEMO + planned allocator", ONE_B + MEMO + ["--memo-allocator", "plan"],
         ONE_B_ESTIMATE + ["--method", "memo"], 1.036),
    Case("7B width, 4 layers", "full 32K", seven_b_width("full", 32768),
         seven_b_width_estimate("full", 32768), 0.841),
    Case("7B width, 4 layers", "full 64K", seven_b_width("full", 65536),
         seven_b_width_estimate("full", 65536), 2.22),
    Case("7B width, 4 layers", "MEMO 32K", seven_b_width("memo", 32768),
         seven_b_width_estimate("memo", 32768, "--memo-keep-last-layers", "1"), 0.762),
)  # fmt: skip
"""docs/gpu.md's H200 tables: (table, method, trainer flags, estimator flags, measured step)."""

SEVEN_B_TP8 = [
    "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
    "--vocab-size", "50256", "--tokenizer-type", "NullTokenizer", "--position-embedding-type",
    "rope", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4", "--bf16",
    "--mock-data", "--attention-backend", "sdpa", "--tensor-model-parallel-size", "8",
    "--sequence-parallel", "--loss-chunks", "16", "--skip-preflight",
]  # fmt: skip
PAPER_MFU_7B_1M = 0.5230
"""The MEMO paper: 7B at 1M tokens on 8 A800, MEMO (benchmarks.paper_table's figure)."""
FULL_LONGEST_7B_A800 = 688_128
"""The estimator's longest length for Megatron's full recomputation, 7B on 8 A800 (docs)."""


def paper_cases() -> tuple[Case, ...]:
    def seq(n):
        return ["--seq-length", str(n)]

    # the node's host memory that gives each GPU the trainer's 240 GiB budget at the
    # estimator's share (not this machine's memory)
    est = ["--model", "gpt-7b", "--gpu", "a800-80g", "--gpus", "8", "--loss-chunks", "16",
           "--tensor-model-parallel-size", "8", "--sequence-parallel",
           "--host-memory-gb", "2400"]  # fmt: skip
    memo = ["--memo", "--memo-alpha", "auto", "--memo-host-memory-gb", "240"]
    return (
        Case("7B on 8 × A800 (paper)", "MEMO 1M", SEVEN_B_TP8 + seq(1 << 20) + memo,
             est + ["--method", "memo", "--seq-length", str(1 << 20)], None, "a800-80g", 8,
             measured_mfu=PAPER_MFU_7B_1M),
        Case("7B on 8 × A800 (paper)", "MEMO 1M, chunks",
             SEVEN_B_TP8 + seq(1 << 20) + memo + ["--memo-chunk-tokens", "auto"],
             est + ["--method", "memo", "--seq-length", str(1 << 20), "--memo-chunk-tokens",
                    "auto"], None, "a800-80g", 8, measured_mfu=PAPER_MFU_7B_1M),
        Case("7B on 8 × A800 (paper)", f"full {FULL_LONGEST_7B_A800 // 1024}K",
             SEVEN_B_TP8 + seq(FULL_LONGEST_7B_A800) + FULL_UNIFORM,
             est + ["--method", "full", "--seq-length", str(FULL_LONGEST_7B_A800)], None,
             "a800-80g", 8),
        Case("7B on 8 × A800 (paper)", f"MEMO {FULL_LONGEST_7B_A800 // 1024}K",
             SEVEN_B_TP8 + seq(FULL_LONGEST_7B_A800) + memo,
             est + ["--method", "memo", "--seq-length", str(FULL_LONGEST_7B_A800)], None,
             "a800-80g", 8),
    )  # fmt: skip


def simulate(case: Case, *, out: Path, calibration: Path | None, steps: int) -> dict:
    """``memo-simulate`` of one case (a process of its own); its ``simulate.json``, or
    ``{"failed": why}`` ("out of memory" when the run does not fit the modeled GPU)."""
    command = [
        sys.executable,
        "-m",
        "memo_ext.commands.simulate",
        "--gpu",
        case.gpu,
        "--gpus",
        str(case.gpus),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--no-trace",
    ]
    if calibration is not None:
        command += ["--calibration", str(calibration)]
    # the planned allocator's plans are kept in the run's own folder
    flags = case.flags + (["--memo-plan-cache", str(out / "plans")]
                          if "--memo-allocator" in case.flags else [])  # fmt: skip
    done = subprocess.run([*command, "--", *flags], capture_output=True, text=True)
    (out / "simulate.log").write_text(done.stdout + done.stderr)
    if done.returncode == OutOfMemory.exit_status:
        return {"failed": "out of memory"}
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-2:] or ["(no output)"]
        return {"failed": f"status {done.returncode}: {' / '.join(last)}"}
    return json.loads((out / "simulate.json").read_text())


def estimate(case: Case, *, calibration: Path | None) -> dict:
    """``memo-estimate --json`` of the case."""
    argv = [*case.estimate, "--json"]
    if "--gpu" not in argv:
        argv += ["--gpu", case.gpu, "--gpus", str(case.gpus), "--host-memory-gb", "240"]
    if calibration is not None:
        argv += ["--calibration", str(calibration)]
    command = [sys.executable, "-m", "memo_ext.commands.estimate", *argv]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{case.label}: memo-estimate failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def rows_of(cases, *, work: Path, calibration: Path | None, steps: int, progress) -> list[dict]:
    rows = []
    for k, case in enumerate(cases):
        out = work / f"{k:02d}"
        out.mkdir(parents=True, exist_ok=True)
        progress(f"[{k + 1}/{len(cases)}] {case.table}: {case.label}")
        sim = simulate(case, out=out, calibration=calibration, steps=steps)
        est = estimate(case, calibration=calibration)
        failed = sim.get("failed")
        if failed:  # out of the modeled device's memory, or the run failed: a row that says so
            sim = dict.fromkeys(("step_s", "mfu", "exposed_copy_s", "compute_idle_s"))
            sim |= {"compute_by_kernel_s": {}, "idle_by_cause_s": {}}
            progress(f"  {case.label}: {failed}")
        step = sim["step_s"]
        rows.append(
            {
                "table": case.table,
                "method": case.label,
                "gpu": f"{case.gpus} × {case.gpu}",
                "measured_s": case.measured_s,
                "measured_mfu": case.measured_mfu,
                "simulated_s": step,
                "simulated_mfu": sim["mfu"],
                "estimated_s": est["step_time_s"],
                "estimated_mfu": est["mfu"],
                "simulated_over_measured": (
                    step / case.measured_s if case.measured_s and step else None
                ),
                "estimated_over_measured": (
                    est["step_time_s"] / case.measured_s if case.measured_s else None
                ),
                "exposed_copy_s": sim["exposed_copy_s"],
                "memory_bound_s": sim["compute_by_kernel_s"].get("memory-bound"),
                "compute_idle_s": sim["compute_idle_s"],
                "idle_by_cause_s": sim["idle_by_cause_s"],
                "failed": failed,
                "trainer_flags": case.flags,
                "estimator_flags": case.estimate,
            }
        )
    return rows


TOLERANCE = 0.15
"""How far a simulated step may be from the measured one (exit status 1 beyond it)."""
MEASURED_TIE = 0.02
"""Two methods whose measured steps differ by less than this share are a tie: the measurement's
own spread (docs/gpu.md's fit reproduced three runs within 2.8%) does not order them."""


def orders(rows: list[dict]) -> dict[str, dict]:
    """Per table: whether the simulation orders every pair of its methods as measured (pairs
    measured within :data:`MEASURED_TIE` of each other are ties and not judged)."""
    result = {}
    for table in dict.fromkeys(r["table"] for r in rows):
        group = [r for r in rows if r["table"] == table and r["measured_s"] and r["simulated_s"]]
        judged, ties, wrong = 0, [], []
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                pair = f"{a['method']} / {b['method']}"
                if abs(a["measured_s"] - b["measured_s"]) < MEASURED_TIE * min(
                    a["measured_s"], b["measured_s"]
                ):
                    ties.append(pair)
                    continue
                judged += 1
                if (a["measured_s"] < b["measured_s"]) != (a["simulated_s"] < b["simulated_s"]):
                    wrong.append(pair)
        if judged:
            result[table] = {"same_order": not wrong, "pairs": judged, "ties": ties,
                             "wrong": wrong}  # fmt: skip
    return result


def print_table(rows: list[dict], out=sys.stdout) -> None:
    head = f"{'configuration':<44} {'measured':>10} {'simulated':>10} {'estimator':>10} " \
           f"{'sim/meas':>9} {'est/meas':>9} {'exposed copy':>12} {'memory-bound':>12}"  # fmt: skip
    print(head, file=out)
    for r in rows:
        name = f"{r['table']}: {r['method']}"
        if r["simulated_s"] is None:  # did not fit the modeled device, or failed
            status = "out of memory" if r["failed"] == "out of memory" else "failed"
            print(f"{name:<44} {'':>10} {status:>13} {r['estimated_s']:>7.3f} s", file=out)
            continue
        if r["measured_s"]:
            measured = f"{r['measured_s']:.3f} s"
            ratios = f"{r['simulated_over_measured']:>9.3f} {r['estimated_over_measured']:>9.3f}"
        else:
            mfu = r["measured_mfu"]
            measured = f"MFU {100 * mfu:.1f}%" if mfu else "—"
            ratios = f"{'MFU':>5} {100 * r['simulated_mfu']:.1f}% {100 * r['estimated_mfu']:.1f}%"
        print(
            f"{name:<44} {measured:>10} {r['simulated_s']:>8.3f} s {r['estimated_s']:>8.3f} s "
            f"{ratios} {r['exposed_copy_s']:>10.3f} s {r['memory_bound_s'] or 0.0:>10.3f} s",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--json", default=None, help="Write every figure here.")
    parser.add_argument(
        "--paper",
        action="store_true",
        help="Also the MEMO paper's 7B on 8 × A800 (several CPU minutes each).",
    )
    parser.add_argument("--only-paper", action="store_true", help="Only those.")
    parser.add_argument("--steps", type=int, default=3, help="Steps per run (first not counted).")
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="Keep each run's files here (default: a temporary folder).",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        calibration = work / "h200_microbenchmark.json"
        record = {"format": "memo-calibration/1", **dataclasses.asdict(H200_MICROBENCHMARK)}
        calibration.write_text(json.dumps(record, indent=1))
        progress = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
        rows = []
        if not args.only_paper:
            rows += rows_of(H200_CASES, work=work / "h200", calibration=calibration,
                            steps=args.steps, progress=progress)  # fmt: skip
        if args.paper or args.only_paper:
            rows += rows_of(paper_cases(), work=work / "paper", calibration=None,
                            steps=min(args.steps, 2), progress=progress)  # fmt: skip
    print_table(rows)
    ranked = orders(rows)
    for table, verdict in ranked.items():
        same = "yes" if verdict["same_order"] else f"NO ({'; '.join(verdict['wrong'])})"
        ties = (
            f"; measured ties, not judged: {'; '.join(verdict['ties'])}" if verdict["ties"] else ""
        )
        print(f"{table}: the simulation orders the methods as measured: {same} "
              f"({verdict['pairs']} pairs{ties})")  # fmt: skip
    ratios = [r["simulated_over_measured"] for r in rows if r["simulated_over_measured"]]
    summary = {
        "cases": len(rows),
        "worst_simulated_over_measured": max(ratios, key=lambda x: abs(x - 1), default=None),
        "median_simulated_over_measured": statistics.median(ratios) if ratios else None,
        "same_order": ranked,
    }
    result = {"calibration": dataclasses.asdict(H200_MICROBENCHMARK), "rows": rows,
              "summary": summary}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    outside = [
        f"{r['table']}: {r['method']}"
        for r in rows
        if r["measured_s"]
        and (r["simulated_s"] is None or abs(r["simulated_over_measured"] - 1) > TOLERANCE)
    ]
    misordered = [table for table, verdict in ranked.items() if not verdict["same_order"]]
    if outside or misordered:
        print(f"not held: outside ±{100 * TOLERANCE:.0f}% of the measured step: "
              f"{'; '.join(outside) or 'none'}; tables ordered otherwise: "
              f"{'; '.join(misordered) or 'none'}")  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
