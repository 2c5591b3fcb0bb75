"""Megatron-LM's data-loader, logging, memory, profiling, W&B and CUDA performance flags:
parsing, checks, and what each does on this machine (CPU, one process)."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from memo_ext.arguments import parse_args
from memo_ext.config import CleanupConfig, ProfileConfig
from memo_ext.data.datasets import build_gpt_datasets
from memo_ext.data.demo_corpus import build_demo_corpus
from memo_ext.data.sampler import build_batch_iterator
from memo_ext.data.tokenizers import ByteTokenizer
from memo_ext.errors import UsageError
from memo_ext.features.megatron import run_transformer_config
from memo_ext.mcore.norms import Norm
from memo_ext.mcore.transformer_config import model_shape_of
from memo_ext.shapes import ModelShape
from memo_ext.training import housekeeping
from memo_ext.training.housekeeping import ManualGC, StepProfiler, notices_for_this_machine
from memo_ext.training.metrics import StepMetrics, WandbWriter
from memo_ext.training.model import data_parallel_overlap
from memo_ext.training.model_stats import params_l2_norm
from memo_ext.training.optimizer import build_optimizer
from tests.launch import SMALL_GPT, cli
from tests.models import build_gpt, cpu_config, ddp_wrapped
from tests.unit.test_memo_layer import assert_same, build_pair, make_config, run_stack

FAKE_WANDB = Path(__file__).resolve().parents[1] / "fake_wandb"


def parse(*extra: str, world_size: int = 1):
    return parse_args([*SMALL_GPT, *extra], world_size=world_size)


# --- flags and checks -------------------------------------------------------------------------


def test_defaults_are_megatron_lms():
    run = parse()
    assert (run.data.num_workers, run.data.mmap_bin_files) == (2, True)
    # except the s² mask, which the core attentions never read
    assert not run.data.create_attention_mask_in_dataloader
    assert parse("--create-attention-mask-in-dataloader").data.create_attention_mask_in_dataloader
    assert run.cleanup == CleanupConfig(empty_unused_memory_level=0, manual_gc=False)
    assert (run.profile.step_start, run.profile.step_end, run.profile.ranks) == (10, 12, (0,))
    assert not (run.logging.log_throughput or run.logging.log_params_norm)
    assert not run_transformer_config(run).layernorm_zero_centered_gamma
    assert run.logging.wandb_project is None


def test_flags_reach_the_run(tmp_path):
    run = parse(
        *cli(
            num_workers=0,
            no_mmap_bin_files=True,
            no_create_attention_mask_in_dataloader=True,
            log_throughput=True,
            log_params_norm=True,
            log_num_zeros_in_grad=True,
            empty_unused_memory_level=2,
            manual_gc=True,
            manual_gc_interval=5,
            no_manual_gc_eval=True,
            apply_layernorm_1p=True,
            profile=True,
            profile_step_start=2,
            profile_step_end=4,
            profile_ranks=[0, 1],
            use_pytorch_profiler=True,
            tensorboard_dir=str(tmp_path / "tb"),
            overlap_grad_reduce=True,
            grad_reduce_in_bf16=True,
            cross_entropy_loss_fusion=True,
        ),
        world_size=2,
    )
    assert (run.data.num_workers, run.data.mmap_bin_files) == (0, False)
    assert not run.data.create_attention_mask_in_dataloader
    log = run.logging
    assert log.log_throughput and log.log_params_norm and log.log_num_zeros_in_grad
    assert run.cleanup == CleanupConfig(
        empty_unused_memory_level=2, manual_gc=True, manual_gc_interval=5, manual_gc_eval=False
    )
    assert run.profile == ProfileConfig(
        enabled=True, step_start=2, step_end=4, ranks=(0, 1), use_pytorch_profiler=True
    )
    assert run.profile_dir == str(tmp_path / "tb")
    assert run_transformer_config(run).layernorm_zero_centered_gamma
    d = run.distributed
    assert d.overlap_grad_reduce and d.grad_reduce_in_bf16 and not d.overlap_param_gather
    # CPU: megatron's fused loss is not used (the notices say so, see below)
    assert (
        run.model.cross_entropy_loss_fusion
        and not run_transformer_config(run).cross_entropy_loss_fusion
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (["--overlap-param-gather", "--overlap-grad-reduce"], "and --overlap-grad-reduce"),
        (["--manual-gc-interval", "5"], "apply with --manual-gc; add --manual-gc"),
        (["--no-manual-gc-eval"], "apply with --manual-gc"),
        (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be at least"),
        (["--num-workers", "-1"], "--num-workers must be at least 0"),
        (["--profile-step-start", "3"], "--profile-step-start only applies with --profile"),
        (["--use-pytorch-profiler", "--profile-ranks", "0", "1"], "only apply with --profile"),
        (["--profile", *cli(profile_step_start=5, profile_step_end=5)], "must be larger than"),
        (["--profile", *cli(profile_step_start=11, profile_step_end=13)], "past --train-iters"),
        (["--profile", "--profile-ranks", "1"], "--profile-ranks must name ranks in [0, 1)"),
        (["--wandb-project", "p"], "--wandb-project needs --wandb-exp-name"),
    ],
)
def test_bad_combinations_fail_in_one_sentence(extra, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse(*extra)


def test_wandb_needs_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UsageError, match="pip install wandb"):
        parse("--wandb-project", "p", "--wandb-exp-name", "e")


def test_an_empty_wandb_project_is_off_as_in_megatron():
    assert not parse("--wandb-project", "", "--wandb-exp-name", "e").logging.wandb_project


def test_cuda_only_flags_give_one_notice_each_on_cpu_and_never_fail():
    run = parse(
        *cli(
            empty_unused_memory_level=1,
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            cross_entropy_loss_fusion=True,
            grad_reduce_in_bf16=True,
            profile=True,
        )
    )
    notes = notices_for_this_machine(run, cuda=False)
    for flag in (
        "--empty-unused-memory-level",
        "--cross-entropy-loss-fusion",
        "--grad-reduce-in-bf16",
        "--profile without --use-pytorch-profiler",
    ):
        assert sum(note.startswith(flag) for note in notes) == 1, (flag, notes)
    # megatron-core DDP's bucketed, overlapped reduction and parameter gather run on gloo too
    assert not any(n.startswith(("--overlap-grad-reduce", "--overlap-param-gather")) for n in notes)
    # on CUDA they apply, except bf16 gradients for fp32 weights and HotSPa's explicit groups
    assert [n.split()[0] for n in notices_for_this_machine(run, cuda=True)] == [
        "--grad-reduce-in-bf16"
    ]
    hot = dataclasses.replace(run, hotspa=dataclasses.replace(run.hotspa, enabled=True))
    assert sum("with --hotspa" in n for n in notices_for_this_machine(hot, cuda=True)) == 3


def test_selective_recomputation_on_cpu_leaves_out_transformer_engine_s_advice(monkeypatch):
    """megatron-core warns that recomputing core_attn may be needless with transformer-engine's
    fused attention: advice a CPU run, which builds no transformer-engine layer, cannot use."""
    import warnings

    from memo_ext.mcore import transformer_config

    run = parse("--recompute-activations")

    def warned() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_transformer_config(run)
        return [str(w.message) for w in caught if "transformer_engine" in str(w.message)]

    assert warned() == []
    monkeypatch.setattr(transformer_config, "on_gpu", lambda: True)  # there it may apply
    (advice,) = warned()
    assert advice.startswith("If you are using transformer_engine as the transformer")


def _fused_loss(run) -> bool:
    """Whether the home model's config runs megatron-core's fused loss (as the loop builds it)."""
    from memo_ext.features.extensions import own_layouts
    from memo_ext.features.megatron import run_transformer_config

    config = run_transformer_config(run, global_groups=own_layouts(run) is None)
    return config.cross_entropy_loss_fusion


def test_overlap_applies_on_every_machine_and_the_fused_loss_on_cuda(monkeypatch):
    """Both are left off under a feature that builds models in layouts of its own (HotSPa)."""
    run = parse("--overlap-grad-reduce", "--cross-entropy-loss-fusion")
    assert data_parallel_overlap(run) and not _fused_loss(run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert data_parallel_overlap(run) and _fused_loss(run)
    hot = dataclasses.replace(run, hotspa=dataclasses.replace(run.hotspa, enabled=True))
    assert not data_parallel_overlap(hot) and not _fused_loss(hot)


def test_console_shows_throughput_only_when_asked():
    record = StepMetrics(
        iteration=3,
        loss=2.0,
        grad_norm=1.0,
        lr=1e-3,
        step_time_s=0.5,
        tokens_per_s=1000.0,
        consumed_samples=12,
        tflops_per_device=12.5,
        mfu=0.25,
    )
    assert "TFLOP/s" not in record.console_line(10) and "MFU" not in record.console_line(10)
    line = record.console_line(10, throughput=True)
    assert "12.5 TFLOP/s/dev" in line and "MFU 25.0%" in line
    # the metrics file keeps both either way
    assert record.to_json()["tflops_per_device"] == 12.5 and record.to_json()["mfu"] == 0.25


# --- data loader --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return build_demo_corpus(
        out_dir=tmp_path_factory.mktemp("corpus"), max_files=6, show_progress=False
    )


def _datasets(corpus, cache, **options):
    return build_gpt_datasets(
        data_path=[corpus],
        split="1,0,0",  # a few files: every sample in the training part
        mock=False,
        seq_length=32,
        seed=1234,
        tokenizer=ByteTokenizer(),
        num_samples=(40, 0, 0),
        cache_dir=str(cache),
        **options,
    )


def _batches(dataset, **options) -> list[dict]:
    return list(
        build_batch_iterator(
            dataset, micro_batch_size=3, data_parallel_rank=1, data_parallel_size=2, **options
        )
    )


def test_worker_processes_give_the_same_batches_in_the_same_order(corpus, tmp_path):
    train, _, _ = _datasets(corpus, tmp_path)
    here = _batches(train, consumed_samples=6)
    workers = _batches(train, consumed_samples=6, num_workers=2)
    assert len(here) == len(workers) == (len(train) - 6) // 6
    for a, b in zip(here, workers):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


class _SignalReport(torch.utils.data.Dataset):
    """Samples that say whether SIGTERM / SIGINT are ignored in the process reading them."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        ignored = all(
            signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGINT)
        )
        value = torch.tensor([int(ignored), os.getpid()])
        return dict(tokens=value, labels=value, loss_mask=value, position_ids=value)


def test_loader_processes_leave_stop_signals_to_the_trainer():
    """A scheduler signals every process of the job; the trainer saves and stops (with
    --exit-signal-handler) and ends its loader processes itself."""
    options = dict(micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1)
    in_workers = list(build_batch_iterator(_SignalReport(), num_workers=1, **options))
    assert all(b["tokens"][:, 1].ne(os.getpid()).all() for b in in_workers)
    assert all(bool(b["tokens"][:, 0].all()) for b in in_workers)
    here = list(build_batch_iterator(_SignalReport(), **options))
    assert not any(bool(b["tokens"][:, 0].any()) for b in here)  # this process is untouched


def test_no_mmap_reads_the_same_samples_with_file_reads(corpus, tmp_path):
    mapped, _, _ = _datasets(corpus, tmp_path)
    read, _, _ = _datasets(corpus, tmp_path, mmap_bin_files=False)
    assert mapped.dataset.mmap and not read.dataset.mmap
    for index in (0, 7, len(read) - 1):
        assert torch.equal(mapped[index]["tokens"], read[index]["tokens"])


def test_attention_mask_in_the_data_loader_is_megatrons_causal_mask(corpus, tmp_path):
    plain, _, _ = _datasets(corpus, tmp_path)
    masked, _, _ = _datasets(corpus, tmp_path, create_attention_mask=True)
    a, b = _batches(plain)[0], _batches(masked)[0]
    assert "attention_mask" not in a
    mask = b.pop("attention_mask")
    assert mask.shape == (3, 1, 32, 32) and mask.dtype == torch.bool
    # True where a token may not look: above the diagonal
    assert torch.equal(mask[0, 0], ~torch.ones(32, 32, dtype=torch.bool).tril())
    assert all(torch.equal(a[k], b[k]) for k in a)  # the rest of the batch is unchanged


# --- --apply-layernorm-1p ---------------------------------------------------------------------


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norm_is_the_plain_norm_with_gain_plus_one(normalization):
    shape = ModelShape(num_layers=1, hidden_size=24, num_attention_heads=2)
    shape = dataclasses.replace(shape, normalization=normalization)
    plain = Norm(cpu_config(shape), 24)
    centred = Norm(cpu_config(shape, layernorm_zero_centered_gamma=True), 24)
    assert torch.equal(centred.weight, torch.zeros(24))  # γ − 1 starts at 0
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(24, generator=gen)
    with torch.no_grad():
        plain.weight.copy_(delta + 1)
        centred.weight.copy_(delta)
        if plain.bias is not None:
            plain.bias.copy_(torch.randn(24, generator=gen))
            centred.bias.copy_(plain.bias)
    x = torch.randn(5, 3, 24, generator=gen)
    outputs, grads = [], []
    for norm in (plain, centred):
        xi = x.clone().requires_grad_(True)
        out = norm(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out.detach())
        grads.append((xi.grad, norm.weight.grad))
    # delta + 1 is formed once in each, the same fp32 operation: equal to the last bit
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_zero_centred_gpt_starts_as_the_plain_gpt(megatron_cpu):
    shape = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    models = [
        build_gpt(
            cpu_config(shape, layernorm_zero_centered_gamma=centred),
            vocab_size=64,
            max_positions=16,
        )
        for centred in (False, True)
    ]
    gains = {
        centred: [p for n, p in m.named_parameters() if n.endswith("layernorm.weight")]
        for centred, m in zip((False, True), models)
    }
    assert gains[False] and all(bool((g == 1).all()) for g in gains[False])
    assert all(bool((g == 0).all()) for g in gains[True])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    results = []
    for model in models:
        loss = model(tokens, positions, None, labels=tokens.roll(-1, dims=1)).sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


@pytest.mark.parametrize("rms", [False, True])
def test_memo_layer_with_zero_centred_gains_equals_the_plain_layer(megatron_cpu, rms):
    plain = make_config(rms=rms)
    config = cpu_config(model_shape_of(plain), layernorm_zero_centered_gamma=True)
    assert config.normalization == plain.normalization
    ref, mem = build_pair(config, alpha=0.5)
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(12)
    x0 = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(3))
    assert_same(run_stack(ref, x0, rope), run_stack(mem, x0, rope))


# --- --log-params-norm, --log-num-zeros-in-grad --------------------------------------------


def test_params_norm_counts_each_weight_once(megatron_cpu):
    shape = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    model = build_gpt(cpu_config(shape), vocab_size=64, max_positions=16)

    def norm(params) -> float:  # the reference: one flat vector of every element, in float64
        return torch.cat([p.detach().double().flatten() for p in params]).norm().item()

    # float64 sums in another order: equal to rounding
    assert params_l2_norm(model.parameters()) == pytest.approx(norm(model.parameters()), rel=1e-12)
    # a pipeline's last stage holds a copy of the tied embedding, marked shared: not counted
    output = model.output_layer.weight
    output.shared = True
    others = [p for p in model.parameters() if p is not output]
    assert params_l2_norm(model.parameters()) == pytest.approx(norm(others), rel=1e-12)


def test_the_optimizer_counts_zeros_of_the_reduced_gradient(megatron_cpu):
    model = ddp_wrapped(torch.nn.Linear(3, 2))
    opt = build_optimizer(
        model_chunks=[model], train=parse().train, bf16=False, fp16=False,
        log_num_zeros_in_grad=True,
    )  # fmt: skip
    layer = model.module
    layer.weight.main_grad.copy_(torch.tensor([[0.0, 1, 0], [2, 0, 0]]))
    layer.bias.main_grad.copy_(torch.tensor([1.0, 0]))
    updated, _ = opt.step()
    assert updated and opt.num_zeros_in_grad == 4 + 1


# --- --manual-gc --------------------------------------------------------------------------------


@pytest.mark.slow
def test_manual_gc_collects_at_its_points_only():
    collections: list[int] = []

    def record(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(record)
    try:
        manual = ManualGC(CleanupConfig(manual_gc=True, manual_gc_interval=2))
        manual.start()
        assert not gc.isenabled() and collections == [2]
        for iteration in (1, 2, 3, 4):
            manual.after_step(iteration)
        assert collections == [2, 2, 2]  # after steps 2 and 4
        with manual.around_evaluation():
            assert collections == [2, 2, 2, 2]  # a full collection before
        assert collections[-1] == 0  # and the evaluation's young garbage after
        manual.stop()
        assert gc.isenabled()
        collections.clear()
        quiet = ManualGC(CleanupConfig(manual_gc=True, manual_gc_eval=False))
        quiet.start()
        with quiet.around_evaluation():
            pass
        quiet.after_step(100)
        quiet.stop()
        assert collections == [2]  # only the one at the start
    finally:
        gc.callbacks.remove(record)
        gc.enable()


def test_without_manual_gc_nothing_changes():
    manual = ManualGC(CleanupConfig())
    manual.start()
    assert gc.isenabled()
    manual.stop()


# --- --profile ----------------------------------------------------------------------------------


def _steps(profiler: StepProfiler, iterations) -> None:
    x = torch.randn(64, 64)
    for iteration in iterations:
        profiler.before_step(iteration)
        with torch.profiler.record_function(f"work_{iteration}"):
            for _ in range(3):
                x = torch.tanh(x @ x)
        profiler.after_step(iteration)
    profiler.close()


def _trace_events(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    return trace["traceEvents"]


def test_torch_trace_covers_the_window_after_a_warm_up_step(tmp_path):
    profile = ProfileConfig(enabled=True, step_start=3, step_end=5)
    profiler = StepProfiler(profile, rank=0, trace_dir=tmp_path, cuda=False)
    _steps(profiler, range(1, 8))
    assert profiler.written == tmp_path / "rank0_iter3-4.pt.trace.json"
    names = {e.get("name") for e in _trace_events(profiler.written)}
    # iterations 3 and 4 recorded; 2 only warmed the profiler up; none after the window
    assert {"work_3", "work_4"} <= names
    assert not {"work_1", "work_2", "work_5", "work_6"} & names
    assert any(str(n).startswith("aten::") for n in names)


def test_a_run_resumed_inside_the_window_profiles_the_rest(tmp_path):
    profile = ProfileConfig(enabled=True, step_start=3, step_end=6)
    profiler = StepProfiler(profile, rank=0, trace_dir=tmp_path, cuda=False)
    _steps(profiler, range(5, 8))  # the checkpoint was at iteration 4
    names = {e.get("name") for e in _trace_events(profiler.written)}
    assert "work_5" in names and "work_6" not in names
    assert profiler.written.name == "rank0_iter5-5.pt.trace.json"


def test_a_run_that_stops_inside_the_window_writes_what_it_recorded(tmp_path):
    profile = ProfileConfig(enabled=True, step_start=2, step_end=6)
    profiler = StepProfiler(profile, rank=0, trace_dir=tmp_path, cuda=False)
    _steps(profiler, range(1, 4))  # --exit-interval 3, say
    names = {e.get("name") for e in _trace_events(profiler.written)}
    assert {"work_2", "work_3"} <= names and "work_1" not in names
    assert profiler.written.name == "rank0_iter2-3.pt.trace.json"


def test_only_the_listed_ranks_profile(tmp_path):
    profile = ProfileConfig(enabled=True, step_start=1, step_end=2, ranks=(1,))
    profiler = StepProfiler(profile, rank=0, trace_dir=tmp_path, cuda=False)
    _steps(profiler, range(1, 3))
    assert profiler.written is None and not list(tmp_path.iterdir())


def test_nsys_range_on_cuda_without_the_pytorch_profiler(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))

    class FakeNvtx:
        def __init__(self, record_shapes):
            assert record_shapes

        def __enter__(self):
            calls.append("nvtx on")

        def __exit__(self, *exc):
            calls.append("nvtx off")

    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", FakeNvtx)
    profile = ProfileConfig(enabled=True, step_start=2, step_end=4)
    profiler = StepProfiler(profile, rank=0, trace_dir=tmp_path, cuda=True)
    seen = []
    for iteration in range(1, 6):
        profiler.before_step(iteration)
        seen.append((iteration, list(calls)))
        profiler.after_step(iteration)
    assert seen[0] == (1, [])  # no warm-up step for nsys
    assert seen[1] == (2, ["start", "nvtx on"])
    assert calls == ["start", "nvtx on", "nvtx off", "stop"]  # closed after iteration 3
    assert not list(tmp_path.iterdir())


# --- --wandb-* ---------------------------------------------------------------------------------


@pytest.fixture
def fake_wandb(monkeypatch):
    """The stand-in wandb of ``tests/fake_wandb`` as the ``wandb`` module."""
    monkeypatch.syspath_prepend(str(FAKE_WANDB))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    module = importlib.import_module("wandb")
    assert Path(module.__file__).parent.parent == FAKE_WANDB
    module.CALLS.clear()
    yield module
    sys.modules.pop("wandb", None)


def test_wandb_writer_sends_the_metrics_records(fake_wandb, tmp_path):
    writer = WandbWriter(
        project="p", name="run-1", save_dir=str(tmp_path / "w"), entity="team", config={"a": 1}
    )
    records = [{"iteration": 1, "loss": 2.5, "lr": 1e-3}, {"iteration": 5, "loss": 2.0}]
    for record in records:
        writer.write(record)
    writer.close()
    init, *logs, finish = fake_wandb.CALLS
    assert init["kwargs"] == dict(
        project="p", name="run-1", dir=str(tmp_path / "w"), entity="team", config={"a": 1}
    )
    assert (tmp_path / "w").is_dir()
    assert logs == [
        {"call": "log", "values": {"loss": 2.5, "lr": 1e-3}, "step": 1},
        {"call": "log", "values": {"loss": 2.0}, "step": 5},
    ]
    assert finish == {"call": "finish"}


def test_wandb_writer_without_a_project_does_nothing(fake_wandb):
    writer = WandbWriter(project=None)
    writer.write({"iteration": 1, "loss": 1.0})
    writer.close()
    assert fake_wandb.CALLS == []


def test_wandb_that_cannot_start_is_one_sentence(fake_wandb, monkeypatch):
    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setattr(fake_wandb, "init", refuse)
    with pytest.raises(UsageError, match="wandb could not start a run .* WANDB_MODE=offline"):
        WandbWriter(project="p", name="n")


def test_wandb_flags_parse_with_the_package_present(fake_wandb, tmp_path):
    run = parse(
        *cli(
            wandb_project="p",
            wandb_exp_name="e",
            wandb_save_dir=str(tmp_path / "w"),
            wandb_entity="team",
        )
    )
    log = run.logging
    assert (log.wandb_project, log.wandb_exp_name, log.wandb_entity) == ("p", "e", "team")


def test_real_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    """Runs only where the optional wandb package is installed (the writer's calls are covered
    by the stand-in above everywhere)."""
    if "wandb" in sys.modules and sys.modules["wandb"] is None:
        sys.modules.pop("wandb")
    pytest.importorskip("wandb", reason="the optional wandb package is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = WandbWriter(project="memo-test", name="offline", save_dir=str(tmp_path))
    for iteration in (1, 2):
        writer.write({"iteration": iteration, "loss": 3.0 - iteration})
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))


@pytest.mark.parametrize(("setting", "emptied_at"), [(0, []), (1, [1]), (2, [1, 2])])
def test_empty_unused_memory_levels(monkeypatch, setting, emptied_at):
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(level))
    cleanup = CleanupConfig(empty_unused_memory_level=setting)
    for level in (1, 2):  # 1: after forward / backward, 2: after the optimizer step
        housekeeping.maybe_empty_cache(cleanup, level=level)
    assert calls == emptied_at
