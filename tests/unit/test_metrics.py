"""Analytic model FLOPs against torch's FlopCounterMode on a real GPTModel forward."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from memo_ext.mcore.flop_count import flop_counter_mode
from memo_ext.mcore.specs import build_block_spec, build_layer_spec
from memo_ext.mcore.transformer_config import model_shape_of
from memo_ext.shapes import ModelShape, forward_flops
from memo_ext.training.metrics import MetricsWriter, StepMetrics
from tests.models import cpu_config


@pytest.mark.parametrize("swiglu", [False, True])
def test_forward_flops_match_flop_counter(megatron_cpu, swiglu):
    shape = ModelShape(
        num_layers=2,
        hidden_size=48,
        ffn_hidden_size=80,
        num_attention_heads=6,
        num_query_groups=2,
        swiglu=swiglu,
        add_bias_linear=False,
        position_embedding_type="rope",
        vocab_size=128,
    )
    config = cpu_config(shape)
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_block_spec(config=config, layer_spec=spec),
        vocab_size=128,
        max_sequence_length=32,
        position_embedding_type="rope",
    )
    tokens = torch.randint(0, 128, (3, 32))
    with flop_counter_mode() as counter, torch.no_grad():
        model(tokens, torch.arange(32).expand(3, 32), None)
    # the config read back is the shape it was made from (megatron fills in the head dim)
    assert model_shape_of(config, vocab_size=128, position_embedding_type="rope") == replace(
        shape, kv_channels=8
    )
    # FlopCounterMode counts the full s × s attention products (it cannot see the causal skip)
    expected = forward_flops(shape, seq_length=32, sequences=3, causal_fraction=1.0)
    assert counter.get_total_flops() == expected


def test_metrics_file_has_the_contract_keys(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    for it in (1, 2):
        record = StepMetrics(
            iteration=it,
            loss=2.0,
            grad_norm=1.0,
            lr=1e-3,
            step_time_s=0.5,
            tokens_per_s=100.0,
            consumed_samples=4 * it,
        )
        writer.write(record.to_json())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2]
    required = {"iteration", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}
    assert required <= set(lines[0])
    assert "mfu" not in lines[0]  # unknown figures are omitted, not written as null


def test_cpu_attention_kernel_is_counted():
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    with flop_counter_mode() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # QK^T and PV over the full 16 × 16 matrix: 2 · (2·b·h·s·s·d)
    assert counter.get_total_flops() == 2 * (2 * 2 * 3 * 16 * 16 * 8)


def test_packed_document_flops_match_flop_counter(megatron_cpu):
    """A packed row of three documents: attention per document, the rest per token."""
    from memo_ext.mcore.packed import build_packed_seq_params

    shape = ModelShape(
        num_layers=1, hidden_size=32, num_attention_heads=4, add_bias_linear=False, vocab_size=64
    )
    config = cpu_config(shape)
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    model = GPTModel(
        config=config,
        transformer_layer_spec=build_block_spec(config=config, layer_spec=spec),
        vocab_size=64,
        max_sequence_length=32,
        position_embedding_type="rope",
    )
    lengths = [5, 11, 16]
    cu = torch.tensor([0, 5, 16, 32], dtype=torch.int32)
    params = build_packed_seq_params(cu_seqlens=cu, cu_seqlens_padded=cu, device="cpu")
    tokens = torch.randint(0, 64, (1, 32))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with flop_counter_mode() as counter, torch.no_grad():
        model(tokens, positions, None, packed_seq_params=params)
    expected = sum(
        forward_flops(shape, seq_length=n, sequences=1, causal_fraction=1.0) for n in lengths
    )
    assert counter.get_total_flops() == expected


def test_metrics_readers_name_files_that_are_no_metrics(tmp_path, capsys):
    """A binary file, a FIFO, an unknown --keys: one sentence, exit 2, no traceback."""
    import os

    from memo_ext.commands import compare_metrics
    from memo_ext.errors import UsageError
    from memo_ext.training.metrics import read_metrics

    binary = tmp_path / "model.pt"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(UsageError, match="is not a metrics file"):
        read_metrics(binary)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="is not a regular file"):
        read_metrics(fifo)
    good = tmp_path / "m.jsonl"
    good.write_text('{"iteration": 1, "loss": 2.0, "grad_norm": 1.0}\n')
    assert compare_metrics.main([str(good), str(good), "--keys", "loss", "nonexistent"]) == 2
    assert "--keys nonexistent: no record of" in capsys.readouterr().err
    assert compare_metrics.main([str(good), str(good), "--keys", "loss"]) == 0


def test_a_metrics_folder_removed_during_the_run_is_made_again(tmp_path, caplog):
    import shutil

    from memo_ext.training.metrics import MetricsWriter, read_metrics

    path = tmp_path / "run" / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    writer.write({"iteration": 1, "loss": 2.0})
    shutil.rmtree(tmp_path / "run")
    with caplog.at_level("WARNING"):
        writer.write({"iteration": 2, "loss": 1.5})
    assert "its folder was removed during the run" in caplog.text
    assert [r["iteration"] for r in read_metrics(path)] == [2]


def test_a_metrics_file_that_cannot_be_written_ends_the_run_in_one_sentence(tmp_path):
    from memo_ext.errors import ReportedError
    from memo_ext.training.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    path.unlink()
    path.mkdir()  # the path is now a folder: open("a") fails with IsADirectoryError
    with pytest.raises(ReportedError, match=f"--metrics-file {path}: cannot write it"):
        writer.write({"iteration": 1, "loss": 2.0})


@pytest.mark.parametrize(
    "tool, argv, message",
    [
        ("compare_metrics", ["only-one-file"], "the following arguments are required: other"),
        ("compare_metrics", ["a", "b", "--rtol", "nan"], "--rtol: must be a finite number"),
        ("summarize_metrics", ["m.jsonl", "--require-loss-drop", "inf"], "must be a finite"),
    ],
)
def test_metrics_tools_report_argument_errors_in_one_sentence(tool, argv, message, capsys):
    import importlib

    assert importlib.import_module(f"tools.{tool}").main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" not in err and err.count("\n") == 1


def test_every_key_of_a_step_record_is_documented_with_its_type():
    from dataclasses import fields

    from memo_ext.training.metric_keys import metric_keys, undocumented
    from memo_ext.training.metrics import STEP_KEYS, StepMetrics

    documented = {name for key in STEP_KEYS for name in key.names}
    assert {f.name for f in fields(StepMetrics)} - {"extra"} == documented
    names = [name for key in metric_keys() for name in key.names]
    assert len(names) == len(set(names)), "a key documented twice"
    record = StepMetrics(
        iteration=1, loss=2.5, grad_norm=1.0, lr=1e-3, step_time_s=0.1, tokens_per_s=10.0,
        consumed_samples=4, extra={"memo_alpha": float("nan"), "hotspa_bucket_rows": [1, 0]},
    ).to_json()  # fmt: skip
    assert undocumented(record) == []
    assert undocumented({"loss": "2.5", "no_such_key": 1, "hotspa_predicted_gain": None}) == [
        "loss: '2.5' is not float",
        "no_such_key: not documented",
    ]


def test_a_resumed_runs_summary_says_where_its_first_loss_is_from():
    from memo_ext.training.report import TrainSummary

    fresh = TrainSummary(iterations=300, losses=[5.6527, 1.4868], tokens_per_s=[9.0, 12.0, 11.0])
    # the first step (one-time work) is left out of the median: steps 299-300 here
    assert fresh.line() == (
        "done: 300 iterations, loss 5.6527 -> 1.4868, 12 tokens/s (median of steps 299-300)"
    )
    resumed = TrainSummary(iterations=8, resumed_at=4, losses=[3.0071, 3.007], tokens_per_s=[5.0])
    assert resumed.line() == (
        "done: iterations 5-8 (resumed at 4), loss 3.0071 -> 3.0070, 5 tokens/s (median of step 8)"
    )


def test_a_resume_drops_a_half_written_last_line_and_keeps_every_record_before(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"iteration": i, "loss": 5.0 - i}) for i in (1, 2, 3, 4)]
    path.write_text("\n".join(records) + '\n{"iteration": 5, "lo')  # killed while writing
    with caplog.at_level("WARNING", logger="memo_ext.training.metrics"):
        MetricsWriter(str(path), resume_from=3)
    assert path.read_text().splitlines() == records[:3]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"--metrics-file {path}: dropped line 5, which is no record" in warning
    assert "the 3 record(s) up to iteration 3 are kept" in warning
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_resume_keeps_the_file_whole_when_it_cannot_write(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2))
    path.write_text(text)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("memo_ext.training.metrics.os.replace", full)
    from memo_ext.errors import UsageError

    with pytest.raises(UsageError, match="cannot write it"):
        MetricsWriter(str(path), resume_from=1)
    assert path.read_text() == text


def test_curves_agree_where_both_lack_a_value_and_differ_where_one_does():
    from memo_ext.training.metrics import curve_differences

    ref = [{"iteration": 1, "loss": 2.0, "grad_norm": None, "by": {"a": 1}},
           {"iteration": 2, "loss": float("nan"), "by": {"a": 1}}]  # fmt: skip
    same = [{"iteration": 1, "loss": 2.0, "grad_norm": None, "by": {"a": 1}},
            {"iteration": 2, "loss": float("nan"), "by": {"a": 1}}]  # fmt: skip
    keys = ("loss", "grad_norm", "by")
    assert curve_differences(ref, same, rtol=0, keys=keys) == []
    other = [{"iteration": 1, "loss": 2.0, "grad_norm": 1.0, "by": {"a": 2}},
             {"iteration": 2, "loss": 3.0, "by": {"a": 1}}]  # fmt: skip
    assert curve_differences(ref, other, rtol=0, keys=keys) == [
        "iteration 1: grad_norm 1.0 vs reference None",
        "iteration 1: by {'a': 2} vs reference {'a': 1}",
        "iteration 2: loss 3.0 vs reference nan",
    ]


def test_reading_a_killed_runs_metrics_leaves_out_the_line_cut_short(tmp_path, caplog):
    from memo_ext.errors import UsageError
    from memo_ext.training.metrics import read_metrics

    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1, "loss": 2.0}\n{"iteration": 2, "lo')
    with caplog.at_level("WARNING", logger="memo_ext.training.metrics"):
        assert [r["iteration"] for r in read_metrics(path)] == [1]
    assert f"{path}: line 2 is cut short (left out)" in caplog.text
    path.write_text('{"iteration": 1, "loss": 2.0}\n{"iteration": 2, "lo\n')  # a whole bad line
    with pytest.raises(UsageError, match="line 2 is not a metrics record"):
        read_metrics(path)


def test_a_fresh_run_moves_an_earlier_runs_records_aside(tmp_path, caplog):
    from memo_ext.training.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    MetricsWriter(str(path)).write({"iteration": 1, "loss": 5.0})
    with caplog.at_level("WARNING"):
        MetricsWriter(str(path)).write({"iteration": 1, "loss": 4.0})
    assert [r["loss"] for r in read_metrics(path)] == [4.0]
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl.previous")] == [5.0]
    assert f"moved to {path}.previous" in caplog.text
    # an empty file (a run that logged nothing) is not worth keeping
    path.write_text("")
    MetricsWriter(str(path))
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl.previous")] == [5.0]
