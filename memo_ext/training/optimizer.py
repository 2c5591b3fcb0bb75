"""megatron-core's optimizer behind the loop's small interface, and its LR schedule.

The optimizer is megatron-core's on every machine: ``FP32Optimizer`` for fp32 weights,
``Float16OptimizerWithFloat16Params`` for --bf16 / --fp16 (fp32 master weights, the fp16 loss
scaler), ``DistributedOptimizer`` with --use-distributed-optimizer, each over megatron-core's
parameter groups (weight-decay skips, --decoupled-lr). On CPU it runs under
:func:`memo_ext.mcore.compat.cpu_compat`; its Adam is ``torch.optim.AdamW`` there (megatron-core's
choice without transformer-engine or apex), fused Adam on CUDA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core.optimizer import (
    DistributedOptimizer,
    OptimizerConfig,
    distrib_optimizer,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import (
    OptimizerParamScheduler,
    get_canonical_lr_for_logging,
)

from memo_ext.config import TrainConfig
from memo_ext.mcore.compat import fix_distributed_optimizer


class TrainingOptimizer(Protocol):
    """What the training loop needs from an optimizer."""

    param_groups: list[dict]

    def zero_grad(self) -> None: ...

    def step(self) -> tuple[bool, float | None]: ...

    def sharded_state_dict(
        self, model_sharded: dict, *, is_loading: bool = False, metadata: dict | None = None
    ) -> dict: ...

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


def lr_for_logging(param_groups: list[dict]) -> float:
    """The rate of the default groups (megatron-core's choice), not a decoupled one."""
    lr = get_canonical_lr_for_logging(param_groups)
    return param_groups[0]["lr"] if lr is None else lr


class MegatronOptimizerAdapter:
    """megatron-core's optimizer, with ``step`` trimmed to ``(updated, grad_norm)``; its zero
    count and loss scale are attributes the loop's reporting reads."""

    def __init__(self, optimizer, *, state_format: dict):
        self.optimizer = optimizer
        self.state_format = state_format
        """What its checkpointed state is laid out by (:func:`state_format`)."""
        self.num_zeros_in_grad: int | None = None
        """Zeros of the last step's gradient (megatron counts them with log_num_zeros_in_grad)."""

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float | None]:
        """``(updated, grad_norm)``: not updated, and no norm, when fp16 gradients overflowed
        (the scaler has lowered the scale then)."""
        updated, grad_norm, self.num_zeros_in_grad = self.optimizer.step()
        return updated, grad_norm

    @property
    def loss_scale(self) -> float:
        """The loss scale of the next step (1 without fp16)."""
        return float(self.optimizer.get_loss_scale().item())

    def sharded_state_dict(
        self, model_sharded: dict, *, is_loading: bool = False, metadata: dict | None = None
    ) -> dict:
        """megatron-core's sharded optimizer state; ``metadata`` its layout (the distributed
        optimizer's ``distrib_optim_sharding_type``, as Megatron-LM passes it)."""
        _fill_fresh_distributed_state(self.optimizer)
        return self.optimizer.sharded_state_dict(
            model_sharded, is_loading=is_loading, metadata=metadata
        )

    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Put a checkpoint's state in place. Outside autograd: megatron-core's
        dp_reshardable loader copies into the main parameters in place, which for fp32
        weights are views of the model's own (Megatron-LM runs it with bf16 weights, whose
        main parameters are separate fp32 copies)."""
        with torch.no_grad():
            self.optimizer.load_state_dict(loaded)

    def reload_model_params(self) -> None:
        """Copy freshly loaded weights into the fp32 main parameters (mixed precision), as
        Megatron-LM does after a load without the optimizer."""
        self.optimizer.reload_model_params()


def _fill_fresh_distributed_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet the Adam state of a fresh one.

    megatron-core 0.16's ``DistributedOptimizer.state_dict`` reads the step out of the torch
    optimizer's per-parameter state; with Apex's or transformer-engine's Adam it comes from the
    parameter groups instead. With torch's AdamW (megatron-core's Adam without them: every CPU
    run) an optimizer that has not stepped (a fresh one about to load a checkpoint, or fp16 runs
    whose every step so far overflowed) holds no state, and a save or load would find no step.
    The state torch's AdamW would create on its first step is created now: the same updates.
    """
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer) or inner.optimizer.state:
            continue
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                inner.optimizer.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def build_optimizer(
    *,
    model_chunks: list[torch.nn.Module],
    train: TrainConfig,
    bf16: bool,
    fp16: bool,
    log_num_zeros_in_grad: bool = False,
) -> TrainingOptimizer:
    """megatron-core's optimizer for these flags over ``model_chunks`` (megatron DDP modules).
    With ``log_num_zeros_in_grad`` each step counts the gradient's zeros into
    ``optimizer.num_zeros_in_grad``."""
    fix_distributed_optimizer()
    config = optimizer_config(train, bf16=bf16, fp16=fp16)
    config = dataclasses.replace(config, log_num_zeros_in_grad=log_num_zeros_in_grad)
    optimizer = get_megatron_optimizer(config, model_chunks)
    return MegatronOptimizerAdapter(optimizer, state_format=state_format(train, bf16, fp16))


def state_format(train: TrainConfig, bf16: bool, fp16: bool) -> dict:
    """The flags that decide how megatron-core's optimizer state is laid out: sharded over DP
    (flat main-weight and moment shards) or not, and fp32 main weights beside 16-bit ones or
    not; a checkpoint's state loads only into an optimizer of the same format."""
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    return {"distributed": train.use_distributed_optimizer, "precision": precision}


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
    ``strict`` (they must agree; ``memo_ext.training.checkpoint`` refuses them otherwise).
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
