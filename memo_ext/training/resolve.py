"""A parsed run resolved against its tokenizer and data: the frozen config the trainer runs.

:func:`resolve_run` settles what the flags leave open, once, before any process group exists
(every rank reaches the same result from the same flags and data):

- the vocabulary: the tokenizer's size, and the embedding table padded to a multiple of
  lcm(``--make-vocab-size-divisible-by``, every TP degree the run uses) rather than Megatron-LM's
  divisible-by × TP: padded logits enter the softmax, so the table must not change with TP;
- with HotSPa, each bucket's layout (``auto``: chosen by the estimator from the run's first
  global batches) and the home layout (the longest bucket's) as the run's layout.

It returns a new :class:`~memo_ext.config.RunConfig` (``dataclasses.replace``) whose
megatron-core ``TransformerConfig`` is built fresh; :func:`describe_run` is what the trainer logs
of it at start.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

from memo_ext.config import RunConfig
from memo_ext.hardware import DEVICES, cuda_device, device_spec
from memo_ext.hotspa import auto
from memo_ext.shapes import padded_vocab_size
from memo_ext.training.inputs import document_source

logger = logging.getLogger(__name__)

AUTO_DEVICE = "h100-80g"
"""The device HotSPa's ``auto`` plans for on a machine without a GPU and without
``--preflight-device``."""


def resolve_run(run: RunConfig, *, tokenizer) -> RunConfig:
    """``run`` with its vocabulary and (HotSPa) layouts settled; see the module docstring."""
    run = dataclasses.replace(
        run, shape=dataclasses.replace(run.shape, vocab_size=tokenizer.vocab_size)
    )
    if run.hotspa.enabled:
        run = _resolve_hotspa(run, tokenizer)
    tp_sizes = [run.layout.tp] + [layout.tp for layout in run.hotspa.strategies or ()]
    padded = padded_vocab_size(
        tokenizer.vocab_size,
        divisible_by=math.lcm(run.model.make_vocab_size_divisible_by, *tp_sizes),
    )
    return dataclasses.replace(run, model=dataclasses.replace(run.model, padded_vocab_size=padded))


def _resolve_hotspa(run: RunConfig, tokenizer) -> RunConfig:
    """Each bucket's layout (``auto``: by the estimator) checked against device memory, and
    home as the run's layout."""
    hot = run.hotspa
    device = device_spec(run.preflight.device) if run.preflight.device else cuda_device()
    if device is None and hot.strategies is not None:  # nothing to check the given layouts on
        return dataclasses.replace(run, layout=hot.home)
    device = device or DEVICES[AUTO_DEVICE]
    stats = auto.bucket_statistics(
        document_source(run, vocab_size=tokenizer.vocab_size),
        bounds=hot.buckets,
        global_batch_size=run.train.global_batch_size,
        seed=run.train.seed,
        backfill=hot.backfill,
    )
    common = dict(
        model=run.shape,
        device=device,
        bounds=hot.buckets,
        rows=[b.rows for b in stats],
        attention_fractions=[b.attention_fraction for b in stats],
        method=run.recompute.granularity or "none",
    )
    if hot.strategies is None:
        plan = auto.choose_strategies(world_size=run.world_size, mode=hot.mode, **common)
        hot = dataclasses.replace(hot, strategies=tuple(plan.layouts))
    else:
        plan = auto.evaluate_strategies(layouts=hot.strategies, **common)
    if os.environ.get("RANK", "0") == "0":
        logger.info("HotSPa layouts, predicted for %s:\n%s", device.name, auto.describe(plan))
    return dataclasses.replace(run, hotspa=hot, layout=hot.home)


def describe_run(run: RunConfig) -> str:
    """Every setting of ``run``, a line per section (what the trainer logs at start)."""
    lines = []
    for section in dataclasses.fields(run):
        value = getattr(run, section.name)
        if not dataclasses.is_dataclass(value):
            lines.append(f"{section.name}: {value}")
            continue
        items = ", ".join(
            f"{f.name}={_brief(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        lines.append(f"{section.name}: {items}")
    return "\n".join(lines)


def _brief(value) -> str:
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return ";".join(getattr(v, "name", str(v)) for v in value)
    return str(value)
