"""Run any command on the emulated device: ``python -m memo_ext.simulate.run [--gpu h200]
[--gpus N] -- CMD [ARG ...]``.

Every Python process the command starts — torchrun's agent and workers, a tool's subprocesses,
a comparison's jobs — has the emulated CUDA device (:mod:`memo_ext.simulate.process`), and
``nvidia-smi`` answers for it, so whole shell scripts run as they would on that machine::

    python -m memo_ext.simulate.run -- bash scripts/gpu_check.sh
    python -m memo_ext.simulate.run --gpus 2 -- python -m memo_ext.launch --nproc-per-node 2 ...

Values are fake (the device computes nothing); what a run shows is that nothing crashes, hangs,
puts a tensor on the wrong device or breaks a stream-ordering rule. The command's exit status is
returned (70: a process broke an ordering rule at its end).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from memo_ext.simulate import runtime
from memo_ext.simulate.parts import ALIASES, GPUS, part
from memo_ext.simulate.process import GPU_VARIABLE, GPUS_VARIABLE

HERE = Path(__file__).resolve().parent
PARTS = (*GPUS, *ALIASES)


def environment(*, gpu: str, gpus: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the device put into every Python
    process started with it."""
    env = dict(os.environ if base is None else base)
    paths = [str(HERE / "site")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PATH"] = os.pathsep.join([str(HERE / "bin"), env.get("PATH", "")])
    env[GPU_VARIABLE], env[GPUS_VARIABLE] = gpu, str(gpus)
    spec = GPUS[part(gpu)]  # what nvidia-smi answers
    env["MEMO_EMULATED_GPU_NAME"] = spec.name
    env["MEMO_EMULATED_GPU_MIB"] = str(spec.total_memory // 2**20)
    return env


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m memo_ext.simulate.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gpu", choices=PARTS, default="h100", help="The part (default h100).")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the machine (1 to 8).")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if not 1 <= args.gpus <= 8:
        parser.error(f"--gpus must be 1 to 8, got {args.gpus}")
    runtime.build()  # once, before the command's processes race to build it
    env = environment(gpu=args.gpu, gpus=args.gpus)
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
