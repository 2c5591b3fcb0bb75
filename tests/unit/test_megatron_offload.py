"""megatron-core's own activation offloading as trainer flags and as the comparison method
``megatron-offload``: parsing, the refusals (one sentence each), the ``TransformerConfig`` fields
the trainer builds, and the refused rows of ``memo-compare``. Nothing here offloads:
both variants need CUDA and transformer-engine (tests/gpu/test_megatron_offload_cuda.py trains)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from tqdm import tqdm

import memo_ext.compare.jobs as mj
import memo_ext.config as c
import memo_ext.features.megatron_offload.method as offload_feature
from memo_ext.arguments import parse_args
from memo_ext.commands import compare_methods as cm
from memo_ext.compare import runs as compare_runs
from memo_ext.compare.report import format_summary
from memo_ext.errors import UsageError
from memo_ext.estimate.cost_model import Efficiency
from memo_ext.features.megatron import run_transformer_config
from memo_ext.features.megatron_offload import config as megatron_offload
from memo_ext.hardware import DeviceSpec
from memo_ext.mcore.transformer_config import transformer_config
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape
from tests.launch import SMALL_GPT, cli
from tests.unit.test_compare_methods import _comparison

FINE = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj"]
LAYER = ["--cpu-offloading-num-layers", "3"]
HOT = ["--hotspa", "--variable-seq-lengths", "--micro-batch-size", "1"]


def parse(*extra: str, world_size: int = 1) -> c.RunConfig:
    return parse_args([*SMALL_GPT, *extra], world_size=world_size)


@pytest.fixture
def offload_machine(monkeypatch):
    """A process with CUDA and transformer-engine, as far as the checks can tell."""
    monkeypatch.setattr(megatron_offload, "megatron_offload_missing", lambda: None)
    monkeypatch.setattr(offload_feature, "megatron_offload_missing", lambda: None)


@pytest.fixture
def bare_machine(monkeypatch):
    """A process with neither (this CPU machine, whatever machine runs the test)."""
    monkeypatch.setattr(
        megatron_offload, "megatron_offload_missing", lambda: "CUDA and transformer-engine"
    )
    monkeypatch.setattr(
        offload_feature, "megatron_offload_missing", lambda: "CUDA and transformer-engine"
    )


# --- the trainer's flags ------------------------------------------------------------------------


def test_offloading_is_off_by_default_as_in_megatron_core():
    t = run_transformer_config(parse())
    reference = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8)
    for name in (
        "cpu_offloading",
        "cpu_offloading_num_layers",
        "fine_grained_activation_offloading",
        "offload_modules",
        "min_offloaded_tensor_size",
    ):
        assert getattr(t, name) == getattr(reference, name), name


def test_fine_grained_flags_reach_transformer_config(offload_machine):
    run = parse(*FINE, "--offload-modules", "attn_norm", "--min-offloaded-tensor-size", "4096")
    # argparse keeps the last --offload-modules, as Megatron-LM's does
    assert run.offload.offload_modules == ("attn_norm",)
    run = parse(*FINE, "--min-offloaded-tensor-size", "4096")
    assert run.offload.offload_modules == ("core_attn", "attn_proj")
    t = run_transformer_config(run)
    assert t.fine_grained_activation_offloading and not t.cpu_offloading
    assert t.offload_modules == ["core_attn", "attn_proj"]  # megatron-core's type: a list
    assert t.min_offloaded_tensor_size == 4096


def test_layer_offloading_reaches_transformer_config(offload_machine):
    # Megatron-LM turns cpu_offloading on whenever --cpu-offloading-num-layers is above 0
    t = run_transformer_config(parse(*LAYER))
    assert (t.cpu_offloading, t.cpu_offloading_num_layers) == (True, 3)
    assert t.cpu_offloading_activations and not t.cpu_offloading_weights  # megatron's defaults
    assert not t.fine_grained_activation_offloading


@pytest.mark.parametrize("modules", [["core_attn"], list(c.OFFLOAD_MODULES), ["mlp_norm"]])
def test_accepted_settings_pass_megatron_cores_own_validation(offload_machine, modules):
    """The reference is megatron-core's ``TransformerConfig.__post_init__``: what the trainer
    accepts, it accepts (the config above is built through it; here with a TP 2 layout)."""
    run = parse("--fine-grained-activation-offloading", "--offload-modules", *modules)
    config = run_transformer_config(run, ParallelLayout(tp=2))
    assert config.offload_modules == modules


SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8)


@pytest.mark.parametrize(
    ("flags", "megatron_fields", "says"),
    [
        (
            ["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"],
            dict(fine_grained_activation_offloading=True, offload_modules=["attn_proj"]),
            "--offload-modules attn_proj needs core_attn too",
        ),
        (
            ["--cpu-offloading-num-layers", "4"],
            dict(cpu_offloading=True, cpu_offloading_num_layers=4),
            "--cpu-offloading-num-layers must be at least 1 and below --num-layers (4), got 4",
        ),
        (
            [*LAYER, "--recompute-granularity", "selective"],
            dict(
                cpu_offloading=True, cpu_offloading_num_layers=3, recompute_granularity="selective"
            ),
            "--cpu-offloading-num-layers does not run with --recompute-granularity here",
        ),
        (
            [*LAYER, "--pipeline-model-parallel-size", "2"],
            dict(cpu_offloading=True, cpu_offloading_num_layers=1, pipeline_model_parallel_size=2),
            "--cpu-offloading-num-layers does not run with --pipeline-model-parallel-size > 1",
        ),
    ],
)
def test_refusals_mirror_megatron_cores_own_checks(offload_machine, flags, megatron_fields, says):
    """Where megatron-core rejects a setting itself (a ValueError deep in model building), the
    trainer refuses it first, in one sentence."""
    with pytest.raises(ValueError):
        transformer_config(SHAPE, **megatron_fields)
    with pytest.raises(UsageError) as err:
        parse(*flags, world_size=2)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--fine-grained-activation-offloading"], "needs --offload-modules, one or more of"),
        (
            ["--offload-modules", "core_attn"],
            "only apply with --fine-grained-activation-offloading",
        ),
        (["--min-offloaded-tensor-size", "1"], "only apply with --fine-grained-activation"),
        ([*FINE, "--min-offloaded-tensor-size", "-1"], "--min-offloaded-tensor-size must be >= 0"),
        ([*FINE, "--offload-modules", "expert_fc1"], "invalid choice: 'expert_fc1'"),
        ([*FINE, *LAYER], "are exclusive (megatron-core runs one or the other)"),
        ([*LAYER, "--cpu-offloading-num-layers", "-1"], "must be at least 1 and below"),
        (
            [*FINE, "--recompute-granularity", "full", *cli(recompute_method="uniform")]
            + cli(recompute_num_layers=1),
            "--fine-grained-activation-offloading does not run with --recompute-granularity",
        ),
        ([*FINE, "--eval-interval", "5"], "does not run with --eval-interval here"),
        ([*FINE, "--memo"], "--memo cannot run with megatron-core's own activation offloading"),
        ([*LAYER, "--memo"], "--memo cannot run with megatron-core's own activation offloading"),
        ([*FINE, *HOT], "does not run with --hotspa here"),
    ],
)
def test_combinations_it_cannot_run_are_one_sentence(offload_machine, flags, says):
    with pytest.raises(UsageError) as err:
        parse(*flags, world_size=2)
    assert says in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "field_values",
    [
        {"variable_seq_lengths": True},
        {"rampup_batch_size": (2, 2, 8)},
        {"step_batch_size_schedule": "0:2"},
    ],
)
def test_fine_grained_refuses_a_changing_number_of_micro_batches(offload_machine, field_values):
    # the sections' own rules (--train-samples for a ramp, ...) come first on a command line:
    # check this rule alone on a parsed run
    run = parse(*FINE)
    section = "data" if "variable_seq_lengths" in field_values else "train"
    changed = dataclasses.replace(
        run, **{section: dataclasses.replace(getattr(run, section), **field_values)}
    )
    with pytest.raises(UsageError, match="replays the first step's micro-batches"):
        changed.offload.check_with(**_offload_sections(changed))
    # the layer-level variant keeps no state across steps: the same run is fine with it
    layer = dataclasses.replace(
        changed, offload=c.MegatronOffloadConfig(cpu_offloading_num_layers=3)
    )
    layer.offload.check_with(**_offload_sections(layer))


def _offload_sections(run) -> dict:
    """What ``MegatronOffloadConfig.check_with`` reads of ``run``."""
    return dict(
        recompute=run.recompute,
        hotspa=run.hotspa,
        layout=run.layout,
        data=run.data,
        train=run.train,
        evaluation=run.evaluation,
    )


@pytest.mark.parametrize("flags", [FINE, LAYER])
def test_a_machine_without_cuda_or_transformer_engine_is_refused(bare_machine, flags):
    with pytest.raises(UsageError) as err:
        parse(*flags)
    text = str(err.value)
    assert f"{flags[0]} needs CUDA and transformer-engine" in text and "drop it" in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("cuda", "te", "missing"),
    [
        (True, True, None),
        (False, True, "CUDA"),
        (True, False, "transformer-engine"),
        (False, False, "CUDA and transformer-engine"),
    ],
)
def test_what_is_missing_is_named(monkeypatch, cuda, te, missing):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(
        megatron_offload, "installed", lambda module: te and module == "transformer_engine"
    )
    assert c.megatron_offload_missing() == missing


def test_this_machine_is_judged_by_what_it_has():
    import importlib.util

    has_te = importlib.util.find_spec("transformer_engine") is not None
    expected = torch.cuda.is_available() and has_te
    assert (c.megatron_offload_missing() is None) == expected
    if not expected:
        with pytest.raises(UsageError, match="which this machine lacks"):
            parse(*FINE)


def test_megatron_lm_spellings_are_ours():
    """The flags are Megatron-LM's (an explicit flag of its arguments.py, or generated from
    megatron-core's TransformerConfig fields), so a Megatron-LM script passes them unchanged."""
    from memo_ext.arguments import build_parser
    from memo_ext.megatron_lm.flag_table import megatron_flags
    from memo_ext.megatron_lm.handling import HANDLING, LATER_FLAGS

    ours = build_parser()._option_string_actions
    assert "--cpu-offloading-num-layers" in megatron_flags()
    for name in (
        "--cpu-offloading-num-layers",
        "--fine-grained-activation-offloading",
        "--offload-modules",
        "--min-offloaded-tensor-size",
    ):
        assert name in ours and name not in HANDLING
        assert name in megatron_flags() or name in LATER_FLAGS
        field = name.removeprefix("--").replace("-", "_")
        assert field in {f.name for f in dataclasses.fields(TransformerConfig)}


# --- the comparison method ----------------------------------------------------------------------


def test_the_method_selects_fine_grained_offloading_of_every_dense_module(offload_machine):
    """The reference is the trainer's own parser: the method's flags give megatron-core's
    fine-grained offloading of all five dense modules, nothing else."""
    method = mj.parse_method("megatron-offload")
    assert method.refusal() is None
    run = parse(*method.trainer_flags())
    assert run.offload.fine_grained_activation_offloading
    assert set(run.offload.offload_modules) == set(c.OFFLOAD_MODULES)
    assert not run.offload.layer_offloading and not run.memo.enabled
    assert run.recompute.granularity is None
    assert run_transformer_config(run).min_offloaded_tensor_size == c.MIN_OFFLOADED_TENSOR_SIZE


def test_the_method_is_refused_in_one_sentence_without_cuda_or_te(bare_machine):
    method = mj.parse_method("megatron-offload@tp2")
    assert method.refusal() == (
        "megatron-offload needs CUDA and transformer-engine, which this machine lacks"
    )
    assert mj.parse_method("full").refusal() is None  # other methods never are


def _offload_comparison(tmp_path):
    method = mj.parse_method("megatron-offload")
    comp = _comparison(
        tmp_path,
        methods=[method],
        layouts={method.label: method.resolve_layout(ParallelLayout(), 2)},
        seq_lengths=[128, 256],
        efficiency=Efficiency(),
    )
    comp.device = DeviceSpec(
        name="cpu",
        peak_tflops=0.1,
        memory_bytes=2**30,
        host_link_gbps=5.0,
        nvlink_gbps=5.0,
        internode_gbps=1.0,
    )
    return comp, method


def _no_job(*args, **kwargs):
    raise AssertionError("a refused method must not start a job")


def test_a_refused_method_is_a_row_and_no_job_starts(tmp_path, bare_machine, monkeypatch):
    monkeypatch.setattr(compare_runs, "run_job", _no_job)
    comp, method = _offload_comparison(tmp_path)
    results = cm.Results(comp)
    with tqdm(total=2, disable=True) as bar:
        runner = cm.Runner(comp, results, bar)
        records = [runner.run(method, seq) for seq in comp.seq_lengths]
        found = cm.find_longest(comp, runner, method)
    for record in records:
        assert record["status"] == mj.REFUSED and record["exit_status"] is None
        assert record["message"] == method.refusal()
        assert record["command"] is None and record["log"] is None
        assert record["deterministic"] == {
            "note": "megatron-core's offloading is not traced on fake tensors"
        }
        assert record["predicted"]["step_time_s"] is None  # the estimator does not model it
    saved = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert {r["status"] for r in saved} == {mj.REFUSED}
    assert found["longest"] is None and method.refusal() in found["bound"]
    summary = format_summary(results.current(), [method.label], {})
    assert summary == f"megatron-offload: no length trained (refused: {method.refusal()})"


def test_a_refused_row_is_run_where_the_machine_can(tmp_path, bare_machine, monkeypatch):
    """A refusal is not cached as a result: resumed on a machine with CUDA and
    transformer-engine, the same configuration runs its job."""
    monkeypatch.setattr(compare_runs, "run_job", _no_job)
    comp, method = _offload_comparison(tmp_path)
    with tqdm(total=2, disable=True) as bar:
        assert cm.Runner(comp, cm.Results(comp), bar).run(method, 128)["status"] == mj.REFUSED
    monkeypatch.setattr(offload_feature, "megatron_offload_missing", lambda: None)
    started = []

    def run_job(argv, **kwargs):
        started.append(argv)
        records = [{"iteration": i, "loss": 5.0 - i, "step_time_s": 1.0} for i in (1, 2, 3)]
        return mj.JobOutcome(mj.OK, 0, 3.0, records=records, peak_rss_bytes=2**20)

    monkeypatch.setattr(compare_runs, "run_job", run_job)
    with tqdm(total=2, disable=True) as bar:
        record = cm.Runner(comp, cm.Results(comp), bar).run(method, 128)
    assert record["status"] == mj.OK and record["measured"]["step_time_s"] == 1.0
    (argv,) = started
    assert " ".join(offload_feature.MEGATRON_OFFLOAD_FLAGS) in " ".join(argv)
