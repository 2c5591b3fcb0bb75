"""Optimizers behind one small interface, and megatron-core's LR schedule.

On CUDA the optimizer is megatron-core's (mixed precision, fp32 master weights, optionally the
distributed optimizer). megatron's optimizers require CUDA tensors, so on CPU the same contract
is served by ``torch.optim.AdamW`` over the fp32 parameters with a model-parallel-aware global
gradient norm and clipping (:class:`TorchAdamW`). Both expose ``zero_grad``, ``step`` →
``(updated, grad_norm)`` and ``param_groups`` (read by ``OptimizerParamScheduler``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from memo_ext.config import TrainConfig


class TrainingOptimizer(Protocol):
    """What the training loop needs from an optimizer."""

    param_groups: list[dict]

    def zero_grad(self) -> None: ...

    def step(self) -> tuple[bool, float | None]: ...

    def sharded_state_dict(self, model_sharded: dict, *, is_loading: bool = False) -> dict: ...

    def load_sharded_state_dict(self, loaded: dict) -> None: ...


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default: biases and 1-D parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def _param_groups(model_chunks: Iterable[torch.nn.Module]) -> list[dict]:
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                (no_decay if _no_weight_decay(name, param) else decay).append(param)
    return [
        {"params": decay, "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False},
        {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "is_decoupled_lr": False},
    ]


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of the whole model's gradient, counting each logical element once.

    Tensor-parallel shards all count; TP-replicated parameters count on TP rank 0 only; the
    copy of a tied embedding on the last pipeline stage is skipped. Squares are summed over the
    model-parallel group (TP × PP); data-parallel replicas already hold reduced gradients.
    """
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None or not param_is_not_shared(p):
            continue
        if param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().double().pow(2).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return math.sqrt(total.item())


class TorchAdamW:
    """``torch.optim.AdamW`` over fp32 parameters whose gradients live in DDP's ``main_grad``."""

    def __init__(self, *, model_chunks: list[torch.nn.Module], train: TrainConfig):
        self.params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            _param_groups(model_chunks),
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

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float | None]:
        updated, grad_norm, _ = self.optimizer.step()
        return updated, grad_norm

    def sharded_state_dict(self, model_sharded: dict, *, is_loading: bool = False) -> dict:
        return self.optimizer.sharded_state_dict(model_sharded, is_loading=is_loading)

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.optimizer.load_state_dict(loaded)


def build_optimizer(
    *, model_chunks: list[torch.nn.Module], train: TrainConfig, bf16: bool, fp16: bool
) -> TrainingOptimizer:
    """megatron's optimizer on CUDA, :class:`TorchAdamW` on CPU."""
    if not torch.cuda.is_available():
        return TorchAdamW(model_chunks=model_chunks, train=train)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=bf16,
        fp16=fp16,
        use_distributed_optimizer=train.use_distributed_optimizer,
    )
    return MegatronOptimizerAdapter(get_megatron_optimizer(config, model_chunks))


def build_lr_scheduler(
    *, optimizer: TrainingOptimizer, train: TrainConfig, schedule: str = "strict"
) -> OptimizerParamScheduler:
    """megatron-core's scheduler, stepping once per optimizer step.

    ``schedule`` is whose schedule a checkpoint load keeps: ``flags``, ``checkpoint``, or
    ``strict`` (they must agree; ``memo_ext.training.checkpointing`` refuses them otherwise).
    """
    decay_iters = train.lr_decay_iters or train.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if train.lr_warmup_iters else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, train.lr_warmup_iters + 1),
        lr_decay_style=train.lr_decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=max(train.train_iters, 1),
        wd_incr_style="constant",
        override_opt_param_scheduler=schedule == "flags",
        use_checkpoint_opt_param_scheduler=schedule == "checkpoint",
    )
