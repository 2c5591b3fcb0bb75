"""``pretrain_gpt_memo.py`` that counts, on each rank after training, the bytes of the real
tensors behind its model state, for ``run_pretrain(..., module=...)``::

    --probe-state-bytes DIR   write DIR/rank_<r>.json: the model's weights, DDP's gradient
                              buffers, and the optimizer's main weights and Adam moments

Counted from storage the tensors own (padding of DDP's buckets included), not from any figure
the program computes, so the estimator's bytes-per-parameter rules can be checked against them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core.optimizer import DistributedOptimizer

from memo_ext.training import loop


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(model, optimizer) -> dict:
    """Bytes held by ``model`` (a megatron DDP module) and ``optimizer`` (the loop's)."""
    inner = optimizer.optimizer
    main, moments, distributed = [], [], False
    for opt in getattr(inner, "chained_optimizers", [inner]):
        distributed |= isinstance(opt, DistributedOptimizer)
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                main.append(param)
                state = opt.optimizer.state.get(param, {})
                moments += [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]
    weights = list(model.parameters())
    # without the distributed optimizer fp32 weights are their own main weights
    own = {id(p) for p in weights}
    main = [p for p in main if id(p) not in own]
    return {
        "parameters": sum(p.numel() for p in weights),
        "weights": _nbytes(weights),
        "grad_buffers": _nbytes(b.grad_data for b in model.buffers),
        "main_weights": _nbytes(main),
        "adam_moments": _nbytes(moments),
        "distributed": distributed,
    }


def main(argv: list[str]) -> int:
    from pretrain_gpt_memo import main as pretrain_main

    at = argv.index("--probe-state-bytes")
    out = Path(argv[at + 1])
    argv = argv[:at] + argv[at + 2 :]
    seen = {}
    build = loop.build_optimizer

    def build_and_keep(*, model_chunks, **kwargs):
        seen["model"] = model_chunks[0]
        seen["rank"] = dist.get_rank() if dist.is_initialized() else 0
        seen["optimizer"] = build(model_chunks=model_chunks, **kwargs)
        return seen["optimizer"]

    with mock.patch.object(loop, "build_optimizer", build_and_keep):
        status = pretrain_main(argv)
    if status == 0:
        with torch.no_grad():
            figures = state_bytes(seen["model"], seen["optimizer"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank_{seen['rank']}.json").write_text(json.dumps(figures))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
