"""One HotSPa step: every bucket in its own layout, gradients gathered in the home layout.

The home layout (the longest bucket's) is megatron's global one: its model is the trainer's
DDP model and owns the optimizer (fp32 master weights and state). Every other layout used by a
bucket has a model of its own, built on the same processes with explicit process groups, whose
parameters are working copies refreshed from home once per step, before the first bucket that
needs them. A step:

1. buckets in the home layout run first, then ``finalize_model_grads`` (DP × CP sum, SP norms
   over TP, tied embeddings over PP) in the home groups;
2. for each other layout: allocate its working copy, switch the weights home → layout, zero its
   gradients, run its buckets, finalize in its groups, switch the gradients layout → home,
   adding them, release its working copy;
3. divide the home gradients by the real tokens of the whole global batch.

A working copy (:class:`WorkingCopy`: the storage behind a layout model's weights and gradient
buffers) exists only while that layout's buckets run, so a process holds at most one at a time.
Between steps the non-home models keep their shapes, views and hooks but no storage: nothing may
read them then (checkpoints and weight statistics read the home model only).

Loss scaling (``--fp16``): megatron's schedules scale each micro-batch's loss by the
``grad_scale_func`` of the model's own ``TransformerConfig``. The trainer sets it on the home
config only, so every step first copies it to the other layouts' configs (the optimizer, at home,
unscales the summed gradients once). The other schedule hooks need no copying: every layout
finalizes through this engine (``finalize_model_grads_func`` is unset on all of them), and
``no_sync_func`` / ``grad_sync_func`` only act with ``--overlap-grad-reduce``, which HotSPa turns
off.

After finalisation every holder of a gradient slice holds the complete sum over its layout's
micro-batches, so any holder can send it and home receives each slice exactly once: the sum is
the gradient of the mean loss over every token of the global batch, whatever the layouts. The
loss pair (sum, tokens) is taken from TP rank 0 of each last pipeline stage only, so layouts
with different TP degrees add up correctly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from memo_ext.collectives import loss_pair
from memo_ext.hotspa.buckets import BucketBatch
from memo_ext.hotspa.switch import (
    SwitchPlan,
    SwitchStats,
    build_plan,
    describe_shards,
    local_tensors,
    merge_shards,
    ranks_per_node,
)
from memo_ext.mcore.groups import build_process_groups, home_process_groups, swap_cp_group
from memo_ext.parallel import ParallelLayout

logger = logging.getLogger(__name__)

Variant = tuple[ParallelLayout, "str | None"]
"""A bucket's layout and its model's recomputation where not the run's (``None``)."""


class WorkingCopy:
    """The storage behind one layout model's weights and gradient buffers, released between
    uses and re-allocated before the next.

    The storages are those of the model's parameters and of megatron DDP's contiguous buffers
    (``grad_data``, and ``param_data`` under the distributed optimizer), of which
    ``param.main_grad`` and the DDP buckets' tensors are views. Resizing a storage to 0 bytes and
    back keeps every view (shape, offset) valid, so the model, its DDP hooks and the switch
    plans need no rebuilding; re-allocated storage holds garbage until written. The weight
    switch writes every element of the weights (``SwitchPlan.check_fills``, checked when its
    plan is built) and ``zero_grad_buffer`` zeroes the gradients.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        """``model``: a megatron ``DistributedDataParallel``, its storage allocated."""
        tensors = list(model.parameters())
        for buffer in model.buffers + model.expert_parallel_buffers:
            tensors.append(buffer.grad_data)
            if buffer.param_data is not None:
                tensors.append(buffer.param_data)
        by_address: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:  # parameters inside a buffer share its storage: count it once
            storage = tensor.untyped_storage()
            if storage.nbytes():
                by_address.setdefault(storage.data_ptr(), storage)
        self.storages = list(by_address.values())
        self.sizes_bytes = [storage.nbytes() for storage in self.storages]

    def held_bytes(self) -> int:
        """Bytes allocated now: all of ``sizes_bytes``, or 0."""
        return sum(storage.nbytes() for storage in self.storages)

    def allocate(self) -> None:
        """Give every storage its bytes back (contents undefined)."""
        for storage, size in zip(self.storages, self.sizes_bytes):
            storage.resize_(size)

    def release(self) -> None:
        """Free every storage; the tensors keep their shapes but must not be read."""
        for storage in self.storages:
            storage.resize_(0)


@dataclass
class LayoutRuntime:
    """One layout's model and groups on this process."""

    layout: ParallelLayout
    config: object
    pgs: object
    model: torch.nn.Module
    shares_home: bool = False
    """Same TP and PP as home (only CP / DP differ): runs on the home model itself, with its
    CP group swapped for the bucket (dynamic CP), so nothing is switched."""
    copy: WorkingCopy | None = None
    """A model of its own (not home's): its weights and gradients, allocated only while its
    buckets run."""
    recompute: str | None = None
    """The model's recomputation where it is not the run's (``--hotspa-strategies`` ``:method``
    suffix or ``auto``'s choice): the same layout with two recomputations is two models."""
    forward_backward: Callable = field(init=False)
    p2p: P2PCommunicator | None = field(init=False)

    def __post_init__(self) -> None:
        self.forward_backward = get_forward_backward_func(pp_size=self.layout.pp)
        self.p2p = P2PCommunicator(pp_group=self.pgs.pp, config=self.config)

    @property
    def name(self) -> str:
        return self.layout.name + (f":{self.recompute}" if self.recompute else "")

    @property
    def reports_loss(self) -> bool:
        """TP rank 0 of the last stage: one loss pair per (DP, CP) replica."""
        return self.pgs.tp.rank() == 0 and self.pgs.pp.rank() == self.pgs.pp.size() - 1


@dataclass
class StepFigures:
    """What one step's switching did (this process, and the job where said)."""

    weight: SwitchStats = field(default_factory=SwitchStats)
    grad: SwitchStats = field(default_factory=SwitchStats)
    bucket_rows: list[int] = field(default_factory=list)
    bucket_documents: list[int] = field(default_factory=list)
    working_copy_bytes: int = 0
    """Most bytes of non-home working copies this process held at once in the step."""


class HotSPaEngine:
    """Runs steps over buckets in their layouts (see the module docstring)."""

    def __init__(
        self,
        *,
        variants: Sequence[Variant],
        home_model: torch.nn.Module,
        home_config,
        config_for: Callable[[ParallelLayout, str | None], object],
        build_model: Callable[..., torch.nn.Module],
        gated: bool,
        share_home_model: bool = True,
    ) -> None:
        """``variants``: per bucket, its layout and recomputation (``None``: the run's own), the
        last one home; ``home_config``: the home model's ``TransformerConfig``;
        ``config_for(layout, recompute)`` the ``TransformerConfig`` of another variant, and
        ``build_model(config=, pg_collection=)`` its model on these processes; ``gated``: the
        MLP is gated (SwiGLU), so its first weight holds two halves."""
        self.layouts = [layout for layout, _ in variants]
        self.keys: list[Variant] = list(variants)
        """Per bucket, its (layout, recomputation): what picks the model that runs it."""
        self.home: Variant = self.keys[-1]
        home_layout = self.home[0]
        self.runtimes: dict[Variant, LayoutRuntime] = {}
        self.runtimes[self.home] = LayoutRuntime(
            layout=home_layout, config=home_config, pgs=home_process_groups(), model=home_model
        )
        groups = {home_layout: self.runtimes[self.home].pgs}
        for key in dict.fromkeys(self.keys):  # distinct, in bucket order, on every rank
            if key == self.home:
                continue
            layout, method = key
            if layout not in groups:
                groups[layout] = build_process_groups(layout)
            pgs = groups[layout]
            if share_home_model and (layout.tp, layout.pp) == (home_layout.tp, home_layout.pp):
                self.runtimes[key] = LayoutRuntime(
                    layout=layout, config=home_config, pgs=pgs, model=home_model, shares_home=True
                )
                continue
            config = config_for(layout, method)
            model = build_model(config=config, pg_collection=pgs)
            copy = WorkingCopy(model)
            copy.release()  # until its first bucket: the weight switch will fill it
            self.runtimes[key] = LayoutRuntime(
                layout=layout, config=config, pgs=pgs, model=model, copy=copy, recompute=method
            )
        rank = dist.get_rank()
        switched = [rt for rt in self.runtimes.values() if not rt.shares_home]
        local = {
            rt.name: describe_shards(
                rt.model, rank=rank, tp=rt.layout.tp, tp_rank=rt.pgs.tp.rank(), gated=gated
            )
            for rt in switched
        }
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        self._shards = {
            rt.name: merge_shards([per_rank[rt.name] for per_rank in everyone]) for rt in switched
        }
        self._plans: dict[tuple[str, str], SwitchPlan] = {}
        self._rank, self._ranks_per_node = rank, ranks_per_node()
        self.last = StepFigures()

    def plan(self, source: Variant, target: Variant) -> SwitchPlan:
        """The cached plan that fills ``target``'s shards from ``source``'s."""
        key = (self.runtimes[source].name, self.runtimes[target].name)
        if key not in self._plans:
            plan = build_plan(
                self._shards[key[0]],
                self._shards[key[1]],
                rank=self._rank,
                ranks_per_node=self._ranks_per_node,
            )
            if target != self.home:  # weights into a working copy allocated uninitialised
                plan.check_fills(local_tensors(self.runtimes[target].model))
            self._plans[key] = plan
        return self._plans[key]

    def step(self, buckets: Sequence[BucketBatch], forward_step: Callable) -> torch.Tensor:
        """Forward / backward of one global batch; home gradients ready for the optimizer.

        The home model's gradient buffers must be zero on entry. Returns this process's
        (loss sum, real tokens) contribution; summed over the world it is the batch's pair.
        Each non-home layout's working copy is allocated for its buckets and released after
        its gradients reach home.
        """
        figures = StepFigures(
            bucket_rows=[0] * len(self.layouts), bucket_documents=[0] * len(self.layouts)
        )
        by_layout: dict[Variant, list[BucketBatch]] = {}
        for bucket in buckets:
            figures.bucket_rows[bucket.bucket] = bucket.rows
            figures.bucket_documents[bucket.bucket] = len(bucket.document_lengths)
            by_layout.setdefault(self.keys[bucket.bucket], []).append(bucket)
        pair = loss_pair([])
        home = self.runtimes[self.home]
        self._share_loss_scale()
        figures.working_copy_bytes = self._held_copy_bytes()
        # the home model first (home and dynamic-CP layouts), one gradient reduction for all
        on_home = [lay for lay in by_layout if self.runtimes[lay].model is home.model]
        for layout in on_home:
            for bucket in by_layout[layout]:
                pair += self._run_bucket(self.runtimes[layout], bucket, forward_step)
        if on_home:
            finalize_model_grads([home.model], num_tokens=None, pg_collection=home.pgs)
        for layout in (lay for lay in by_layout if lay not in on_home):
            rt = self.runtimes[layout]
            rt.copy.allocate()
            figures.working_copy_bytes = max(figures.working_copy_bytes, self._held_copy_bytes())
            figures.weight.add(
                self.plan(self.home, layout).run(local_tensors(home.model), local_tensors(rt.model))
            )
            rt.model.zero_grad_buffer()
            for bucket in by_layout[layout]:
                pair += self._run_bucket(rt, bucket, forward_step)
            finalize_model_grads([rt.model], num_tokens=None, pg_collection=rt.pgs)
            figures.grad.add(
                self.plan(layout, self.home).run(
                    local_tensors(rt.model, grads=True),
                    local_tensors(home.model, grads=True),
                    accumulate=True,
                )
            )
            rt.copy.release()
        total = sum(b.labelled_tokens for b in buckets)
        if total:
            home.model.scale_gradients(1.0 / total)
        self.last = figures
        return pair

    def _share_loss_scale(self) -> None:
        """The home config's ``grad_scale_func`` (``--fp16``'s loss scale) on every layout's
        config, each step: the trainer sets it on the home config, possibly after building the
        engine."""
        scale = self.runtimes[self.home].config.grad_scale_func
        for rt in self.runtimes.values():
            rt.config.grad_scale_func = scale

    def _held_copy_bytes(self) -> int:
        return sum(rt.copy.held_bytes() for rt in self.runtimes.values() if rt.copy is not None)

    def _run_bucket(self, rt: LayoutRuntime, bucket: BucketBatch, forward_step) -> torch.Tensor:
        with swap_cp_group(rt.model, rt.pgs.cp) if rt.shares_home else contextlib.nullcontext():
            losses = self._schedule(rt, bucket, forward_step)
        return loss_pair(losses if rt.reports_loss else [])

    def _schedule(self, rt: LayoutRuntime, bucket: BucketBatch, forward_step) -> list:
        return rt.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(bucket.micro_batches),
            model=[rt.model],
            num_microbatches=len(bucket.micro_batches),
            seq_length=bucket.length,
            micro_batch_size=1,
            forward_only=False,
            p2p_communicator=rt.p2p,
            pg_collection=rt.pgs,
        )

    def step_metrics(self) -> dict:
        """The last step's figures for the metrics file (switch bytes are the job's)."""
        f = self.last
        return {
            "hotspa_bucket_rows": f.bucket_rows,
            "hotspa_bucket_documents": f.bucket_documents,
            "hotspa_weight_switch_bytes": f.weight.world_bytes_moved,
            "hotspa_grad_switch_bytes": f.grad.world_bytes_moved,
            "hotspa_switch_bytes_sent": f.weight.bytes_sent + f.grad.bytes_sent,
            "hotspa_switch_bytes_reused": f.weight.bytes_reused + f.grad.bytes_reused,
            "hotspa_switch_s": f.weight.seconds + f.grad.seconds,
            "hotspa_working_copy_bytes": f.working_copy_bytes,
        }


def format_hotspa_metrics(metrics: dict) -> str:
    """A console fragment such as ``buckets 12/3/1 rows | switch 4.0 MiB in 3.1 ms``."""
    if not metrics:
        return ""
    rows = "/".join(str(r) for r in metrics["hotspa_bucket_rows"])
    moved = metrics["hotspa_weight_switch_bytes"] + metrics["hotspa_grad_switch_bytes"]
    return (
        f"buckets {rows} rows | switch {moved / 2**20:.1f} MiB "
        f"in {metrics['hotspa_switch_s'] * 1e3:.1f} ms"
    )
