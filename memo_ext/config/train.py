"""The training section: batches, schedule, optimizer, precision, loss checks, and the
step-wise batch schedule's text form."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

from memo_ext.config.common import at_least
from memo_ext.errors import UsageError

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """``"0:768 250B:1536"`` → ``((0, 768), (250_000_000_000, 1536))``: (tokens, global batch).

    Raises:
        ValueError: with the sentence to show (entries, suffixes, order, positive batches).
    """
    entries = []
    for item in text.replace(",", " ").split():
        threshold, sep, batch = item.partition(":")
        if not sep:
            raise ValueError(f"entry {item!r} is not THRESHOLD:BATCH")
        scale = SUFFIXES.get(threshold[-1:].upper(), 1)
        number = threshold[:-1] if scale != 1 else threshold
        try:
            tokens, size = round(float(number) * scale), int(batch)
        except ValueError:
            raise ValueError(f"entry {item!r} is not THRESHOLD:BATCH with numbers") from None
        if tokens < 0 or size < 1:
            raise ValueError(f"entry {item!r} needs a threshold >= 0 and a batch >= 1")
        entries.append((tokens, size))
    if not entries or entries[0][0] != 0:
        raise ValueError("the first threshold must be 0 (the batch the run starts with)")
    if any(b[0] <= a[0] for a, b in zip(entries, entries[1:])):
        raise ValueError("thresholds must increase")
    return tuple(entries)


def batch_at(schedule: tuple[tuple[int, int], ...], consumed_samples: int, seq_length: int) -> int:
    """The global batch of a step that starts after ``consumed_samples`` samples."""
    tokens = consumed_samples * seq_length
    k = bisect.bisect_right([threshold for threshold, _ in schedule], tokens) - 1
    return schedule[k][1]


def sample_based_steps(
    *,
    train_samples: int,
    global_batch_size: int,
    rampup_batch_size: tuple[int, ...] | None,
    step_schedule: tuple[tuple[int, int], ...] | None = None,
    seq_length: int = 1,
) -> tuple[int, int]:
    """(optimizer steps, samples they consume) of a run of ``train_samples`` samples, counted as
    Megatron-LM's ``update_train_iters`` counts them.

    Without a ramp-up: whole global batches, the last partial one dropped. With one (START INCR
    SAMPLES): while at most SAMPLES and at most ``train_samples`` samples are consumed, each step
    takes the batch megatron-core's ramp-up calculator gives for the samples consumed so far
    (the last of these steps may pass ``train_samples``); then whole full batches. With a step
    schedule (tokens → batch): each step takes the batch of the tokens consumed before it, as
    long as it fits in ``train_samples``.
    """
    if step_schedule is not None:
        steps = consumed = 0
        while consumed + (batch := batch_at(step_schedule, consumed, seq_length)) <= train_samples:
            steps, consumed = steps + 1, consumed + batch
        return steps, consumed
    if rampup_batch_size is None:
        steps = train_samples // global_batch_size
        return steps, steps * global_batch_size
    # megatron-core's own ramp, imported here: parsing flags imports no megatron-core
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    start, increment, ramp_samples = rampup_batch_size
    ramp = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=global_batch_size,
        micro_batch_size=1,  # the batch sizes do not depend on the split; nothing is checked
        data_parallel_size=1,
        decrease_batch_size_if_needed=False,
        rank=-1,  # a dry run: no log lines
        start_global_batch_size=start,
        batch_size_increment=increment,
        ramup_samples=ramp_samples,
    )
    steps = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        ramp.update(consumed, consistency_check=False)
        consumed += ramp.get_current_global_batch_size()
        steps += 1
    if train_samples > consumed:
        full = (train_samples - consumed) // global_batch_size
        steps, consumed = steps + full, consumed + full * global_batch_size
    return steps, consumed


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation schedule, batch sizes and precision."""

    micro_batch_size: int
    """Sequences per forward/backward pass on each DP rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all DP ranks; mbs × DP if unset."""
    rampup_batch_size: tuple[int, ...] | None = field(default=None, metadata={"metavar": "N"})
    """START INCR SAMPLES: start at a global batch of START sequences and grow it by INCR in equal
    shares of the first SAMPLES samples up to --global-batch-size (Megatron-LM's ramp-up; needs
    --train-samples; START and INCR multiples of --micro-batch-size × DP)."""
    step_batch_size_schedule: str | None = None
    """"TOKENS:BATCH ...", e.g. "0:768 250B:1536": the global batch steps up once the tokens
    trained reach each threshold (K, M, B, T suffixes; the first threshold 0); needs
    --train-samples, and --global-batch-size is the largest batch (Megatron-LM's step
    schedule)."""
    train_iters: int | None = None
    """Optimizer steps; give this or --train-samples."""
    train_samples: int | None = None
    """Samples to train on, instead of --train-iters: the steps are derived (a last partial batch
    dropped, --rampup-batch-size's smaller batches counted) and the LR and weight-decay schedules
    count samples (--lr-warmup-samples, --lr-decay-samples, --lr-wsd-decay-samples)."""
    lr: float
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """LR decay after warm-up (megatron-core's scheduler); WSD holds --lr and anneals to --min-lr
    over the last --lr-wsd-decay-iters / --lr-wsd-decay-samples of the decay span."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Shape of WSD's anneal (--lr-decay-style WSD)."""
    lr_warmup_fraction: float | None = None
    """Warm-up as this fraction of the decay span (--lr-decay-iters / --lr-decay-samples), in
    [0, 1); instead of --lr-warmup-iters / --lr-warmup-samples."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps from 0 to --lr."""
    lr_warmup_samples: int = 0
    """Linear warm-up samples from 0 to --lr (with --train-samples)."""
    lr_decay_iters: int | None = None
    """Steps over which the rate decays to --min-lr, warm-up included; --train-iters if unset."""
    lr_decay_samples: int | None = None
    """Samples over which the rate decays to --min-lr, warm-up included (with --train-samples);
    --train-samples if unset."""
    lr_wsd_decay_iters: int | None = None
    """Steps of WSD's anneal, at the end of the decay span."""
    lr_wsd_decay_samples: int | None = None
    """Samples of WSD's anneal, at the end of the decay span (with --train-samples)."""
    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding and output layer weights, on the same schedule
    (megatron-core's decoupled LR)."""
    decoupled_min_lr: float | None = None
    """Learning rate at the end of the decay for the embedding and output layer (needs
    --decoupled-lr; --min-lr if unset)."""
    weight_decay: float = 0.01
    """AdamW weight decay (not on biases and norms)."""
    start_weight_decay: float | None = None
    """Weight decay at the start of training (--weight-decay-incr-style linear / cosine)."""
    end_weight_decay: float | None = None
    """Weight decay at the end of training (--weight-decay-incr-style linear / cosine)."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How the weight decay grows from --start-weight-decay to --end-weight-decay over the
    training span (constant: --weight-decay throughout)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global-norm clip; 0 = off."""
    seed: int = 1234
    """Seed for weights, dropout and data order."""
    check_for_nan_in_loss_and_grad: bool = field(default=True, metadata={"negatable": True})
    """Stop, pointing at the last good checkpoint, on a non-finite loss or grad norm."""
    skip_iterations_with_nan: bool = False
    """Skip the update of a step with a non-finite loss or grad norm instead of stopping."""
    bf16: bool = False
    """bf16 weights and activations, fp32 master weights in megatron's mixed-precision optimizer
    (on CPU too, through its bf16 kernels: slower than fp32 there)."""
    fp16: bool = False
    """fp16 weights and activations with loss scaling (dynamic unless --loss-scale): a step whose
    gradients overflow is skipped and the scale lowered, as Megatron-LM does."""
    loss_scale: float | None = None
    """--fp16: a fixed loss scale (a power of 2); dynamic loss scaling if unset."""
    initial_loss_scale: float = 2.0**32
    """--fp16, dynamic scaling: the first loss scale."""
    min_loss_scale: float = 1.0
    """--fp16, dynamic scaling: the scale never drops below this."""
    loss_scale_window: float = 1000
    """--fp16, dynamic scaling: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """--fp16, dynamic scaling: overflowing steps tolerated before the scale halves."""
    use_distributed_optimizer: bool = field(default=False, metadata={"negatable": True})
    """Shard the fp32 master weights and Adam moments over the DP ranks (megatron-core's
    distributed optimizer): gradients are reduce-scattered, updated shards all-gathered."""
    iters_from_samples: bool = field(default=False, metadata={"cli": False})
    """``train_iters`` was derived from --train-samples (:meth:`with_derived_iters`), not given."""
    seq_length_for_schedule: int = field(default=1, metadata={"cli": False})
    """--seq-length, which turns --step-batch-size-schedule's token thresholds into samples."""

    def check(self) -> None:
        """The flags as given (and a config whose ``train_iters`` :meth:`with_derived_iters`
        filled in)."""
        at_least(self.micro_batch_size, 1, "--micro-batch-size")
        at_least(self.global_batch_size, 1, "--global-batch-size")
        self._check_training_length()
        self._check_rampup()
        self._check_step_schedule()
        self._check_optimizer()
        self._check_loss_scale()
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 are exclusive; choose one")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise UsageError(
                f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={self.lr} min-lr={self.min_lr}"
            )
        self._check_lr_schedule()
        self._check_weight_decay_schedule()
        self._check_decoupled_lr()
        if self.clip_grad < 0:
            raise UsageError(
                f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}"
            )
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32) (numpy's range), got {self.seed}")

    def _check_loss_scale(self) -> None:
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise UsageError(f"--loss-scale must be positive, got {self.loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise UsageError(
                f"need 0 < --min-loss-scale <= --initial-loss-scale, got {self.min_loss_scale} "
                f"and {self.initial_loss_scale}"
            )
        at_least(self.hysteresis, 1, "--hysteresis")
        if not self.loss_scale_window >= 1:
            raise UsageError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")

    def _check_optimizer(self) -> None:
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= value < 1.0:
                raise UsageError(f"{flag} must be in [0, 1), got {value}")
        if not self.adam_eps > 0:
            raise UsageError(f"--adam-eps must be positive, got {self.adam_eps}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")

    @property
    def sample_based(self) -> bool:
        """Training length and LR / weight-decay spans counted in samples (--train-samples)."""
        return self.train_samples is not None

    def _check_training_length(self) -> None:
        """Exactly one of --train-iters / --train-samples, and no flag that counts the other
        unit (Megatron-LM asserts the same)."""
        iters_given = self.train_iters is not None and not self.iters_from_samples
        if iters_given == self.sample_based:
            raise UsageError(
                "give exactly one of --train-iters (optimizer steps) or --train-samples "
                "(samples to train on)"
            )
        at_least(self.train_iters, 1, "--train-iters")
        at_least(self.train_samples, 1, "--train-samples")
        if self.sample_based:
            mixed = {
                "--lr-warmup-iters": self.lr_warmup_iters != 0,
                "--lr-decay-iters": self.lr_decay_iters is not None,
                "--lr-wsd-decay-iters": self.lr_wsd_decay_iters is not None,
            }
            counted, wanted = "optimizer steps", "with --train-samples give the -samples flags"
        else:
            mixed = {
                "--lr-warmup-samples": self.lr_warmup_samples != 0,
                "--lr-decay-samples": self.lr_decay_samples is not None,
                "--lr-wsd-decay-samples": self.lr_wsd_decay_samples is not None,
                "--rampup-batch-size": self.rampup_batch_size is not None,
                "--step-batch-size-schedule": self.step_batch_size_schedule is not None,
            }
            counted, wanted = "samples", "they need --train-samples instead of --train-iters"
        given = [flag for flag, present in mixed.items() if present]
        if given:
            raise UsageError(f"{', '.join(given)} count {counted}: {wanted}")
        gbs = self.global_batch_size
        ramp = self.rampup_batch_size
        if self.sample_based and ramp is None and gbs and self.train_samples < gbs:
            raise UsageError(
                f"--train-samples {self.train_samples} is less than one global batch ({gbs}): "
                "no optimizer step would run"
            )

    @property
    def step_schedule(self) -> tuple[tuple[int, int], ...] | None:
        """--step-batch-size-schedule as (tokens, global batch) pairs."""
        if self.step_batch_size_schedule is None:
            return None
        try:
            return parse_step_schedule(self.step_batch_size_schedule)
        except ValueError as err:
            raise UsageError(f"--step-batch-size-schedule: {err}") from None

    def _check_step_schedule(self) -> None:
        schedule = self.step_schedule
        if schedule is None:
            return
        if self.rampup_batch_size is not None:
            raise UsageError(
                "--step-batch-size-schedule and --rampup-batch-size both set the batch of each "
                "step; give one"
            )
        largest = max(batch for _, batch in schedule)
        if self.global_batch_size is not None and self.global_batch_size != largest:
            raise UsageError(
                f"--global-batch-size {self.global_batch_size} differs from the largest batch "
                f"of --step-batch-size-schedule ({largest}); drop --global-batch-size"
            )

    def _check_rampup(self) -> None:
        """Megatron-LM's ramp-up rules; divisibility by micro-batch × DP is the run's
        (:meth:`RunConfig._check_batch`)."""
        ramp = self.rampup_batch_size
        if ramp is None:
            return
        if len(ramp) != 3 or min(ramp) < 1:
            raise UsageError(
                "--rampup-batch-size takes three positive numbers, START INCR SAMPLES, got "
                f"{' '.join(map(str, ramp)) or 'none'}"
            )
        start, incr, _ = ramp
        gbs = self.global_batch_size
        if gbs is not None and (start >= gbs or (gbs - start) % incr):
            raise UsageError(
                f"--rampup-batch-size must climb from START {start} to --global-batch-size {gbs} "
                f"in whole steps of INCR {incr}: START below it and {gbs} - {start} a multiple "
                f"of {incr}"
            )

    def _check_lr_schedule(self) -> None:
        unit = "samples" if self.sample_based else "iters"
        warmup = self.lr_warmup_samples if self.sample_based else self.lr_warmup_iters
        decay = self.lr_decay_samples if self.sample_based else self.lr_decay_iters
        length = self.train_samples if self.sample_based else self.train_iters
        if warmup < 0 or warmup > length:
            raise UsageError(f"--lr-warmup-{unit} {warmup} must be in [0, --train-{unit}]")
        if decay is not None and decay <= warmup:
            raise UsageError(
                f"--lr-decay-{unit} {decay} must be larger than --lr-warmup-{unit} {warmup} "
                "(the decay starts after the warm-up)"
            )
        if self.lr_warmup_fraction is not None:
            if warmup:
                raise UsageError(
                    f"--lr-warmup-fraction and --lr-warmup-{unit} are exclusive; give one"
                )
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise UsageError(
                    "--lr-warmup-fraction must be in [0, 1) (a share of the decay span), got "
                    f"{self.lr_warmup_fraction}"
                )
        anneal = self.lr_wsd_decay_samples if self.sample_based else self.lr_wsd_decay_iters
        if self.lr_decay_style != "WSD":
            if anneal is not None or self.lr_wsd_decay_style != "exponential":
                raise UsageError(
                    "--lr-wsd-decay-style / --lr-wsd-decay-iters / --lr-wsd-decay-samples apply "
                    "only with --lr-decay-style WSD"
                )
        elif anneal is None or anneal < 0:
            raise UsageError(
                f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} >= 0, the length of its "
                f"anneal to --min-lr (got {anneal})"
            )
        else:
            span = decay if decay is not None else length
            if self.lr_warmup_fraction is not None:
                warmup = self.lr_warmup_fraction * span
            if anneal > span - warmup:
                raise UsageError(
                    f"--lr-wsd-decay-{unit} {anneal} is longer than the decay span after the "
                    f"warm-up ({span - warmup:g} {unit}: --lr-decay-{unit}, else --train-{unit}, "
                    f"less the warm-up); shorten the anneal or lengthen the decay"
                )

    def _check_weight_decay_schedule(self) -> None:
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            if ends != (None, None):
                raise UsageError(
                    "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style "
                    "linear or cosine (the constant style uses --weight-decay)"
                )
            return
        start, end = ends
        if start is None or end is None:
            raise UsageError(
                f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                "--start-weight-decay and --end-weight-decay"
            )
        if not 0 <= start <= end:
            raise UsageError(
                "need 0 <= --start-weight-decay <= --end-weight-decay (megatron-core's schedule "
                f"only increases it), got {start} and {end}"
            )

    def _check_decoupled_lr(self) -> None:
        if self.decoupled_lr is None:
            if self.decoupled_min_lr is not None:
                raise UsageError("--decoupled-min-lr applies only with --decoupled-lr; add it")
            return
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if not 0 <= low <= self.decoupled_lr:
            raise UsageError(
                "need 0 <= --decoupled-min-lr <= --decoupled-lr (--decoupled-min-lr defaults to "
                f"--min-lr), got decoupled-lr={self.decoupled_lr} decoupled-min-lr={low}"
            )

    @property
    def weight_decay_span(self) -> tuple[float, float]:
        """(start, end) of the weight-decay schedule: --weight-decay twice when constant."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        return self.start_weight_decay, self.end_weight_decay

    def with_derived_iters(self) -> TrainConfig:
        """This config with ``train_iters`` derived from --train-samples
        (:func:`sample_based_steps`); an iteration-based one unchanged. Call it after
        :meth:`check`."""
        if not self.sample_based or self.iters_from_samples:
            return self
        steps, _ = self._sample_based_steps()
        return dataclasses.replace(self, train_iters=steps, iters_from_samples=True)

    @property
    def total_train_samples(self) -> int:
        """Training samples the data must supply: --train-iters × the global batch, or
        --train-samples and at least what the derived steps consume (a ramp-up's last step may
        pass it)."""
        if not self.sample_based:
            return self.train_iters * self.global_batch_size
        return max(self.train_samples, self._sample_based_steps()[1])

    def _sample_based_steps(self) -> tuple[int, int]:
        return sample_based_steps(
            train_samples=self.train_samples,
            global_batch_size=self.global_batch_size,
            rampup_batch_size=self.rampup_batch_size,
            step_schedule=self.step_schedule,
            seq_length=self.seq_length_for_schedule,
        )

    @property
    def params_dtype(self) -> torch.dtype:
        import torch  # not at module level: the flags are parsed before torch loads

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32
