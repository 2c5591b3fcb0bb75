"""A feature added from outside the package: a policy that counts transformer-layer calls, in
this file alone, registered with one line (``register``), changes the layer spec, contributes a
figure to every logged step, and leaves training exactly as it was.

The job runs in the tests' worker processes through :func:`main` (``run_pretrain(...,
module=...)``), which registers the extension for that job only.
"""

from __future__ import annotations

import dataclasses

import pytest
from megatron.core.transformer.transformer_layer import TransformerLayer

from memo_ext.extension import Extension, MetricKey, MetricSource
from memo_ext.features.extensions import register, unregister
from tests.launch import assert_same_curves, cli, reference_run, run_pretrain

pytestmark = pytest.mark.dist


class CountedLayer(TransformerLayer):
    """megatron-core's layer, counting its forward calls (the class, over all its layers)."""

    calls = 0

    def forward(self, *args, **kwargs):
        CountedLayer.calls += 1
        return super().forward(*args, **kwargs)


class LayerCalls(Extension):
    """Every layer a :class:`CountedLayer`; each step's count in the metrics as
    ``layer_calls``."""

    name = "layer-calls"
    metric_keys = (
        MetricKey(("layer_calls",), "int", "transformer-layer forward calls in the step"),
    )

    @classmethod
    def enabled(cls, run) -> bool:
        return True

    def layer_spec(self, run, spec, config):
        return dataclasses.replace(spec, module=CountedLayer)

    def begin_step(self, iteration: int) -> None:
        self.before = CountedLayer.calls

    def metric_sources(self) -> list[MetricSource]:
        return [
            MetricSource(
                collect=lambda: {"layer_calls": CountedLayer.calls - self.before},
                describe=lambda v: f"layer calls {v['layer_calls']}",
            )
        ]


METRIC_KEYS = LayerCalls.metric_keys
"""What :func:`main`'s jobs add to a record (``tests.launch.run_pretrain`` reads it)."""


def main(argv: list[str]) -> int:
    """The trainer with :class:`LayerCalls` registered (for this job only)."""
    from pretrain_gpt_memo import main as pretrain_main

    register(LayerCalls)
    try:
        return pretrain_main(argv)
    finally:
        unregister(LayerCalls)


ARGS = cli(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=32,
    micro_batch_size=2,
    global_batch_size=8,
    train_iters=3,
    lr="2e-3",
    mock_data=True,
    seed=5,
    hidden_dropout=0,
    attention_dropout=0,
)


@pytest.mark.parametrize(
    "nproc, extra, calls",
    [
        # 4 micro-batches × 4 layers, forward only (no recomputation)
        (1, [], 4 * 4),
        # megatron's full recomputation runs every layer's forward again in the backward
        (
            1,
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            2 * 4 * 4,
        ),
        # PP 2: rank 0 holds the first stage's 2 layers and counts its own calls
        (2, ["--pipeline-model-parallel-size", "2"], 4 * 2),
    ],
    ids=["plain", "full-recompute", "pp2"],
)
def test_a_registered_extension_counts_layer_calls_and_changes_nothing_else(
    tmp_path, reference_runs, nproc, extra, calls
):
    args = [*ARGS, *extra]
    counted = run_pretrain(
        args, nproc=nproc, workdir=tmp_path, name="counted", module="tests.dist.test_extension"
    )
    assert [r["layer_calls"] for r in counted] == [calls] * 3
    plain = reference_run(args, nproc=nproc, cache_dir=reference_runs)
    assert all("layer_calls" not in r for r in plain)  # registered for that job alone
    assert_same_curves(plain, counted, rtol=0)
