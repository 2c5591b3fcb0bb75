"""Starting from a pretrained model: --finetune, --pretrained-checkpoint, --no-load-optim,
--no-load-rng, --no-save-optim, and Megatron-LM's own torch_dist checkpoints.

What a load left is read back by ``tests.dist.checkpoint_probe`` (each rank's weights and Adam
moments with their places in the global tensors, the returned progress, the LR schedule, the RNG
state) and compared with the checkpoint's tensors as torch's own reader reads them, which
involves neither megatron-core nor the trainer's loader.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from memo_ext.training.metrics import read_metrics
from tests.dist.checkpoint_probe import read_checkpoint_tensors, read_records
from tests.dist.test_checkpoint import MODEL
from tests.launch import cli, reference_run, run_job, run_pretrain, train_fails

pytestmark = pytest.mark.dist

PROBE = "tests.dist.checkpoint_probe"
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
ITERS = ["--train-iters", "6"]


def probed(args: list[str], *, nproc: int, workdir: Path, name: str) -> tuple[list, list]:
    """(metrics records, every rank's probe record) of a run of ``args``."""
    dump = workdir / f"{name}.probe"
    records = run_pretrain(
        [*args, "--probe-dump", str(dump)], nproc=nproc, workdir=workdir, name=name, module=PROBE
    )
    return records, read_records(dump)


def assert_loaded(probes: list[dict], stored: dict[str, torch.Tensor], part: str) -> int:
    """Every rank's ``part`` (weights or moments) equals, bit for bit, its slice of the stored
    global tensors; the number of keys compared."""
    compared = set()
    for record in probes:
        for key, pieces in record[part].items():
            for where, values in pieces:
                assert torch.equal(stored[key][where], values), f"{key} differs at {where}"
            compared.add(key)
    return len(compared)


def model_keys(stored: dict) -> set[str]:
    return {key for key in stored if not key.startswith("optimizer.")}


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory) -> Path:
    """Two steps of ``MODEL`` under TP 2 with sequence parallelism, saved."""
    workdir = tmp_path_factory.mktemp("tp2")
    save = workdir / "ckpt"
    run_pretrain(
        [*MODEL, *ITERS, *TP2, "--exit-interval", "2", "--save", str(save)],
        nproc=2,
        workdir=workdir,
        name="save",
    )
    return save


@pytest.mark.parametrize(
    ("nproc", "layout"), [(1, []), (2, PP2), (2, CP2)], ids=["tp1", "pp2", "cp2"]
)
def test_finetune_loads_the_weights_alone_into_another_layout(
    tp2_checkpoint, tmp_path, reference_runs, nproc, layout
):
    fresh = reference_run(MODEL + ITERS, nproc=1, cache_dir=reference_runs)
    args = [*MODEL, *ITERS, *layout, "--load", str(tp2_checkpoint), "--finetune"]
    records, probes = probed(args, nproc=nproc, workdir=tmp_path, name="finetuned")
    stored = read_checkpoint_tensors(tp2_checkpoint / "iter_0000002")
    assert assert_loaded(probes, stored, "weights") == len(model_keys(stored))
    for probe in probes:
        assert probe["progress"] == (0, 0)
        assert probe["optimizer_states"] == 0 and probe["moments"] == {}  # fresh moments
        assert probe["scheduler"]["num_steps"] == 0
    # iteration 0, the data from its start, the LR schedule from its first step: what a fresh
    # run does, from other weights
    assert [r["iteration"] for r in records] == list(range(1, 7))
    assert [r["consumed_samples"] for r in records] == [4 * i for i in range(1, 7)]
    assert [r["lr"] for r in records] == [r["lr"] for r in fresh]
    assert records[0]["loss"] != fresh[0]["loss"]


def test_no_load_optim_keeps_the_progress_and_restarts_optimizer_and_schedule(
    tp2_checkpoint, tmp_path, reference_runs
):
    fresh = reference_run(MODEL + ITERS, nproc=1, cache_dir=reference_runs)
    args = [*MODEL, *ITERS, "--load", str(tp2_checkpoint), "--no-load-optim"]
    records, (probe,) = probed(args, nproc=1, workdir=tmp_path, name="no-optim")
    stored = read_checkpoint_tensors(tp2_checkpoint / "iter_0000002")
    assert assert_loaded([probe], stored, "weights") == len(model_keys(stored))
    assert probe["progress"] == (2, 8)
    assert probe["optimizer_states"] == 0 and probe["scheduler"]["num_steps"] == 0
    assert [r["iteration"] for r in records] == [3, 4, 5, 6]
    # Megatron-LM's meaning: the schedule starts again from its first step
    assert [r["lr"] for r in records] == [r["lr"] for r in fresh[:4]]


def test_no_load_rng_leaves_the_generators_as_a_fresh_run_has_them(tmp_path):
    save = tmp_path / "ckpt"
    args = [*MODEL, "--train-iters", "3"]
    run_pretrain(
        [*args, "--exit-interval", "2", "--save", str(save)], nproc=1, workdir=tmp_path, name="save"
    )
    saved_rng = torch.load(save / "iter_0000002" / "rng" / "rank_00000.pt", weights_only=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    _, (restored,) = probed([*args, "--load", str(save)], nproc=1, workdir=tmp_path, name="rng")
    _, (kept,) = probed(
        [*args, "--load", str(save), "--no-load-rng"], nproc=1, workdir=tmp_path, name="no-rng"
    )
    _, (fresh,) = probed([*args, "--load", str(empty)], nproc=1, workdir=tmp_path, name="fresh")
    assert torch.equal(restored["torch_rng"], saved_rng["torch"])
    assert torch.equal(kept["torch_rng"], fresh["torch_rng"])
    assert not torch.equal(kept["torch_rng"], saved_rng["torch"])
    assert kept["progress"] == (2, 8) and kept["optimizer_states"] > 0  # the rest loaded


def test_no_save_rng_writes_no_rng_states_and_a_resume_starts_them_afresh(tmp_path):
    save = tmp_path / "ckpt"
    args = [*MODEL, "--train-iters", "3"]
    run_pretrain(
        [*args, "--exit-interval", "2", "--save", str(save), "--no-save-rng"],
        nproc=1,
        workdir=tmp_path,
        name="save",
    )
    assert not (save / "iter_0000002" / "rng").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    dump = tmp_path / "resumed.probe"
    result = run_job([*args, "--load", str(save), "--probe-dump", str(dump)], module=PROBE)
    assert result.status == 0, result.describe()
    (resumed,) = read_records(dump)
    _, (fresh,) = probed([*args, "--load", str(empty)], nproc=1, workdir=tmp_path, name="fresh")
    assert torch.equal(resumed["torch_rng"], fresh["torch_rng"])
    assert resumed["progress"] == (2, 8) and resumed["optimizer_states"] > 0  # the rest loaded
    assert "holds no RNG states (saved with --no-save-rng): RNG states start fresh" in (
        result.stderr + result.stdout
    )


def test_no_save_optim_writes_weights_that_load_only_without_the_optimizer(tmp_path):
    save = tmp_path / "ckpt"
    run_pretrain(
        [*MODEL, "--train-iters", "2", "--save", str(save), "--no-save-optim"],
        nproc=1,
        workdir=tmp_path,
        name="save",
    )
    stored = read_checkpoint_tensors(save / "iter_0000002")
    assert not any(key.startswith("optimizer.") for key in stored)
    message = train_fails([*MODEL, *ITERS, "--load", str(save)], status=2)
    assert "holds no optimizer state (it was saved with --no-save-optim)" in message
    assert "--no-load-optim or --finetune" in message
    records = run_pretrain(
        [*MODEL, *ITERS, "--load", str(save), "--no-load-optim"],
        nproc=1,
        workdir=tmp_path,
        name="resumed",
    )
    assert records[0]["iteration"] == 3


def test_pretrained_checkpoint_starts_a_run_that_then_resumes_from_load(tp2_checkpoint, tmp_path):
    """Megatron-LM's fine-tuning pattern: --pretrained-checkpoint gives the weights while --load
    holds no checkpoint; once the run has saved there, a restart resumes from --load."""
    own = tmp_path / "finetune"
    args = [*MODEL, *ITERS, "--pretrained-checkpoint", str(tp2_checkpoint)]
    args += ["--load", str(own), "--save", str(own)]
    first, (start,) = probed([*args, "--exit-interval", "2"], nproc=1, workdir=tmp_path, name="a")
    stored = read_checkpoint_tensors(tp2_checkpoint / "iter_0000002")
    assert assert_loaded([start], stored, "weights") == len(model_keys(stored))
    assert start["progress"] == (0, 0) and [r["iteration"] for r in first] == [1, 2]
    second, (resumed,) = probed(args, nproc=1, workdir=tmp_path, name="b")
    assert resumed["progress"] == (2, 8) and resumed["optimizer_states"] > 0
    assert [r["iteration"] for r in second] == [3, 4, 5, 6]


def test_skip_train_records_and_prints_the_iteration_of_the_weights_it_loaded(tmp_path):
    """--skip-train with --finetune or --pretrained-checkpoint (the weights alone, as
    memo-eval-retrieval loads them) evaluates the checkpoint at its own iteration, not at the
    0 a fine-tuning run would count its steps from."""
    save = tmp_path / "ckpt"
    args = [*MODEL, "--train-iters", "3", "--eval-iters", "1"]
    run_pretrain(
        [*args, "--exit-interval", "2", "--save", str(save)], nproc=1, workdir=tmp_path, name="save"
    )
    for name, source in [
        ("finetune", ["--load", str(save), "--finetune"]),
        ("pretrained", ["--pretrained-checkpoint", str(save)]),
        ("resumed", ["--load", str(save)]),
    ]:
        metrics = tmp_path / f"{name}.jsonl"
        result = run_job([*args, *source, "--skip-train", "--metrics-file", str(metrics)])
        assert result.status == 0, result.describe()
        (record,) = read_metrics(metrics)
        assert record["iteration"] == 2, name
        assert "evaluation at iteration 2 |" in result.stdout + result.stderr, name


def test_finetune_and_pretrained_checkpoint_need_a_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = train_fails([*MODEL, *ITERS, "--finetune"], status=2)
    assert "--finetune takes the weights of --load DIR or --pretrained-checkpoint DIR" in message
    message = train_fails([*MODEL, *ITERS, "--load", str(empty), "--finetune"], status=2)
    assert f"--load {empty} holds no checkpoint to take the weights from" in message
    message = train_fails([*MODEL, *ITERS, "--pretrained-checkpoint", str(empty)], status=2)
    assert f"--pretrained-checkpoint {empty} holds no checkpoint" in message


# --- Megatron-LM's checkpoints ----------------------------------------------------------------


def write_megatron_lm(out: Path, *, nproc: int, extra: list[str] = ()) -> Path:
    """A checkpoint in Megatron-LM's layout of ``MODEL`` at iteration 5, written from ``nproc``
    ranks at TP ``nproc``, with the vocabulary padded as Megatron-LM pads it there (128 × TP:
    512 rows at TP 2, where this trainer pads the same tokenizer to 384)."""
    tp = ["--tensor-model-parallel-size", str(nproc)]
    divisible = ["--make-vocab-size-divisible-by", str(128 * nproc)]
    result = run_job(
        [*MODEL, "--train-iters", "8", *tp, *divisible, "--writer-out", str(out), *extra],
        nproc=nproc,
        entry=f"{PROBE}:write_megatron_lm",
    )
    assert result.status == 0, result.describe()
    assert not (out / "iter_0000005" / "manifest.json").exists()
    return out


@pytest.fixture(scope="module")
def megatron_lm_checkpoint(tmp_path_factory) -> Path:
    return write_megatron_lm(tmp_path_factory.mktemp("mlm") / "ckpt", nproc=2)


def test_a_megatron_lm_checkpoint_loads_its_weights_with_finetune(megatron_lm_checkpoint, tmp_path):
    args = [*MODEL, *ITERS, "--load", str(megatron_lm_checkpoint), "--finetune"]
    records, (probe,) = probed(args, nproc=1, workdir=tmp_path, name="finetuned")
    stored = read_checkpoint_tensors(megatron_lm_checkpoint / "iter_0000005")
    # its 512 embedding rows (Megatron-LM's padding at TP 2) were adopted, every one loaded
    assert stored["embedding.word_embeddings.weight"].shape[0] == 512
    assert probe["weights"]["embedding.word_embeddings.weight"][0][1].shape[0] == 512
    assert assert_loaded([probe], stored, "weights") == len(model_keys(stored))
    assert probe["progress"] == (0, 0) and probe["optimizer_states"] == 0
    assert records[0]["iteration"] == 1


@pytest.mark.parametrize(("nproc", "layout"), [(1, []), (2, PP2)], ids=["tp1", "pp2"])
def test_a_megatron_lm_checkpoint_resumes_with_its_optimizer_and_schedule(
    megatron_lm_checkpoint, tmp_path, nproc, layout
):
    args = [*MODEL, "--train-iters", "8", *layout, "--load", str(megatron_lm_checkpoint)]
    records, probes = probed(args, nproc=nproc, workdir=tmp_path, name="resumed")
    stored = read_checkpoint_tensors(megatron_lm_checkpoint / "iter_0000005")
    assert assert_loaded(probes, stored, "weights") == len(model_keys(stored))
    moments = {key for key in stored if key.startswith("optimizer.state.")}
    assert assert_loaded(probes, stored, "moments") == len(moments) > 0
    for probe in probes:
        assert probe["progress"] == (5, 20)
        # Megatron-LM counted 5 steps of 4 samples; an iteration-based run here counts steps
        assert probe["scheduler"]["num_steps"] == 5
    assert [r["iteration"] for r in records] == [6, 7, 8]
    assert records[0]["consumed_samples"] == 24


def test_a_megatron_lm_distributed_optimizer_checkpoint_resumes_as_ours_does(tmp_path):
    # one state written twice: in Megatron-LM's default distributed-optimizer layout
    # (dp_reshardable, its content metadata recorded) and by our own save; both resume at DP 2
    # into the same run, step for step
    gpu = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    flags = [*MODEL, "--train-iters", "8", *gpu, "--make-vocab-size-divisible-by", "128"]
    mlm, ours = tmp_path / "mlm", tmp_path / "ours"
    result = run_job(
        [*flags, "--writer-out", str(mlm), "--writer-also-ours", str(ours)],
        nproc=2,
        entry=f"{PROBE}:write_megatron_lm",
    )
    assert result.status == 0, result.describe()
    assert not (mlm / "iter_0000005" / "manifest.json").exists()
    from_mlm = run_pretrain([*flags, "--load", str(mlm)], nproc=2, workdir=tmp_path, name="m")
    from_ours = run_pretrain([*flags, "--load", str(ours)], nproc=2, workdir=tmp_path, name="o")
    assert [r["iteration"] for r in from_mlm] == [6, 7, 8]
    assert [(r["loss"], r["grad_norm"]) for r in from_mlm] == [
        (r["loss"], r["grad_norm"]) for r in from_ours
    ]
    # the moments were loaded: a fresh optimizer from the same weights takes another step
    fresh = run_pretrain(
        [*flags, "--load", str(mlm), "--no-load-optim"], nproc=2, workdir=tmp_path, name="f"
    )
    assert fresh[0]["loss"] == from_mlm[0]["loss"] and fresh[1]["loss"] != from_mlm[1]["loss"]


def test_a_megatron_lm_optimizer_of_another_format_is_refused(tmp_path):
    ckpt = write_megatron_lm(tmp_path / "mixed", nproc=1, extra=["--writer-mixed-precision"])
    args = [*MODEL, "--train-iters", "8", "--load", str(ckpt)]
    message = train_fails(args, status=2)
    assert "does not fit this run's optimizer" in message and "--finetune" in message
    records = run_pretrain([*args, "--finetune"], nproc=1, workdir=tmp_path, name="finetuned")
    assert records[0]["iteration"] == 1


def test_a_megatron_lm_checkpoint_of_another_model_is_refused_by_name(megatron_lm_checkpoint):
    other = [a if a != "36" else "48" for a in MODEL]  # another hidden size
    args = [*other, *ITERS, "--load", str(megatron_lm_checkpoint), "--finetune"]
    message = train_fails(args, status=2)
    assert "holds another model: hidden_size 36 there, 48 here" in message


def test_a_damaged_megatron_lm_checkpoint_is_named(tmp_path):
    ckpt = write_megatron_lm(tmp_path / "ckpt", nproc=1)
    data = max((ckpt / "iter_0000005").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])
    message = train_fails([*MODEL, *ITERS, "--load", str(ckpt), "--finetune"], status=1)
    assert f"checkpoint file {data} is truncated" in message


MEGATRON_LM = os.environ.get("MEGATRON_LM", "/tmp/megatron-lm")
"""A Megatron-LM checkout of the installed megatron-core's version (its core_v<version> tag)."""


@pytest.mark.skipif(
    not (Path(MEGATRON_LM) / "megatron" / "training" / "checkpointing.py").is_file(),
    reason=f"no Megatron-LM checkout at {MEGATRON_LM} (set MEGATRON_LM)",
)
def test_a_checkpoint_written_by_megatron_lm_itself_loads(tmp_path):
    from memo_ext.benchmarks.checkpoint_save import MODEL_FLAGS, RUN_FLAGS, check_megatron_lm

    check_megatron_lm(Path(MEGATRON_LM))
    ckpt = tmp_path / "megatron_lm"
    result = run_job([str(ckpt), MEGATRON_LM], nproc=1, entry=f"{PROBE}:save_with_megatron_lm")
    assert result.status == 0, result.describe()
    args = [*MODEL_FLAGS, *RUN_FLAGS, "--load", str(ckpt), "--finetune"]
    _, (probe,) = probed(args, nproc=1, workdir=tmp_path, name="finetuned")
    stored = read_checkpoint_tensors(ckpt / "iter_0000003")
    assert assert_loaded([probe], stored, "weights") == len(model_keys(stored))
    assert probe["progress"] == (0, 0)
    # its args are its parser's (no global batch): its schedule, in samples, cannot go on in steps
    resume = [*MODEL_FLAGS, *RUN_FLAGS, "--load", str(ckpt)]
    assert "start from its weights with --finetune" in train_fails(resume, status=2)


MEGATRON_LM_STYLES = {
    # Megatron-LM's default GPT: LayerNorm, GeLU MLP of 4h, biases (its validate_args sets
    # add_qkv_bias with them), learned positions, tied embeddings
    "gpt3": cli(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=28,
                micro_batch_size=2, mock_data=True, seed=11),
    # a Llama 2 / 3: SwiGLU at Megatron-LM's default width (no --ffn-hidden-size), GQA, RoPE,
    # RMSNorm, untied, no biases
    "llama": cli(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                 num_query_groups=2, swiglu=True, normalization="RMSNorm",
                 position_embedding_type="rope", disable_bias_linear=True,
                 untie_embeddings_and_output_weights=True, seq_length=28, micro_batch_size=2,
                 mock_data=True, seed=11),
    # zero-centred norm gains (--apply-layernorm-1p), RoPE, biases
    "layernorm-1p": cli(num_layers=2, hidden_size=32, num_attention_heads=4,
                        apply_layernorm_1p=True, position_embedding_type="rope", seq_length=28,
                        micro_batch_size=2, mock_data=True, seed=11),
}  # fmt: skip
SCHEDULE = cli(global_batch_size=4, lr="2e-3", lr_warmup_iters=2)


@pytest.mark.parametrize("style", list(MEGATRON_LM_STYLES))
def test_megatron_lm_checkpoints_of_its_own_model_styles_load_and_train(style, tmp_path):
    """A checkpoint in Megatron-LM's layout (megatron-core's dist_checkpointing, its common
    state and args as its validate_args leaves them) of each model style loads with the same
    flags, weights only (--finetune) and whole (--load), and trains."""
    flags = [*MEGATRON_LM_STYLES[style], *SCHEDULE]
    out = tmp_path / "ckpt"
    result = run_job(
        [*flags, "--train-iters", "8", "--writer-out", str(out), "--writer-iteration", "5"],
        nproc=1, entry=f"{PROBE}:write_megatron_lm",
    )  # fmt: skip
    assert result.status == 0, result.describe()
    stored = read_checkpoint_tensors(out / "iter_0000005")
    finetuned, (probe,) = probed(
        [*flags, *ITERS, "--load", str(out), "--finetune"], nproc=1, workdir=tmp_path,
        name="finetuned",
    )  # fmt: skip
    assert assert_loaded([probe], stored, "weights") == len(model_keys(stored))
    assert [r["iteration"] for r in finetuned][0] == 1
    resumed = run_pretrain(
        [*flags, "--train-iters", "8", "--load", str(out)], nproc=1, workdir=tmp_path,
        name="resumed",
    )  # fmt: skip
    assert [r["iteration"] for r in resumed] == [6, 7, 8]
