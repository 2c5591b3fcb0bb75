"""megatron-core's global micro-batch calculator for a run: constant, ramped up, or a step-wise
schedule (:func:`init_microbatches`), moved along as samples are consumed
(:func:`update_batch_ramp`).

megatron-core 0.16 knows a constant global batch and a linear ramp-up; Megatron-LM later added
``--step-batch-size-schedule "0:768 250B:1536 ..."`` (the batch jumps at token thresholds). This
module gives megatron-core's global calculator (``megatron.core.num_microbatches_calculator``,
read through its ``get_num_microbatches`` / ``get_current_global_batch_size`` functions by the
training loop) that schedule; the schedule's text form is parsed by
``memo_ext.config.train.parse_step_schedule``.
"""

from __future__ import annotations

from megatron.core import num_microbatches_calculator as calculators

from memo_ext.config.train import TrainConfig, batch_at


class StepBatchSizeCalculator(calculators.NumMicroBatchesCalculator):
    """megatron-core's calculator interface over a step schedule (tokens → global batch)."""

    def __init__(
        self,
        schedule: tuple[tuple[int, int], ...],
        *,
        seq_length: int,
        micro_batch_size: int,
        data_parallel_size: int,
    ):
        super().__init__()
        self.schedule, self.seq_length = schedule, seq_length
        self.micro_batch_size = micro_batch_size
        self.micro_batch_times_dp = micro_batch_size * data_parallel_size
        self.update(0, consistency_check=True)

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        batch = batch_at(self.schedule, consumed_samples, self.seq_length)
        if consistency_check and batch % self.micro_batch_times_dp:
            raise ValueError(
                f"global batch {batch} is not divisible by micro-batch × DP "
                f"{self.micro_batch_times_dp}"
            )
        self.current_global_batch_size = batch
        self.current_running_global_batch_size = batch
        self.num_micro_batches = max(1, batch // self.micro_batch_times_dp)


def install_step_schedule(calculator: StepBatchSizeCalculator) -> None:
    """Make ``calculator`` megatron-core's global one (what its getter functions read)."""
    calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator


def init_microbatches(
    train: TrainConfig, *, seq_length: int, rank: int, data_parallel_size: int
) -> None:
    """megatron-core's global calculator for ``train``'s batches: constant, ramped, or the step
    schedule (whose sizes are in tokens of ``seq_length``)."""
    calculators.init_num_microbatches_calculator(
        rank=rank,
        rampup_batch_size=train.rampup_batch_size,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        data_parallel_size=data_parallel_size,
    )
    if train.step_schedule is not None:
        install_step_schedule(
            StepBatchSizeCalculator(
                train.step_schedule,
                seq_length=seq_length,
                micro_batch_size=train.micro_batch_size,
                data_parallel_size=data_parallel_size,
            )
        )


def update_batch_ramp(consumed_samples: int, num_microbatches: int) -> bool:
    """Move megatron-core's calculator to the batch of ``consumed_samples`` (Megatron-LM's
    order: unchecked, then checked); True when the micro-batches per step changed."""
    calculators.update_num_microbatches(consumed_samples, consistency_check=False, verbose=True)
    changed = calculators.get_num_microbatches() != num_microbatches
    # every batch of the ramp splits into micro-batches × DP: TrainConfig checked START and INCR
    calculators.update_num_microbatches(consumed_samples, consistency_check=True)
    return changed
