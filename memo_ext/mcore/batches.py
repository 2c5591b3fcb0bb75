"""A step-wise global batch schedule for megatron-core's micro-batch calculator.

megatron-core 0.16 knows a constant global batch and a linear ramp-up; Megatron-LM later added
``--step-batch-size-schedule "0:768 250B:1536 ..."`` (the batch jumps at token thresholds). This
module gives megatron-core's global calculator (``megatron.core.num_microbatches_calculator``,
read through its ``get_num_microbatches`` / ``get_current_global_batch_size`` functions by the
training loop) that schedule.
"""

from __future__ import annotations

import bisect

from megatron.core import num_microbatches_calculator as calculators

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
