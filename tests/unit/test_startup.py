"""What a user sees before any work starts: ``--help`` and a wrong flag answer without importing
megatron-core (seconds of CPU per process), and no library warns of what the user cannot change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TOOLS = (
    "tools.estimate",
    "tools.plan_memory",
    "tools.memory_report",
    "tools.compare_methods",
    "tools.compare_metrics",
    "tools.summarize_metrics",
    "tools.demo_corpus",
    "tools.preprocess_data",
    "tools.flag_reference",
    "tools.megatron_flags",
    "tools.plot_position_loss",
    "tools.convert_hf",
    "tools.eval_retrieval",
)

# runs each entry point's main as its command line would, in one fresh interpreter, and prints
# the modules of a library (megatron-core unless told) it imported
_PROBE = """
import contextlib, io, json, runpy, sys
calls, library = json.loads(sys.argv[1]), sys.argv[2]
for target, argv in calls:
    sys.argv = [target, *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            if target.endswith(".py"):
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__")
        except SystemExit:
            pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith(library))))
"""


def _megatron_imported_by(
    calls: list[tuple[str, list[str]]], *, library: str = "megatron"
) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(calls), library],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--num-layers", "x"], ["--num-layers", "2", "--no-such-flag"]],
    ids=["help", "bad-value", "unknown-flag"],
)
def test_the_trainer_answers_help_and_wrong_flags_without_megatron_core(argv):
    assert _megatron_imported_by([("pretrain_gpt_memo.py", argv)]) == []


def test_the_trainer_answers_a_wrong_data_path_without_megatron_core(tmp_path):
    """A missing dataset, and a dataset's file given for its prefix, are told before the
    imports that take tens of seconds on a loaded machine."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"")
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    model += ["--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1"]
    calls = [
        ("pretrain_gpt_memo.py", [*model, "--data-path", str(tmp_path / "missing")]),
        ("pretrain_gpt_memo.py", [*model, "--data-path", str(tmp_path / "corpus.bin")]),
        ("pretrain_gpt_memo.py", [*model, "--data-path", "0.3", str(tmp_path / "corpus"), "0.7",
                                  str(tmp_path / "other")]),
    ]  # fmt: skip
    assert _megatron_imported_by(calls) == []


@pytest.mark.parametrize("library", ["torch", "numpy"])
def test_the_trainer_answers_a_wrong_flag_before_torch_loads(library):
    # torch alone takes a second to import on a quiet machine, several on a loaded one
    calls = [("pretrain_gpt_memo.py", ["--hiden-size", "128"])]
    assert _megatron_imported_by(calls, library=library) == []


TORCH_FREE_TOOLS = (
    "tools.compare_metrics",
    "tools.summarize_metrics",
    "tools.plot_position_loss",
    "tools.convert_hf",
    "tools.preprocess_data",
    "tools.demo_corpus",
    "tools.memory_report",
    "tools.estimate",
    "tools.compare_methods",
    "tools.plan_memory",
    "tools.eval_retrieval",
)
"""The tools whose flags are checked before torch loads: every one (their registries of
methods, solvers and presets load torch only where a tool times or traces kernels)."""


def test_the_file_tools_answer_a_wrong_flag_before_torch_loads():
    calls = [(tool, ["--no-such-flag", "1"]) for tool in TORCH_FREE_TOOLS]
    assert _megatron_imported_by(calls, library="torch") == []


def test_the_plot_reads_the_key_the_trainer_writes():
    from memo_ext.commands.plot_position_loss import METRICS_KEY
    from memo_ext.training import position_loss

    assert METRICS_KEY == position_loss.METRICS_KEY


def test_every_tool_answers_help_without_megatron_core():
    assert _megatron_imported_by([(tool, ["--help"]) for tool in TOOLS]) == []


def test_the_package_filters_megatron_cores_notices_about_optional_kernels():
    # importing megatron-core after the package: its "Apex / Transformer Engine not installed"
    # notices are filtered; a warning of another kind still shows
    code = (
        "import warnings, memo_ext\nimport megatron.core.optimizer\nwarnings.warn('still shown')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "not installed" not in out.stderr
    assert "still shown" in out.stderr


def test_convert_hf_offers_what_the_converter_converts():
    from memo_ext.commands import convert_hf
    from memo_ext.hf.checkpoint import DTYPES
    from memo_ext.hf.weights import FAMILIES

    assert convert_hf.FAMILIES == FAMILIES
    assert tuple(DTYPES) == convert_hf.DTYPES


def _installed_commands() -> dict[str, str]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_every_installed_command_answers_from_any_folder(tmp_path):
    """The commands ``[project.scripts]`` installs run outside the repository (nothing of it on
    the path but the installed package), one per command module, none left out."""
    commands = _installed_commands()
    modules = {target.split(":")[0] for target in commands.values()}
    shipped = {
        f"memo_ext.commands.{p.stem}"
        for p in (ROOT / "memo_ext" / "commands").glob("*.py")
        if p.stem not in ("__init__", "pretrain_gpt_memo")  # the trainer runs under torchrun
    }
    assert shipped <= modules, f"not installed: {sorted(shipped - modules)}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name in commands:
        out = subprocess.run(
            [str(Path(sys.executable).with_name(name)), "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stderr[-2000:])


@pytest.mark.parametrize("name", sorted(_installed_commands()))
def test_every_installed_command_calls_itself_by_its_installed_name(name, capsys):
    """Its --help's usage line and its error prefix say ``memo-NAME``, whether it runs as that
    command, as ``python -m tools.NAME`` or from a test (argparse's default is the script's
    file name)."""
    import importlib

    module, function = _installed_commands()[name].split(":")
    main = getattr(importlib.import_module(module), function)

    def run(*argv: str) -> int:
        try:
            return main(list(argv))
        except SystemExit as stop:  # argparse's --help, and the tools whose parser exits itself
            return stop.code

    assert run("--help") == 0
    assert capsys.readouterr().out.startswith(f"usage: {name} ")
    assert run("--no-such-flag") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"{name}: error: ")


def test_the_trainer_runs_as_an_installed_module_from_any_folder(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "memo_ext.commands.pretrain_gpt_memo", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--memo-alpha" in out.stdout


def test_every_benchmark_runs_from_any_folder(tmp_path):
    """``python -m memo_ext.benchmarks.NAME`` outside the repository (the installed package alone
    on the path), and ``benchmarks/NAME.py`` is the same module's shim."""
    names = sorted(p.stem for p in (ROOT / "memo_ext" / "benchmarks").glob("[!_]*.py"))
    assert names == sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import importlib, sys; [importlib.import_module(m).main for m in sys.argv[1:]]"
    modules = [f"memo_ext.benchmarks.{name}" for name in names]
    out = subprocess.run(
        [sys.executable, "-c", probe, *modules],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name in names:
        assert (
            f"from memo_ext.benchmarks.{name} import main"
            in (ROOT / "benchmarks" / f"{name}.py").read_text()
        )


def test_ctrl_c_inside_a_checkpoint_save_is_an_interrupt():
    """torch.distributed.checkpoint catches whatever a save's writes raise, Ctrl-C included,
    and raises a CheckpointException holding it: that is still the user's Ctrl-C (exit 130),
    while a save that failed otherwise is not."""
    from torch.distributed.checkpoint.api import CheckpointException

    from memo_ext.commands.pretrain_gpt_memo import _is_interrupt

    def wrapped(err: BaseException) -> CheckpointException:
        return CheckpointException("write_data", {0: (err, None)})

    assert _is_interrupt(KeyboardInterrupt())
    assert _is_interrupt(wrapped(KeyboardInterrupt()))
    assert not _is_interrupt(wrapped(OSError(28, "No space left on device")))
    assert not _is_interrupt(SystemExit(1))
