"""The configuration every GPU run uses — bf16, megatron-core's distributed optimizer, bucketed
gradient reduction overlapped with the backward pass — trained on gloo with megatron-core's own
classes (its DDP, ``DistributedOptimizer``, mixed-precision optimizer and grad scaler).

bf16 rounds at 2**-9 relative (8 significand bits). What each comparison may differ by:

- MEMO against the same run without it: nothing. The recompute replays the same bf16 operations
  on the same inputs, and megatron-core's bucketed reduce-scatter adds the same gradients.
- The distributed optimizer with small buckets and overlap against a plain DP all-reduce: the
  loss not at all (the same weights); the gradient norm is summed over the DP shards in fp32
  (another order), rounding at 1e-6.
- TP + SP and CP against one process: a layer's output is a bf16 sum of partial products in
  another order, one bf16 rounding (2**-9) per element; over three steps the curves move by
  well under 1e-3 (2e-5 loss, 3e-4 grad norm measured), hence ``BF16_RTOL``.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import (
    SMALL_LLAMA,
    assert_same_curves,
    cli,
    reference_run,
    run_pretrain,
    train_fails,
)

pytestmark = pytest.mark.dist

LLAMA = SMALL_LLAMA + cli(num_layers=4)
COMMON = cli(
    micro_batch_size=2,
    global_batch_size=8,
    train_iters=4,
    lr="2e-3",
    lr_warmup_iters=1,
    lr_decay_style="cosine",
    weight_decay="0.1",
    mock_data=True,
    seed=5,
    hidden_dropout=0,
    attention_dropout=0,
)
GPU = cli(
    bf16=True,
    use_distributed_optimizer=True,
    overlap_grad_reduce=True,
    ddp_bucket_size=5000,  # a dozen buckets for this model's ~70k parameters per rank
)
BF16_RTOL = 1e-3
# fp32 sums of the same squares in another order (the distributed optimizer's shards)
NORM_RTOL = 1e-6


def assert_identical(reference: list[dict], other: list[dict], *, norm_rtol: float = 0.0):
    assert [r["iteration"] for r in reference] == [r["iteration"] for r in other]
    for a, b in zip(reference, other):
        assert b["loss"] == a["loss"], f"iteration {a['iteration']}: loss"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=norm_rtol, abs=0)


@pytest.fixture(scope="module")
def gpu_dp2(reference_runs):
    return reference_run(LLAMA + COMMON + GPU, nproc=2, cache_dir=reference_runs)


@pytest.fixture(scope="module")
def bf16_one_process(reference_runs):
    return reference_run(LLAMA + COMMON + ["--bf16"], nproc=1, cache_dir=reference_runs)


@pytest.mark.parametrize(
    "memo",
    [
        cli(memo=True, memo_alpha=0, memo_keep_last_layers=0),
        cli(memo=True, memo_alpha="0.5", memo_keep_last_layers=1),
        cli(memo=True, memo_alpha=1, memo_keep_last_layers=0, memo_allocator="plan"),
    ],
    ids=["alpha0", "alpha0.5", "alpha1-planned"],
)
def test_memo_is_bit_identical_in_the_gpu_configuration(gpu_dp2, memo, tmp_path):
    curves = run_pretrain(LLAMA + COMMON + GPU + memo, nproc=2, workdir=tmp_path, name="memo")
    assert_identical(gpu_dp2, curves)
    assert all(r["host_offload_bytes"] > 0 for r in curves)


def test_chunked_memo_in_the_gpu_configuration(gpu_dp2, tmp_path):
    # a chunk's rows may start off the CPU BLAS's row blocks: another kernel, another rounding
    memo = cli(memo=True, memo_alpha="0.5", memo_keep_last_layers=1, memo_chunk_tokens=7)
    curves = run_pretrain(LLAMA + COMMON + GPU + memo, nproc=2, workdir=tmp_path, name="chunk")
    assert_same_curves(gpu_dp2, curves, rtol=BF16_RTOL)
    assert all(r["memo_recomputed_tokens"] > 0 for r in curves)


def test_buckets_overlap_and_sharded_state_match_a_plain_all_reduce(gpu_dp2, tmp_path):
    plain = run_pretrain(LLAMA + COMMON + ["--bf16"], nproc=2, workdir=tmp_path, name="plain")
    assert_identical(plain, gpu_dp2, norm_rtol=NORM_RTOL)
    gather = run_pretrain(
        LLAMA + COMMON + GPU + ["--overlap-param-gather"], nproc=2, workdir=tmp_path, name="pg"
    )
    assert_identical(gpu_dp2, gather)


def test_dp2_matches_one_process_in_bf16(gpu_dp2, bf16_one_process):
    assert_identical(bf16_one_process, gpu_dp2, norm_rtol=NORM_RTOL)


@pytest.mark.parametrize(
    "layout",
    [
        cli(tensor_model_parallel_size=2, sequence_parallel=True),
        cli(context_parallel_size=2),
        cli(pipeline_model_parallel_size=2),
    ],
    ids=["tp2-sp", "cp2", "pp2"],
)
def test_model_parallel_layouts_match_one_process_in_bf16(bf16_one_process, layout, tmp_path):
    flags = LLAMA + COMMON + GPU + layout + ["--grad-reduce-in-bf16"]
    curves = run_pretrain(flags, nproc=2, workdir=tmp_path, name="layout")
    assert_same_curves(bf16_one_process, curves, rtol=BF16_RTOL)


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path):
    # 2**32, Megatron-LM's first scale, overflows fp16 gradients: with --hysteresis 2 the first
    # overflow keeps the scale, every further one halves it, until a step fits
    flags = LLAMA + COMMON + cli(fp16=True, use_distributed_optimizer=True, train_iters=30)
    records = run_pretrain(flags, nproc=2, workdir=tmp_path, name="fp16")
    scales = [r["loss_scale"] for r in records]
    skipped = [r["skipped_iterations"] for r in records]
    # a skipped step logs no gradient norm (megatron-core returns none for it)
    first_update = next(i for i, r in enumerate(records) if "grad_norm" in r)
    assert first_update > 1 and skipped[first_update] == first_update
    # record k: the scale after step k + 1 (the first overflow spent the hysteresis)
    assert scales[:first_update] == [2.0**32 / 2**k for k in range(first_update)]
    # a skipped step leaves the schedule where it was (Megatron-LM steps it on updates only)
    assert len({r["lr"] for r in records[: first_update + 1]}) == 1
    assert records[-1]["loss"] < records[0]["loss"]


def _stop_and_resume(tmp_path, first: list[str], second: list[str], nprocs=(2, 2)):
    save = tmp_path / "ckpt"
    head = run_pretrain(
        LLAMA + COMMON + first + ["--save", str(save), "--exit-interval", "2"],
        nproc=nprocs[0],
        workdir=tmp_path,
        name="head",
    )
    assert head[-1]["iteration"] == 2
    (tmp_path / "tail.jsonl").write_text((tmp_path / "head.jsonl").read_text())
    return save, run_pretrain(
        LLAMA + COMMON + second + ["--load", str(save)],
        nproc=nprocs[1],
        workdir=tmp_path,
        name="tail",
    )


def test_distributed_optimizer_resume_is_exact(gpu_dp2, tmp_path):
    save, curves = _stop_and_resume(tmp_path, GPU, GPU)
    assert_identical(gpu_dp2, curves)
    manifest = json.loads(next(save.glob("iter_*/manifest.json")).read_text())
    assert manifest["optimizer_format"] == {"distributed": True, "precision": "bf16"}


@pytest.mark.parametrize(
    "layout",
    [
        cli(tensor_model_parallel_size=2, sequence_parallel=True),
        cli(pipeline_model_parallel_size=2),
    ],
    ids=["to-tp2-sp", "to-pp2"],
)
def test_distributed_optimizer_state_reshards(gpu_dp2, layout, tmp_path):
    # saved under DP 2 (each rank a half of every bucket), resumed with the state regathered
    # for one DP rank of a model-parallel layout
    _, curves = _stop_and_resume(tmp_path, GPU, GPU + layout)
    assert_same_curves(gpu_dp2, curves, rtol=BF16_RTOL)


def test_distributed_optimizer_state_loads_into_one_process(bf16_one_process, tmp_path):
    distributed = cli(bf16=True, use_distributed_optimizer=True)
    _, curves = _stop_and_resume(tmp_path, GPU, distributed, nprocs=(2, 1))
    assert_identical(bf16_one_process, curves, norm_rtol=NORM_RTOL)


def test_fp16_resume_restores_the_loss_scale(tmp_path):
    # no overflow at 2**10 here; the scale doubles after every 2 good steps
    fp16 = cli(
        fp16=True, use_distributed_optimizer=True, initial_loss_scale=2**10, loss_scale_window=2
    )
    whole = run_pretrain(LLAMA + COMMON + fp16, nproc=2, workdir=tmp_path, name="whole")
    _, curves = _stop_and_resume(tmp_path, fp16, fp16)
    assert_identical(whole, curves)
    assert [r["loss_scale"] for r in curves] == [r["loss_scale"] for r in whole]
    assert len({r["loss_scale"] for r in whole}) > 1  # the scale moved, and was restored


def test_another_optimizer_format_is_refused_by_its_flags(tmp_path):
    save = tmp_path / "ckpt"
    run_pretrain(
        LLAMA + COMMON + GPU + ["--save", str(save), "--exit-interval", "1"],
        nproc=2,
        workdir=tmp_path,
        name="head",
    )
    message = train_fails(LLAMA + COMMON + ["--bf16", "--load", str(save)], status=2)
    assert "saved by --use-distributed-optimizer --bf16" in message
    assert "this run's optimizer is --bf16" in message


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "replicated"])
def test_model_state_bytes_are_the_estimators(distributed, tmp_path):
    # the estimator's rule (cost_model.model_state_bytes): bf16 weights 2, fp32 gradient
    # buffers 4, fp32 main weights and two Adam moments 12 bytes per parameter, the 12 split
    # over DP by the distributed optimizer; here counted from the tensors a bf16 run holds
    from memo_ext.estimate.cost_model import Batch, model_state_bytes
    from memo_ext.parallel import ParallelLayout

    flags = LLAMA + COMMON + cli(bf16=True, train_iters=1)
    flags += ["--use-distributed-optimizer"] if distributed else []
    out = tmp_path / "bytes"
    run_pretrain(
        flags + ["--probe-state-bytes", str(out)],
        nproc=2,
        workdir=tmp_path,
        name="bytes",
        module="tests.dist.state_bytes_probe",
    )
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    layout = ParallelLayout(dp=2)
    for held in ranks:
        params = held["parameters"]
        assert held["distributed"] == distributed
        assert held["weights"] == 2 * params
        # DDP pads the buffer (each parameter's start with the distributed optimizer, each
        # bucket's end to a multiple of DP): 336 elements on this model's 83,760, 0.4 %
        assert 4 * params <= held["grad_buffers"] <= 4 * params * 1.01
        total = sum(held[k] for k in ("weights", "grad_buffers", "main_weights", "adam_moments"))
        estimate = model_state_bytes(params, layout, Batch(distributed_optimizer=distributed))
        assert total == pytest.approx(estimate, rel=1e-2)
    optimizer = [r["main_weights"] + r["adam_moments"] for r in ranks]
    if distributed:  # the two shards together hold every parameter's 12 bytes once
        assert sum(optimizer) == pytest.approx(12 * ranks[0]["parameters"], rel=1e-2)
    else:
        assert optimizer == [12 * r["parameters"] for r in ranks]
