"""A memory policy and an offload rule from outside the package, through ``--plugin`` alone:
``tests/plugin/toy_memory.py`` is copied into a temporary folder under a name of its own, put on
``PYTHONPATH``, and every tool takes it with no edit to ``memo_ext``: ``memo-estimate`` prices
the policy, ``memo-memory-report`` traces its layer, the trainer trains it (and the rule inside
MEMO) with the losses of the plain run, and ``memo-compare`` runs, predicts and traces both.
Each tool runs in a process of its own, so nothing stays registered in the test's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memo_ext.training.metrics import read_metrics
from tests.dist.test_memo_parity import COMMON, LLAMA
from tests.launch import ROOT, cli, free_port

pytestmark = pytest.mark.launch

PLUGIN = "toy_memory_elsewhere"
"""The plugin's module name in its temporary folder (the package names nothing of it)."""
POLICY, RULE = "toy-mlp-recompute", "toy-whole"
SEVEN_B_32K = [
    "--model", "gpt-7b", "--gpus", "8", "--seq-length", "32768",
    "--tensor-model-parallel-size", "8", "--sequence-parallel",
]  # fmt: skip
TRAIN = LLAMA + COMMON + cli(log_interval=1)
"""The MEMO parity tests' one-process run."""


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that can import the plugin (and only through the flag)."""
    folder = tmp_path_factory.mktemp("plugins")
    (folder / PLUGIN).mkdir()
    shutil.copy(ROOT / "tests" / "plugin" / "toy_memory.py", folder / PLUGIN / "__init__.py")
    paths = [str(folder), os.environ.get("PYTHONPATH", "")]
    base = {k: v for k, v in os.environ.items() if k != "MEMO_EXT_PLUGINS"}
    return {**base, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "OMP_NUM_THREADS": "1"}


def _tool(env, module: str, *args: str, status: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, env={**env, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == status, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _estimate(env, method: str) -> dict:
    done = _tool(
        env, "memo_ext.commands.estimate", "--plugin", PLUGIN, "--method", method, *SEVEN_B_32K,
        "--json",
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def test_memo_estimate_prices_the_plugins_policy(env):
    """Between no recomputation and full recomputation: half a layer's activations kept, its
    MLP's forward run again."""
    toy, none, full = (_estimate(env, m) for m in (POLICY, "none", "full"))
    assert toy["method"] == POLICY
    assert full["activation_bytes"] < toy["activation_bytes"] < none["activation_bytes"]
    assert 0 < toy["recompute_flops"] < full["recompute_flops"]


def test_memo_estimate_prices_memo_with_the_plugins_rule(env):
    """``--method memo:alpha=0.5,rule=toy-whole``: the same device bytes as MEMO's own rule at
    that α, more host bytes (every saved tensor goes whole)."""
    own, toy = (_estimate(env, f"memo:alpha=0.5{rule}") for rule in ("", f",rule={RULE}"))
    assert own["alpha"] == toy["alpha"] == 0.5
    assert toy["host_bytes"] > own["host_bytes"]


def test_memo_memory_report_traces_its_layer(env):
    done = _tool(
        env, "memo_ext.commands.memory_report", "--plugin", PLUGIN, "--num-layers", "4",
        "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "4096",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16", "--json",
    )  # fmt: skip
    methods = json.loads(done.stdout.splitlines()[-1])["methods"]
    toy, none = methods[POLICY], methods["none"]
    assert toy["device_activation_bytes"] < none["device_activation_bytes"]
    assert toy["recompute_flops"] > 0 and toy["host_bytes"] == 0


def _train(env, tmp_path: Path, name: str, *flags: str) -> list[dict]:
    metrics = tmp_path / f"{name}.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(ROOT / "pretrain_gpt_memo.py"), *TRAIN, *flags, "--metrics-file", str(metrics),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return read_metrics(metrics)


def test_the_trainer_trains_the_policy_and_the_rule_as_the_plain_run(env, tmp_path):
    """Recomputing a block, or sending MEMO's saves to host memory whole, changes no value."""
    plain = _train(env, tmp_path, "plain")
    toy = _train(env, tmp_path, "toy", "--plugin", PLUGIN, "--toy-mlp-recompute")
    rule = _train(
        env, tmp_path, "rule", "--plugin", PLUGIN, "--memo", "--memo-alpha", "0.3",
        "--memo-keep-last-layers", "0", "--memo-offload-rule", RULE,
    )  # fmt: skip
    losses = [r["loss"] for r in plain]
    assert len(losses) == 3
    for run in (toy, rule):
        assert [r["loss"] for r in run] == pytest.approx(losses, rel=1e-6)
    assert [r["toy_mlp_recomputed_layers"] for r in toy] == [3, 3, 3]
    assert all(r["host_offload_bytes"] > 0 for r in rule)


def test_memo_compare_runs_predicts_and_traces_both(env, tmp_path):
    """The jobs a comparison starts load the plugin from the environment it passes on."""
    out = tmp_path / "compare"
    _tool(
        env, "memo_ext.commands.compare_methods", "--plugin", PLUGIN, "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "256",
        "--methods", "none", POLICY, f"memo:alpha=0.5,rule={RULE}", "--memo-keep-last-layers",
        "0", "--seq-lengths", "128", "--measure-steps", "1", "--no-plot", "--out", str(out),
    )  # fmt: skip
    runs = {r["method"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    assert set(runs) == {"none", POLICY, f"memo:alpha=0.5,rule={RULE}"}
    for run in runs.values():
        assert run["status"] == "ok", run["message"]
        assert run["predicted"].get("error") is None, run["predicted"]
    assert runs[POLICY]["deterministic"]["traced_as"] == POLICY
    assert runs[f"memo:alpha=0.5,rule={RULE}"]["deterministic"]["traced_as"] == f"memo-0.5:{RULE}"
    assert runs[f"memo:alpha=0.5,rule={RULE}"]["deterministic"]["host_bytes"] > 0


def test_without_the_flag_nothing_of_it_is_known(env):
    done = _tool(env, "memo_ext.commands.estimate", "--method", POLICY, *SEVEN_B_32K, status=2)
    assert f"--method must be one of none, full, selective, memo, got '{POLICY}'" in done.stderr
    done = _tool(env, "memo_ext.commands.estimate", "--plugin", "no_such_plugin", status=2)
    assert done.stderr.strip().splitlines() == [
        "memo-estimate: error: --plugin no_such_plugin: cannot import it (No module named "
        "'no_such_plugin'); is its folder on PYTHONPATH or its package installed?"
    ]
