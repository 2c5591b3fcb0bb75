"""A step-wise global batch schedule for megatron-core's micro-batch calculator.

megatron-core 0.16 knows a constant global batch and a linear ramp-up; Megatron-LM later added
``--step-batch-size-schedule "0:768 250B:1536 ..."`` (the batch jumps at token thresholds). This
module gives megatron-core's global calculator (``megatron.core.num_microbatches_calculator``,
read through its ``get_num_microbatches`` / ``get_current_global_batch_size`` functions by the
training loop) that schedule; the schedule's text form is parsed by
``memo_ext.config.train.parse_step_schedule``.
"""

from __future__ import annotations

from megatron.core import num_microbatches_calculator as calculators

from memo_ext.config.train import batch_at


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
