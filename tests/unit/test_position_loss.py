"""Validation loss by token position: bucket edges, sums that average back to the overall loss,
the loss closure that feeds them, TensorBoard scalars, and the plotting tool."""

from __future__ import annotations

import json

import pytest
import torch

from memo_ext.commands import plot_position_loss
from memo_ext.training.metrics import TensorBoardWriter
from memo_ext.training.position_loss import PositionLoss, bucket_labels, position_bounds
from memo_ext.training.step import loss_func


@pytest.mark.parametrize(
    "seq_length, min_tokens, bounds",
    [
        (1024, 64, [0, 64, 128, 256, 512, 1024]),
        (1000, 64, [0, 64, 128, 256, 512, 1000]),  # the last bucket is cut at --seq-length
        (64, 64, [0, 64]),
        (24, 64, [0, 24]),
        (65, 64, [0, 64, 65]),
        (9, 1, [0, 1, 2, 4, 8, 9]),
    ],
)
def test_bounds_double_from_the_first_width_up_to_the_sequence(seq_length, min_tokens, bounds):
    assert position_bounds(seq_length=seq_length, min_tokens=min_tokens) == bounds


def test_labels_name_first_and_last_position():
    assert bucket_labels([0, 64, 128, 200]) == ["0-63", "64-127", "128-199"]


def _packed_positions(lengths: list[int]) -> torch.Tensor:
    """position_ids [1, t] of documents packed in one row: they restart at each document."""
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


@pytest.mark.parametrize(
    "shape, positions",
    [
        ((3, 100), torch.arange(100).unsqueeze(0)),  # plain rows, positions shared by the batch
        ((1, 117), _packed_positions([50, 7, 60])),  # packed: position within the document
    ],
)
def test_buckets_hold_each_token_once_and_average_back_to_the_loss(shape, positions):
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(shape, generator=gen) * 10
    mask = (torch.rand(shape, generator=gen) > 0.2).float()
    bounds = position_bounds(seq_length=100, min_tokens=8)  # [0, 8, 16, 32, 64, 100]
    acc = PositionLoss(bounds, device=torch.device("cpu"))
    # two micro-batches: the sums add up over them
    for half in (slice(0, shape[1] // 2), slice(shape[1] // 2, None)):
        acc.add(losses[:, half], mask[:, half], positions[:, half])
    # brute force: every masked token's loss into the bucket its position lies in
    full = positions.expand(shape)
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        inside = (full >= lo) & (full < hi) & (mask > 0)
        assert acc.sums[1, k].item() == inside.sum().item()
        assert acc.sums[0, k].item() == pytest.approx(losses[inside].double().sum().item())
    means = acc.reduce()
    counts = dict(zip(bucket_labels(bounds), acc.sums[1].tolist()))
    overall = (losses * mask).double().sum() / mask.sum()
    weighted = sum(means[label] * counts[label] for label in means) / sum(counts.values())
    # float64 sums of the same float32 values in another order
    assert weighted == pytest.approx(overall.item(), rel=1e-12)


def test_empty_buckets_are_left_out():
    acc = PositionLoss([0, 4, 8, 16], device=torch.device("cpu"))
    acc.add(torch.ones(1, 4), torch.ones(1, 4), torch.arange(4).unsqueeze(0))
    assert acc.reduce() == {"0-3": 1.0}


def test_loss_closure_adds_by_position_and_keeps_its_own_figures():
    gen = torch.Generator().manual_seed(1)
    losses, mask = torch.rand(2, 16, generator=gen), torch.ones(2, 16)
    mask[1, 10:] = 0
    positions = torch.arange(16).unsqueeze(0)
    acc = PositionLoss([0, 4, 16], device=torch.device("cpu"))
    plain = loss_func(mask, losses)
    with_positions = loss_func(mask, losses, position_ids=positions, position_loss=acc)
    assert torch.equal(plain[2]["lm loss"], with_positions[2]["lm loss"])
    assert acc.sums[0].sum().item() == pytest.approx(plain[0].item(), rel=1e-6)
    assert acc.sums[1].tolist() == [8.0, 18.0]


def test_tensorboard_writes_one_scalar_per_bucket(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(str(tmp_path))
    record = {"iteration": 3, "val_loss": 2.0, "val_loss_by_position": {"0-7": 2.5, "8-15": 1.5}}
    writer.write(record)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"val/val_loss", "val_loss_by_position/0-7", "val_loss_by_position/8-15"} <= tags
    assert events.Scalars("val_loss_by_position/8-15")[0].value == 1.5


def _write_metrics(path, curves: dict[int, dict]) -> None:
    lines = [{"iteration": 1, "loss": 5.0}]
    lines += [{"iteration": it, "loss": 4.0, "val_loss_by_position": c} for it, c in curves.items()]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_plot_tool_writes_a_png_of_the_chosen_evaluation(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plots extra is not installed")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_metrics(a, {2: {"0-63": 5.0, "64-127": 4.0}, 4: {"0-63": 4.5, "64-127": 3.5}})
    _write_metrics(b, {2: {"0-63": 5.1, "64-127": 4.2, "128-255": 4.1}})
    out = tmp_path / "plots" / "curve.png"
    assert plot_position_loss.main([str(a), str(b), "--iteration", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_position_loss.position_curve(
        [json.loads(line) for line in a.read_text().splitlines()]
    ) == (4, {"0-63": 4.5, "64-127": 3.5})  # default: the last evaluation
    capsys.readouterr()
    assert plot_position_loss.main([str(a), "--iteration", "3", "--out", str(out)]) == 2
    assert "no evaluation there; evaluated at 2, 4" in capsys.readouterr().err


def test_plot_tool_refuses_a_file_without_the_figures(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"iteration": 1, "loss": 5.0}) + "\n")
    assert plot_position_loss.main([str(path), "--out", str(tmp_path / "c.png")]) == 2
    assert "no record has val_loss_by_position" in capsys.readouterr().err
