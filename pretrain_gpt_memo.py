"""GPT pretraining on megatron-core with MEMO and HotSPa.

Launch with torchrun and Megatron-style flags, for example on 2 CPU processes::

    torchrun --nproc-per-node 2 pretrain_gpt_memo.py \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
        --micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 1e-3 \
        --tensor-model-parallel-size 2 --sequence-parallel --mock-data \
        --metrics-file runs/example/metrics.jsonl

``python pretrain_gpt_memo.py --help`` lists every flag.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings

# megatron-core announces at import that optional fused kernels (apex / TE) are absent; the
# local paths it falls back to are the ones this project uses on CPU
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
warnings.filterwarnings("ignore", message=r".*tp_group is None, using default tp group")
# the estimator's traced configs (HotSPa auto, preflight) trip a cosmetic megatron deprecation
warnings.filterwarnings("ignore", message=r"full scope is deprecated")

from memo_ext.arguments import parse_args  # noqa: E402
from memo_ext.errors import ReportedError, out_of_memory  # noqa: E402
from memo_ext.training.loop import train  # noqa: E402


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"[rank {rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    # megatron-core logs every dataset config and index build at INFO
    logging.getLogger("megatron").setLevel(logging.WARNING)


def _tell_torchrun(message: str) -> None:
    """Under torchrun, put the sentence in the failure summary torchrun prints last (its error
    file, read as a plain message) instead of its "To enable traceback see ..." line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        # the layout torch's own error handler writes: torchrun shows "py_callstack" and can
        # record the exit code in it
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)


def _train_reporting_oom(argv: list[str] | None):
    """Train; an allocator's out-of-memory error becomes :class:`OutOfMemory` (one sentence with
    the bytes asked for, exit status 3): too big for this machine is a result, not a bug."""
    run = parse_args(argv)
    try:
        return train(run)
    except ReportedError:
        raise
    except Exception as err:  # noqa: BLE001 - an allocation failure, however a library wraps it
        oom = out_of_memory(err, capped=run.preflight.memory_limit_gb is not None)
        if oom is None:
            raise
        raise oom from None


def main(argv: list[str] | None = None) -> int:
    _configure_logging()
    try:
        summary = _train_reporting_oom(argv)
    except ReportedError as err:  # bad input (2), out of memory (3), a failure it explains (1)
        print(f"pretrain_gpt_memo.py: error: {err}", file=sys.stderr)
        _tell_torchrun(str(err))
        return err.exit_status
    if int(os.environ.get("RANK", "0")) == 0 and summary.losses:
        logging.getLogger("pretrain_gpt_memo").info(
            "done: %d iterations, loss %.4f -> %.4f, %.0f tokens/s (median)",
            summary.iterations,
            summary.first_loss,
            summary.last_loss,
            sorted(summary.tokens_per_s)[len(summary.tokens_per_s) // 2],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
