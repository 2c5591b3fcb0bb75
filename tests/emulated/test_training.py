"""Whole training steps of the trainer's CUDA branch on the emulated device."""

from __future__ import annotations

import json

import pytest

from tests.launch import cli

TINY = cli(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    micro_batch_size=2,
    global_batch_size=4,
    train_iters=3,
    lr="1e-3",
    mock_data=True,
    log_interval=1,
    position_embedding_type="rope",
)


def train_on(cuda, tmp_path, *extra: str, base: list[str] = TINY):
    """Train ``base`` + ``extra`` in this process on the device; (summary, metrics records)."""
    from memo_ext.arguments import parse_args
    from memo_ext.training.loop import train

    metrics = tmp_path / "metrics.jsonl"
    run = parse_args([*base, "--metrics-file", str(metrics), "--log-interval", "1", *extra])
    summary = train(run)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return summary, records


def test_plain_steps(cuda, tmp_path):
    summary, records = train_on(
        cuda, tmp_path, "--log-params-norm", "--log-num-zeros-in-grad", "--eval-interval", "2",
        "--eval-iters", "1",
    )  # fmt: skip
    assert summary.iterations == 3
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert cuda.scalar_reads > 0


def test_retrieval_is_scored_on_the_device_and_summed_where_the_group_moves_data(cuda, tmp_path):
    """Retrieval prompts at and past --seq-length: their rows copied to the device, hits
    computed there (the argmax over the vocabulary), the table reduced on the collective
    device; at an evaluation of the training loop, and once by --skip-train."""
    grid = ["--eval-retrieval-lengths", "128,192", "--eval-retrieval-samples", "2",
            "--eval-retrieval-depths", "0,1", "--eval-retrieval-digits", "2",
            "--tokenizer-type", "ByteTokenizer"]  # fmt: skip
    _, records = train_on(cuda, tmp_path, "--eval-interval", "3", "--eval-iters", "1", *grid)
    (evaluated,) = [r for r in records if "val_passkey_acc" in r]
    assert set(evaluated["val_passkey_acc_by_cell"]) == {"128@0", "128@1", "192@0", "192@1"}
    assert 0.0 <= evaluated["val_passkey_token_acc"] <= 1.0
    alone = tmp_path / "alone"
    alone.mkdir()
    summary, (record,) = train_on(cuda, alone, "--skip-train", "--eval-iters", "0", *grid)
    assert summary.iterations == 0 and record["iteration"] == 0
    assert set(record) >= {"val_passkey_acc", "val_needle_acc_by_cell", "val_needle_token_acc"}


@pytest.mark.parametrize(
    "memo",
    [
        ["--memo-alpha", "0.5"],
        ["--memo-alpha", "auto"],
        # no preflight: pricing 24-token chunks traces hundreds of chunks (a minute of CPU)
        ["--memo-alpha", "0.5", "--memo-chunk-tokens", "24", "--skip-preflight"],
    ],
    ids=["whole", "auto", "chunked"],
)
def test_memo_steps(cuda, tmp_path, memo):
    """MEMO's copies, prefetches and ping-pong reuse, ordered on the device's streams; its host
    buffers pinned exactly (registered pages) within --memo-host-memory-gb."""
    budget = 0.01
    summary, records = train_on(
        cuda, tmp_path, "--memo", "--memo-keep-last-layers", "1", "--memo-host-memory-gb",
        str(budget), *memo,
    )  # fmt: skip
    assert summary.iterations == 3
    assert records[-1]["host_offload_bytes"] > 0
    assert 0 < cuda.registered_peak_bytes() <= budget * 2**30


def test_memo_auto_times_the_layer_after_a_warm_up(tmp_path, caplog):
    """A process's first matrix products of each shape pay for loading their kernels (and
    cuBLAS's handle and workspace; here: 0.5 s of host time each); the α rule must time the
    layer without that, or α comes out too high. (MEMO's one-token probe of the layer warms
    other shapes than the layer's.)"""
    import logging
    import re

    from memo_ext.simulate.device import emulated_cuda

    with emulated_cuda(first_gemm_s=0.5) as cuda, caplog.at_level(logging.INFO):
        train_on(cuda, tmp_path, "--memo", "--memo-keep-last-layers", "1", "--memo-alpha", "auto",
                 "--train-iters", "1")  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if "MEMO auto α" in r.getMessage()]
    forward_ms = float(re.search(r"layer forward ([0-9.]+) ms", line).group(1))
    assert forward_ms < 1000, line  # without the warm-up: 0.5 s per GEMM shape, over 3 s here


def test_loss_chunks_copy_nothing_from_the_host(cuda, tmp_path, monkeypatch):
    """--loss-chunks slices labels and losses on the device: no chunk waits for a copy of its
    indices from the host (on a GPU, a blocking copy and a stream sync each)."""
    from memo_ext.mcore.gpt import ChunkedLossGPTModel

    by_chunks = ChunkedLossGPTModel._by_chunks
    copies = []

    def counted(self, *args, **kwargs):
        before = cuda.blocking_host_copies
        losses = by_chunks(self, *args, **kwargs)
        copies.append(cuda.blocking_host_copies - before)
        return losses

    monkeypatch.setattr(ChunkedLossGPTModel, "_by_chunks", counted)
    summary, _ = train_on(cuda, tmp_path, "--loss-chunks", "4", "--train-iters", "1")
    assert summary.iterations == 1
    assert copies == [0, 0], copies  # one chunked loss per micro-batch, none copied


def test_memo_offload_rules_of_a_test_file_on_the_device(cuda, tmp_path):
    """The offload rules of ``tests/dist/test_memo_offload_rule.py`` with the device not the
    host: a save sent whole joins the storages copied out on the copy stream, a save kept stays
    a device tensor, and the steps are the same as with MEMO's own rule."""
    from memo_ext.memo.rules import register, unregister
    from tests.dist.test_memo_offload_rule import OURS, WideKept, WideWhole

    memo = ["--memo", "--memo-alpha", "0.5", "--memo-keep-last-layers", "1"]
    host, losses = {}, {}
    for rule in OURS:
        register(rule)
    try:
        for name in ("tokenwise", WideWhole.name, WideKept.name):
            folder = tmp_path / name
            folder.mkdir()
            _, records = train_on(cuda, folder, *memo, "--memo-offload-rule", name)
            host[name] = records[-1]["host_offload_bytes"]
            losses[name] = [r["loss"] for r in records]
    finally:
        for rule in OURS:
            unregister(rule)
    assert host[WideWhole.name] > host["tokenwise"] > host[WideKept.name] > 0
    assert losses[WideWhole.name] == losses["tokenwise"] == losses[WideKept.name]


def test_a_checkpoint_is_saved_from_the_device(cuda, tmp_path, monkeypatch):
    """The save half of tests/gpu's checkpoint test on the emulated device: device tensors copied
    to the host and written, torch's save plan gathered and scattered on the collective device,
    the checksums reduced there, the manifest committed; every file then verifies.

    One writer thread: the emulated device's tensors belong to one FakeTensorMode, which the
    writer's other threads cannot share (a GPU's tensors can). The load half is left to the
    GPU: the emulated device holds no values to load into (megatron-core's optimizer gets a meta
    tensor for its common step)."""
    from memo_ext.training.checkpoint import verify_checkpoint, writer

    monkeypatch.setattr(writer, "WRITER_THREADS", 1)
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "2", "--train-iters", "4"]
    _, records = train_on(cuda, tmp_path, *save, "--exit-interval", "2")
    assert [r["iteration"] for r in records] == [1, 2]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    manifest = verify_checkpoint(ckpt / "iter_0000002")
    assert manifest["model"]["num_layers"] == 4
