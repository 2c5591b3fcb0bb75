"""A different offload rule inside MEMO, defined in this file alone: the MLP's wide tensors (wider
than the hidden size: SwiGLU's fused input projection and its activation) go to host memory
whole, or stay on the device, while every other saved tensor goes token-wise as MEMO's rule
sends it. Registered with one line (``register``), named by ``--memo-offload-rule``, it trains
exactly like the run without MEMO, moves the bytes it says it moves, and the estimator's trace
of a layer under it holds and copies what training held and copied.

The jobs run in the tests' worker processes through :func:`main` (``run_pretrain(...,
module=...)``), which registers the rules for that job only.
"""

from __future__ import annotations

import pytest

from memo_ext.arguments import parse_args
from memo_ext.memo.rules import RULES, OffloadRule, Placement, SavedTensor, register, unregister
from tests.dist.test_memo_parity import COMMON, LLAMA
from tests.launch import assert_same_curves, reference_run, run_pretrain

pytestmark = pytest.mark.dist


def _wide(saved: SavedTensor) -> bool:
    return saved.shape[-1] > saved.hidden_size


class WideWhole(OffloadRule):
    """The MLP's wide tensors to host memory whole (never recomputed), the rest token-wise."""

    name = "test-wide-whole"

    def place(self, saved: SavedTensor) -> Placement:
        return Placement.WHOLE if _wide(saved) else Placement.TOKENWISE


class WideKept(OffloadRule):
    """The MLP's wide tensors kept on the device, the rest token-wise."""

    name = "test-wide-kept"

    def place(self, saved: SavedTensor) -> Placement:
        return Placement.KEEP if _wide(saved) else Placement.TOKENWISE


OURS = (WideWhole, WideKept)


def main(argv: list[str]) -> int:
    """The trainer with this file's rules registered (for this job only)."""
    from pretrain_gpt_memo import main as pretrain_main

    for rule in OURS:
        register(rule)
    try:
        return pretrain_main(argv)
    finally:
        for rule in OURS:
            unregister(rule)


ALPHA = "0.3"
ARGS = LLAMA + COMMON  # the MEMO parity tests' one-process run: its plain run is shared
MEMO = ["--memo", "--memo-alpha", ALPHA, "--memo-keep-last-layers", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    """Metrics of the plain run and of MEMO under each rule (MEMO's own: ``tokenwise``)."""
    runs = {"plain": reference_run(ARGS, nproc=1, cache_dir=reference_runs)}
    for rule in ("tokenwise", WideWhole.name, WideKept.name):
        runs[rule] = run_pretrain(
            [*ARGS, *MEMO, "--memo-offload-rule", rule],
            nproc=1,
            workdir=tmp_path_factory.mktemp(rule),
            name=rule,
            module="tests.dist.test_memo_offload_rule",
        )
    return runs


def test_a_rule_of_a_test_file_trains_exactly_like_the_run_without_memo(trained):
    for rule in ("tokenwise", WideWhole.name, WideKept.name):
        assert_same_curves(trained["plain"], trained[rule], rtol=0)


def test_the_rule_moves_what_it_places(trained):
    host = {rule: trained[rule][-1]["host_offload_bytes"] for rule in trained if rule != "plain"}
    recomputed = {rule: trained[rule][-1]["memo_recomputed_tokens"] for rule in host}
    # whole: the wide tensors' every token goes to host, not α of them; kept: none of them
    assert host[WideWhole.name] > host["tokenwise"] > host[WideKept.name] > 0
    # the layer's other token-wise tensors and attention's inputs are still recomputed
    assert recomputed[WideWhole.name] == recomputed["tokenwise"] == recomputed[WideKept.name] > 0
    assert all(r not in RULES for r in (WideWhole.name, WideKept.name))  # that job's alone


@pytest.fixture
def registered():
    for rule in OURS:
        register(rule)
    yield
    for rule in OURS:
        unregister(rule)


@pytest.mark.parametrize("rule", ["tokenwise", WideWhole.name, WideKept.name])
def test_the_estimator_traces_the_bytes_training_copied(trained, registered, rule):
    """One layer traced on fake tensors under the rule (what the preflight and memo-estimate
    price) copies per layer forward exactly what each offloaded layer of the run copied."""
    from memo_ext.estimate.measure import trace_layer
    from memo_ext.features.memo.stage import MEMO as MEMO_METHOD

    run = parse_args([*ARGS, *MEMO], world_size=1)
    figures = trace_layer(
        run.shape,
        tp=1,
        sp=False,
        tokens=run.data.seq_length,
        micro_batch_size=run.train.micro_batch_size,
        method=MEMO_METHOD,
        settings=MEMO_METHOD.traced_layer(float(ALPHA), rule=rule),
        fp32=True,  # as the CPU run trained
    )
    last = trained[rule][-1]
    assert figures.host_bytes * last["memo_offloaded_layers"] == last["host_offload_bytes"]


def test_the_estimator_prices_the_rule(registered):
    """What the estimator's MEMO stage reads: the rule's host bytes and device bytes per layer,
    against MEMO's own at the same α (bf16, as on a GPU)."""
    from memo_ext.estimate.cost_model import Batch
    from memo_ext.features.memo.stage import memo_at

    run = parse_args([*ARGS, *MEMO], world_size=1)
    at = dict(tokens=4096, alpha=float(ALPHA))
    batch = Batch(micro_batch_size=1)
    own = memo_at(run.shape, run.layout, batch, **at)
    whole = memo_at(run.shape, run.layout, batch, offload_rule=WideWhole.name, **at)
    kept = memo_at(run.shape, run.layout, batch, offload_rule=WideKept.name, **at)
    assert whole.host_bytes > own.host_bytes > kept.host_bytes
    assert kept.backward.saved_bytes > own.backward.saved_bytes == whole.backward.saved_bytes
    # the recompute pass re-runs the layer's token-local part over the dropped tokens whatever
    # the rule (the other token-wise tensors need it): the same FLOPs
    assert whole.backward.backward_matmul_flops == own.backward.backward_matmul_flops


def test_an_unregistered_rule_is_refused_by_name():
    from memo_ext.errors import UsageError
    from memo_ext.memo.rules import offload_rule

    with pytest.raises(UsageError, match="'test-nope' is no registered rule; registered: "):
        offload_rule("test-nope")
