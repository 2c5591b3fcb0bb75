"""A parsed run resolved against its tokenizer and data: the frozen config the trainer runs.

:func:`resolve_run` settles what the flags leave open, once, before any process group exists
(every rank reaches the same result from the same flags and data):

- the vocabulary: the tokenizer's size, and the embedding table padded to a multiple of
  lcm(``--make-vocab-size-divisible-by``, every TP degree the run uses) rather than Megatron-LM's
  divisible-by × TP: padded logits enter the softmax, so the table must not change with TP;
- with HotSPa, each bucket's layout (``auto``: chosen by the estimator from the run's first
  global batches) and the home layout (the longest bucket's) as the run's layout;
- ``--memo-chunk-tokens auto``: the chunk the estimator picks for this model, layout and
  sequence length on this device (``--preflight-device``, the CUDA device, else
  :data:`AUTO_DEVICE`).

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
from memo_ext.estimate.model import Batch, Efficiency, auto_chunk_tokens
from memo_ext.estimate.preflight import as_configured
from memo_ext.hardware import DEVICES, cuda_device, device_spec
from memo_ext.hotspa import auto
from memo_ext.shapes import padded_vocab_size
from memo_ext.training.inputs import document_source

logger = logging.getLogger(__name__)

AUTO_DEVICE = "h100-80g"
"""The device HotSPa's and the MEMO chunk's ``auto`` plan for on a machine without a GPU and
``--preflight-device``."""


def resolve_run(run: RunConfig, *, tokenizer) -> RunConfig:
    """``run`` with its vocabulary and (HotSPa) layouts settled; see the module docstring."""
    run = dataclasses.replace(
        run, shape=dataclasses.replace(run.shape, vocab_size=tokenizer.vocab_size)
    )
    if run.hotspa.enabled:
        run = _resolve_hotspa(run, tokenizer)
    if run.memo.enabled and run.memo.chunk_tokens == "auto":
        run = _resolve_chunk_tokens(run)
    tp_sizes = [run.layout.tp] + [layout.tp for layout in run.hotspa.strategies or ()]
    padded = padded_vocab_size(
        tokenizer.vocab_size,
        divisible_by=math.lcm(run.model.make_vocab_size_divisible_by, *tp_sizes),
    )
    return dataclasses.replace(run, model=dataclasses.replace(run.model, padded_vocab_size=padded))


def _resolve_chunk_tokens(run: RunConfig) -> RunConfig:
    """``--memo-chunk-tokens auto`` as a token count (see ``auto_chunk_tokens``)."""
    device = device_spec(run.preflight.device) if run.preflight.device else cuda_device()
    device, efficiency = as_configured(run, device or DEVICES[AUTO_DEVICE], Efficiency())
    chunk = auto_chunk_tokens(
        run.shape,
        run.layout,
        Batch(micro_batch_size=run.train.micro_batch_size),
        seq_length=run.data.seq_length,
        device=device,
        eff=efficiency,
    )
    if os.environ.get("RANK", "0") == "0":
        logger.info("MEMO chunks: %d local tokens (auto, for %s)", chunk, device.name)
    return dataclasses.replace(run, memo=dataclasses.replace(run.memo, chunk_tokens=chunk))


def _resolve_hotspa(run: RunConfig, tokenizer) -> RunConfig:
    """Each bucket's layout (``auto``: by the estimator) checked against device memory, and
    home as the run's layout."""
    hot = run.hotspa
    device = device_spec(run.preflight.device) if run.preflight.device else cuda_device()
    if device is None and hot.strategies is not None:  # nothing to check the given layouts on
        return dataclasses.replace(run, layout=hot.home)
    # --calibration and --memory-limit-gb as the preflight applies them
    device, efficiency = as_configured(run, device or DEVICES[AUTO_DEVICE], Efficiency())
    # one sample of the run's first global batches, packed both ways
    lengths = auto.sampled_lengths(
        document_source(run, vocab_size=tokenizer.vocab_size),
        seq_length=hot.buckets[-1],
        global_batch_size=run.train.global_batch_size,
        seed=run.train.seed,
    )
    stats = auto.length_statistics(lengths, bounds=hot.buckets, backfill=hot.backfill)
    # the single-layout alternative: every document packed into --seq-length rows
    (single,) = auto.length_statistics(lengths, bounds=hot.buckets[-1:], backfill=hot.backfill)
    common = dict(
        model=run.shape,
        device=device,
        bounds=hot.buckets,
        stats=stats,
        single=single if len(hot.buckets) > 1 else None,
        method=run.recompute.granularity or "none",
        efficiency=efficiency,
        # the working copy's gradient buffer has the dtype home's has
        copy_bytes_per_param=2 + (2 if run.distributed.grad_reduce_in_bf16 else 4),
    )
    if hot.strategies is None:
        plan = auto.choose_strategies(
            world_size=run.world_size,
            mode=hot.mode,
            # layouts with a model of their own may recompute less (or more) than home
            recompute_choices=auto.AUTO_RECOMPUTE,
            **common,
        )
        own = common["method"]
        hot = dataclasses.replace(
            hot,
            buckets=tuple(plan.bounds),
            strategies=tuple(plan.layouts),
            recompute=tuple(m if m != own else None for m in plan.methods),
        )
        if not any(hot.recompute):
            hot = dataclasses.replace(hot, recompute=None)
    else:
        plan = auto.evaluate_strategies(layouts=hot.strategies, recompute=hot.recompute, **common)
    hot = dataclasses.replace(
        hot,
        predicted_step_s=plan.step_s,
        predicted_single_layout_s=plan.baseline.step_s if plan.baseline else None,
    )
    if os.environ.get("RANK", "0") == "0":
        logger.info("HotSPa layouts, predicted for %s:\n%s", device.name, auto.describe(plan))
        slower = plan.baseline is not None and plan.predicted_gain < 1.0
        if slower:
            logger.warning(
                "--hotspa-strategies %s is predicted slower than one layout for every bucket: "
                "%.3g s per step against %.3g s for %s (%.2f×); --hotspa-strategies auto picks "
                "the faster",
                hot.strategy_spec,
                plan.step_s,
                plan.baseline.step_s,
                plan.baseline.layouts[0].name,
                plan.predicted_gain,
            )
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
