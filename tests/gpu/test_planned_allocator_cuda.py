"""--memo --memo-allocator plan on a GPU against --memo alone. Skipped without CUDA.

The pluggable allocator is process-wide and must be installed before CUDA is initialised, so
each run is its own ``pretrain_gpt_memo.py`` process. Checked: losses within 1e-6, hit ratio
≥ 0.99 from iteration 3 with no overlap misses, the arena equal to the largest plan's peak, and
arena + caching-path peak below the caching allocator's reserved peak of the same run. Step
times are printed (``scripts/gpu_check.sh`` keeps them), not asserted.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch import cli, launch_pretrain, unserved_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = cli(
    num_layers=6,
    hidden_size=1024,
    num_attention_heads=16,
    seq_length=8192,
    micro_batch_size=1,
    global_batch_size=1,
    train_iters=8,
    lr="1e-4",
    mock_data=True,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    attention_backend="sdpa",
    memo=True,
    memo_alpha=0.5,
)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_planned_allocator_on_cuda(tmp_path):
    cache = tmp_path / "plans"
    plain = launch_pretrain(MODEL, nproc=1, workdir=tmp_path, name="plain")
    planned = launch_pretrain(
        [*MODEL, "--memo-allocator", "plan", "--memo-plan-cache", str(cache)],
        nproc=1,
        workdir=tmp_path,
        name="planned",
    )
    for a, b in zip(plain, planned, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["iteration"]
    served = [r for r in planned if r["iteration"] >= 3]
    assert served and unserved_steps(planned) == []
    peaks = [json.loads(p.read_text())["peak_bytes"] for p in cache.glob("*-rank0.json")]
    assert {r["plan_arena_bytes"] for r in served} == {max(peaks)}
    caching_reserved = max(r["mem_reserved_bytes"] for r in plain if r["iteration"] >= 3)
    planned_peak = max(r["mem_allocated_bytes"] for r in served)
    assert planned_peak < caching_reserved
    share = sum(r["plan_hit_bytes"] for r in served) / sum(
        r["plan_hit_bytes"] + r["plan_unplanned_bytes"] for r in served
    )
    step_plain = _median([r["step_time_s"] for r in plain if r["iteration"] >= 3])
    step_planned = _median([r["step_time_s"] for r in served])
    print(
        f"planned allocator: pass bytes from the plan {share:.3f}, arena {max(peaks)} B, "
        f"arena + caching path peak {planned_peak} B vs caching reserved {caching_reserved} B, "
        f"step {step_planned * 1e3:.1f} ms vs {step_plain * 1e3:.1f} ms "
        f"({step_planned / step_plain - 1:+.1%})"
    )
