"""Optimizers behind one small interface, and megatron-core's LR schedule.

On CUDA the optimizer is megatron-core's (mixed precision, fp32 master weights, optionally the
distributed optimizer). megatron's optimizers require CUDA tensors, so on CPU the same contract
is served by ``torch.optim.AdamW`` over the fp32 parameters with a model-parallel-aware global
gradient norm and clipping (:class:`TorchAdamW`). Both expose ``zero_grad``, ``step`` →
``(updated, grad_norm)`` and ``param_groups`` (read by ``OptimizerParamScheduler``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import (
    OptimizerParamScheduler,
    combine_param_group_overrides,
    get_canonical_lr_for_logging,
)
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from memo_ext.collectives import collective_device
from memo_ext.config import TrainConfig
from memo_ext.device import on_gpu
from memo_ext.training.model_stats import count_zeros_in_grad


class TrainingOptimizer(Protocol):
    """What the training loop needs from an optimizer."""

    param_groups: list[dict]

    def zero_grad(self) -> None: ...

    def step(self) -> tuple[bool, float | None]: ...

    def sharded_state_dict(self, model_sharded: dict, *, is_loading: bool = False) -> dict: ...

    def load_sharded_state_dict(self, loaded: dict) -> None: ...

    def reload_model_params(self) -> None: ...


def optimizer_config(
    train: TrainConfig, *, bf16: bool = False, fp16: bool = False
) -> OptimizerConfig:
    """megatron-core's ``OptimizerConfig`` of these flags (its parameter-group rules read it)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        decoupled_lr=train.decoupled_lr,
        decoupled_min_lr=train.decoupled_min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=bf16,
        fp16=fp16,
        loss_scale=train.loss_scale,
        initial_loss_scale=train.initial_loss_scale,
        min_loss_scale=train.min_loss_scale,
        loss_scale_window=train.loss_scale_window,
        hysteresis=train.hysteresis,
        use_distributed_optimizer=train.use_distributed_optimizer,
    )


def _param_groups(model_chunks: Iterable[torch.nn.Module], train: TrainConfig) -> list[dict]:
    """megatron-core's parameter groups (``get_standard_config_overrides``): biases and 1-D
    parameters (norm weights) are not decayed; with --decoupled-lr the embedding and output
    layer weights (``is_embedding_or_output_parameter``) carry their own ``max_lr`` /
    ``min_lr``, which megatron-core's scheduler reads. Groups on the default rate come first
    and are marked ``default_config`` (the logged rate)."""
    overrides = get_standard_config_overrides(optimizer_config(train))
    grouped: dict[tuple, list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            matched = [value for key, value in overrides.items() if key.matches(param, name)]
            override = combine_param_group_overrides(matched) if matched else {}
            grouped.setdefault(tuple(sorted(override.items())), []).append(param)
    groups = []
    for key, params in sorted(grouped.items()):
        override = dict(key)
        default_rate = not any("lr" in name for name in override)
        groups.append(
            {"params": params, "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False}
            | {"default_config": default_rate}
            | override
        )
    return sorted(groups, key=lambda group: not group["default_config"])


def lr_for_logging(param_groups: list[dict]) -> float:
    """The rate of the default groups (megatron-core's choice), not a decoupled one."""
    lr = get_canonical_lr_for_logging(param_groups)
    return param_groups[0]["lr"] if lr is None else lr


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of the whole model's gradient, counting each logical element once.

    Tensor-parallel shards all count; TP-replicated parameters count on TP rank 0 only; the
    copy of a tied embedding on the last pipeline stage is skipped. Squares are summed over the
    model-parallel group (TP × PP); data-parallel replicas already hold reduced gradients.
    """
    total = torch.zeros((), dtype=torch.float64, device=collective_device())
    for p in params:
        if p.grad is None or not param_is_not_shared(p):
            continue
        if param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().double().pow(2).sum().to(total.device)
    if dist.is_initialized():
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return math.sqrt(total.item())


class TorchAdamW:
    """``torch.optim.AdamW`` over fp32 parameters whose gradients live in DDP's ``main_grad``."""

    def __init__(
        self,
        *,
        model_chunks: list[torch.nn.Module],
        train: TrainConfig,
        log_num_zeros_in_grad: bool = False,
    ):
        self.params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.num_zeros_in_grad: int | None = None
        """Zeros of the last step's reduced gradient (``log_num_zeros_in_grad``)."""
        self.optimizer = torch.optim.AdamW(
            _param_groups(model_chunks, train),
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
        )
        self.clip_grad = train.clip_grad

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> tuple[bool, float | None]:
        for p in self.params:
            # megatron DDP accumulates into main_grad (fp32) and leaves .grad unset
            p.grad = getattr(p, "main_grad", p.grad)
        grad_norm = global_grad_norm(self.params)
        if self.log_num_zeros_in_grad:
            self.num_zeros_in_grad = count_zeros_in_grad(self.params)
        if not math.isfinite(grad_norm):
            return False, grad_norm
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            scale = self.clip_grad / (grad_norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        return True, grad_norm

    def _init_state(self) -> None:
        """Zero moments, so a fresh optimizer has tensors for a checkpoint to fill."""
        for p in self.params:
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded: dict, *, is_loading: bool = False) -> dict:
        """Adam moments as sharded tensors mirroring their parameters; the step as a scalar.

        Keys follow the parameters' global keys, so the state loads into any TP / PP layout.
        """
        if is_loading:
            self._init_state()
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError("optimizer steps differ between parameters; cannot checkpoint")
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        id_map = get_param_id_to_sharded_param_map(model_sharded, params)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["state"]["common_step"] = steps.pop() if steps else 0.0
        return state

    def reload_model_params(self) -> None:
        """Nothing to refresh after the weights alone were loaded: the parameters are the
        model's own."""

    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Put loaded moments back, keeping this run's own parameter groups."""
        step = torch.tensor(float(loaded["state"].pop("common_step")))
        current = self.optimizer.state_dict()
        for param_id, param_state in loaded["state"].items():
            current["state"][param_id] = {**param_state, "step": step.clone()}
        self.optimizer.load_state_dict(current)


class MegatronOptimizerAdapter:
    """megatron-core's optimizer, with ``step`` trimmed to ``(updated, grad_norm)``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.num_zeros_in_grad: int | None = None
        """Zeros of the last step's gradient (megatron counts them with log_num_zeros_in_grad)."""

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float | None]:
        updated, grad_norm, self.num_zeros_in_grad = self.optimizer.step()
        return updated, grad_norm

    def sharded_state_dict(self, model_sharded: dict, *, is_loading: bool = False) -> dict:
        return self.optimizer.sharded_state_dict(model_sharded, is_loading=is_loading)

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.optimizer.load_state_dict(loaded)

    def reload_model_params(self) -> None:
        """Copy freshly loaded weights into the fp32 main parameters (mixed precision), as
        Megatron-LM does after a load without the optimizer."""
        self.optimizer.reload_model_params()


def build_optimizer(
    *,
    model_chunks: list[torch.nn.Module],
    train: TrainConfig,
    bf16: bool,
    fp16: bool,
    log_num_zeros_in_grad: bool = False,
) -> TrainingOptimizer:
    """megatron's optimizer on CUDA, :class:`TorchAdamW` on CPU; both group the parameters by
    megatron-core's rules (weight-decay skips, --decoupled-lr). With ``log_num_zeros_in_grad``
    each step counts the gradient's zeros into ``optimizer.num_zeros_in_grad``."""
    if not on_gpu():
        return TorchAdamW(
            model_chunks=model_chunks, train=train, log_num_zeros_in_grad=log_num_zeros_in_grad
        )
    from megatron.core.optimizer import get_megatron_optimizer

    config = optimizer_config(train, bf16=bf16, fp16=fp16)
    config = dataclasses.replace(config, log_num_zeros_in_grad=log_num_zeros_in_grad)
    return MegatronOptimizerAdapter(get_megatron_optimizer(config, model_chunks))


@dataclass(frozen=True)
class ScheduleSteps:
    """Spans of the LR / weight-decay schedule in the scheduler's steps: optimizer steps, or
    samples for a sample-based run (--train-samples), whose scheduler the loop then steps by
    each step's global batch, as Megatron-LM does."""

    warmup: float
    """Linear warm-up (not whole with --lr-warmup-fraction)."""
    decay: int
    """Warm-up plus decay to --min-lr."""
    weight_decay: int
    """Span of the weight-decay increase: the whole run."""
    wsd_anneal: int | None
    """WSD's anneal at the end of the decay (None unless --lr-decay-style WSD)."""


def schedule_steps(train: TrainConfig) -> ScheduleSteps:
    """Megatron-LM's schedule spans (``get_optimizer_param_scheduler``). An iteration-based run
    counts optimizer steps where Megatron-LM counts step × global batch: at its constant batch,
    the same rate at every step."""
    if train.sample_based:
        length, warmup = train.train_samples, train.lr_warmup_samples
        decay, anneal = train.lr_decay_samples, train.lr_wsd_decay_samples
    else:
        length, warmup = train.train_iters, train.lr_warmup_iters
        decay, anneal = train.lr_decay_iters, train.lr_wsd_decay_iters
    decay = length if decay is None else decay
    if train.lr_warmup_fraction is not None:
        warmup = train.lr_warmup_fraction * decay
    else:  # a warm-up as long as the run (allowed) still needs a decay span after it
        decay = max(decay, warmup + 1)
    if train.lr_decay_style != "WSD":
        anneal = None
    return ScheduleSteps(warmup=warmup, decay=decay, weight_decay=length, wsd_anneal=anneal)


def build_lr_scheduler(
    *, optimizer: TrainingOptimizer, train: TrainConfig, schedule: str = "strict"
) -> OptimizerParamScheduler:
    """megatron-core's scheduler over :func:`schedule_steps`.

    ``schedule`` is whose schedule a checkpoint load keeps: ``flags``, ``checkpoint``, or
    ``strict`` (they must agree; ``memo_ext.training.checkpointing`` refuses them otherwise).
    """
    steps = schedule_steps(train)
    start_wd, end_wd = train.weight_decay_span
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,  # Megatron-LM's --lr-warmup-init default
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=steps.warmup,
        lr_decay_steps=steps.decay,
        lr_decay_style=train.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=steps.weight_decay,
        wd_incr_style=train.weight_decay_incr_style,
        override_opt_param_scheduler=schedule == "flags",
        use_checkpoint_opt_param_scheduler=schedule == "checkpoint",
        wsd_decay_steps=steps.wsd_anneal,
        lr_wsd_decay_style=train.lr_wsd_decay_style,
    )
