"""``pretrain_gpt_memo.py`` with probes for the HotSPa tests (``run_pretrain(..., module=...)``
runs its ``main`` in the tests' workers), or as a module under torchrun::

    torchrun --nproc-per-node 2 -m tests.dist.hotspa_probe --probe-loss-scale 1024 \\
        <pretrain_gpt_memo.py flags>

``--probe-loss-scale S``: the home config's ``grad_scale_func`` multiplies every loss by ``S``,
as ``--fp16``'s loss scaler does (without its overflow checks). The fp32 optimizer does not unscale,
so the gradients and their norm come out ``S`` times larger, but only where the scale reached
the schedule that ran the loss.

With ``--hotspa``, after every step each process walks the non-home layouts' models (not the
engine's own records) and fails unless their parameters and DDP gradient buffers hold 0 bytes;
the metrics record gets what it found as ``probe_nonhome_held_bytes``, and each layout model's
``recompute_granularity`` as ``probe_recompute``.
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

from memo_ext.extension import MetricKey
from memo_ext.hotspa.engine import HotSPaEngine
from memo_ext.training import loop


def scale_losses(scale: float):
    """Inside the block, every ``_connect_schedule_hooks`` also sets a constant loss scale."""
    connect = loop._connect_schedule_hooks

    def connect_and_scale(config, model, optimizer, *, finalizes_gradients: bool) -> None:
        connect(config, model, optimizer, finalizes_gradients=finalizes_gradients)
        config.grad_scale_func = lambda loss: loss * scale

    return mock.patch.object(loop, "_connect_schedule_hooks", connect_and_scale)


def nonhome_held_bytes(engine: HotSPaEngine) -> int:
    """Bytes of storage behind the non-home models' parameters and gradient buffers now."""
    home = engine.runtimes[engine.home].model
    total = 0
    for rt in engine.runtimes.values():
        if rt.model is home:
            continue
        total += sum(p.untyped_storage().nbytes() for p in rt.model.parameters())
        total += sum(b.grad_data.untyped_storage().nbytes() for b in rt.model.buffers)
    return total


METRIC_KEYS = (
    MetricKey(
        ("probe_nonhome_held_bytes",),
        "int",
        "storage behind the non-home models' parameters and gradient buffers after the step",
    ),
    MetricKey(("probe_recompute",), "object", "each layout model's recomputation"),
)
"""What :func:`main`'s jobs add to a record (``tests.launch.run_pretrain`` reads it)."""


def check_released_after_steps():
    """Inside the block, ``HotSPaEngine.step_metrics`` (collected after every step) also checks
    the models."""
    metrics = HotSPaEngine.step_metrics

    def metrics_and_check(self: HotSPaEngine) -> dict:
        held = nonhome_held_bytes(self)
        if held:
            raise AssertionError(f"the non-home models hold {held} bytes between steps")
        recompute = {rt.name: rt.config.recompute_granularity for rt in self.runtimes.values()}
        return {
            **metrics(self),
            "probe_nonhome_held_bytes": held,
            "probe_recompute": recompute,
        }

    return mock.patch.object(HotSPaEngine, "step_metrics", metrics_and_check)


def main(argv: list[str]) -> int:
    """The trainer with the probes; they are undone when it returns (the tests' worker
    processes run other jobs next)."""
    from pretrain_gpt_memo import main as pretrain_main

    with contextlib.ExitStack() as probes:
        if "--probe-loss-scale" in argv:
            at = argv.index("--probe-loss-scale")
            probes.enter_context(scale_losses(float(argv[at + 1])))
            argv = argv[:at] + argv[at + 2 :]
        probes.enter_context(check_released_after_steps())
        return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
