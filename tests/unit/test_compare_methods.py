"""tools.compare_methods without jobs: method specs, the trainer's command line, the search for
the longest length (against a fake runner whose answer is known), and how job outputs are read."""

from __future__ import annotations

import argparse
import re
import types

import pytest

from memo_ext.arguments import parse_args
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.errors import UsageError, out_of_memory
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape
from tools import compare_methods as cm
from tools import comparison
from tools.method_jobs import (
    OK,
    OOM,
    ROOT,
    TIMEOUT,
    Launch,
    _classify,
    measured_figures,
    parse_method,
)


@pytest.mark.parametrize(
    ("text", "label", "flags"),
    [
        ("none", "none", []),
        ("full", "full", ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
        ("selective", "selective", ["--recompute-granularity", "selective"]),
        ("memo", "memo", ["--memo", "--memo-alpha", "auto"]),
        ("memo=0.25", "memo=0.25", ["--memo", "--memo-alpha", "0.25"]),
        ("memo=auto@tp4cp2", "memo@tp4cp2", ["--memo", "--memo-alpha", "auto"]),
        ("memo+plan=1", "memo+plan=1", ["--memo", "--memo-alpha", "1", "--memo-allocator"]),
        ("megatron-offload", "megatron-offload", ["--fine-grained-activation-offloading"]),
    ],
)
def test_method_specs(text, label, flags):
    method = parse_method(text)
    assert method.label == label
    assert method.trainer_flags()[: len(flags)] == flags


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fast", "is not METHOD"),
        ("full=0.5", "only memo and memo+plan take an α"),
        ("memo=1.5", "α must be in [0, 1]"),
        ("memo=x", "α must be in [0, 1]"),
        ("megatron-offload=0.5", "only memo and memo+plan take an α"),
    ],
)
def test_bad_method_specs_are_one_sentence(text, says):
    with pytest.raises(UsageError, match=re.escape(says)) as err:
        parse_method(text)
    assert "\n" not in str(err.value)


def test_a_method_layout_takes_the_rest_of_the_world_as_dp():
    default = ParallelLayout(tp=2, sp=True)
    assert parse_method("full").resolve_layout(default, 8) == ParallelLayout(tp=2, sp=True, dp=4)
    own = parse_method("full@tp4cp2").resolve_layout(default, 8)
    assert (own.tp, own.cp, own.dp, own.sp) == (4, 2, 1, True)


def _comparison(tmp_path, **changes) -> cm.Comparison:
    model = ModelShape(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        swiglu=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        position_embedding_type="rope",
        vocab_size=300,
    )
    methods = [parse_method("none"), parse_method("memo=0.5"), parse_method("full@tp2")]
    world = 2
    layouts = {m.label: m.resolve_layout(ParallelLayout(), world) for m in methods}
    values = dict(
        model=model,
        methods=methods,
        layouts=layouts,
        seq_lengths=[128],
        find_max=True,
        granularity=64,
        max_seq_length=4096,
        find_max_start=None,
        launch=Launch(nproc_per_node=world),
        micro_batch_size=2,
        num_microbatches=1,
        keep_last_layers=1,
        loss_chunks=1,
        warmup_steps=1,
        measure_steps=2,
        timeout_s=60,
        time_budget_s=None,
        memory_limit_gb=0.5,
        extra=["--attention-backend", "sdpa"],
        out=tmp_path,
        device=None,
        cuda=False,
        host_memory_bytes=2**34,
        efficiency=None,
        kernels=None,
        calibrate_path=None,
        retry_errors=False,
    )
    values.update(changes)
    comp = cm.Comparison(**values)
    comp.device = types.SimpleNamespace(peak_tflops=0.1)
    return comp


def test_the_trainer_parses_each_job_as_the_comparison_meant_it(tmp_path):
    """The reference is the trainer's own parser: every job's flags give back the comparison's
    model, layout, method, batch and limit."""
    comp = _comparison(tmp_path)
    for method in comp.methods:
        argv = comparison.job_argv(comp, method, 256, metrics=tmp_path / "m.jsonl", job_id="x")
        trainer_args = argv[argv.index(str(ROOT / "pretrain_gpt_memo.py")) + 1 :]
        run = parse_args(trainer_args, world_size=comp.launch.world_size)
        shape = run.shape
        for name in ("num_layers", "hidden_size", "num_query_groups", "swiglu", "normalization"):
            assert getattr(shape, name) == getattr(comp.model, name)
        assert shape.add_bias_linear is False
        # NullTokenizer's vocabulary is --vocab-size plus end-of-document
        assert tokenizer_for(run.data).vocab_size == comp.model.vocab_size
        assert run.layout == comp.layouts[method.label]
        assert run.data.seq_length == 256
        assert run.train.global_batch_size == 2 * run.layout.dp
        assert run.train.train_iters == 3
        assert run.preflight.memory_limit_gb == 0.5
        assert run.preflight.enabled is False
        assert run.memo.enabled == method.is_memo
        if method.is_memo:
            assert (run.memo.alpha, run.memo.keep_last_layers) == (0.5, 1)
        assert (run.recompute.granularity == "full") == (method.name == "full")


class _FakeRunner:
    """Trains exactly the lengths up to ``longest``; a run beyond fails as ``failure`` does."""

    def __init__(self, longest: int, failure: str = OOM, known=()) -> None:
        self.longest, self.failure, self.calls = longest, failure, []
        self.results = types.SimpleNamespace(current=lambda: list(known))

    def run(self, method, seq: int) -> dict:
        self.calls.append(seq)
        status = OK if seq <= self.longest else self.failure
        return {"status": status, "message": "boom"}


@pytest.mark.parametrize("longest", [64, 200, 1000, 1024, 3000])
@pytest.mark.parametrize("failure", [OOM, TIMEOUT])
def test_find_longest_finds_the_largest_multiple_that_trains(tmp_path, longest, failure):
    comp = _comparison(tmp_path, find_max_start=256)
    runner = _FakeRunner(longest, failure)
    found = cm.find_longest(comp, runner, comp.methods[0])
    assert found["longest"] == longest // 64 * 64  # brute force: every multiple of 64 below
    assert len(runner.calls) == len(set(runner.calls)), "a length ran twice"
    assert len(runner.calls) <= 12  # galloping + bisection, not a scan of 64 multiples


def test_find_longest_starts_from_what_the_grid_learned(tmp_path):
    known = [
        {"method": "none", "seq_length": 128, "status": OK},
        {"method": "none", "seq_length": 512, "status": OOM},
    ]
    runner = _FakeRunner(300, known=known)
    found = cm.find_longest(_comparison(tmp_path), runner, parse_method("none"))
    assert found == {"longest": 256, "bound": "320 does not train"}
    assert runner.calls == [320, 192, 256]  # 128..512 bisected; nothing known is rerun


def test_find_longest_stops_at_the_bound_and_on_errors(tmp_path):
    comp = _comparison(tmp_path, find_max_start=1024, max_seq_length=2048)
    found = cm.find_longest(comp, _FakeRunner(10**6), comp.methods[0])
    assert found == {"longest": 2048, "bound": "reached --max-seq-length"}
    found = cm.find_longest(comp, _FakeRunner(10, failure="error"), comp.methods[0])
    assert found["longest"] is None and "1,024 failed: boom" in found["bound"]
    comp = _comparison(tmp_path, find_max_start=64)
    found = cm.find_longest(comp, _FakeRunner(10), comp.methods[0])
    assert found == {"longest": None, "bound": "64 fails and nothing shorter to try"}


def test_an_out_of_memory_exit_is_a_result_with_its_bytes():
    sentence = (
        "pretrain_gpt_memo.py: rank 0 failed: out of memory (tried to allocate 8388608 bytes, "
        "0.01 GiB); shorten --seq-length"
    )
    outcome = _classify(3, f"noise\n{sentence}\n", timed_out=False)
    assert (outcome.status, outcome.requested_bytes) == (OOM, 8388608)
    assert outcome.message == sentence
    cuda = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has"
    outcome = _classify(1, cuda, timed_out=False)
    assert (outcome.status, outcome.requested_bytes) == (OOM, int(2.5 * 2**30))
    crash = "x.py: rank 0 failed: exit status 1; its output above says why"
    outcome = _classify(1, f"[rank0]: ValueError: bad shape\n{crash}", timed_out=False)
    assert outcome.status == "error" and outcome.message.endswith("ValueError: bad shape")
    assert _classify(None, "", timed_out=True).status == TIMEOUT


@pytest.mark.parametrize(
    ("error", "requested"),
    [
        (
            RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 96 bytes"
            ),
            96,
        ),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0"), 20 * 2**20),
        (MemoryError(), None),
    ],
)
def test_allocator_errors_become_out_of_memory(error, requested):
    oom = out_of_memory(error)
    assert oom.exit_status == 3 and oom.requested_bytes == requested
    assert "\n" not in str(oom) and "out of memory" in str(oom)


def test_other_errors_are_not_out_of_memory():
    assert out_of_memory(RuntimeError("shape mismatch")) is None
    primitive = RuntimeError("could not create a primitive")
    assert out_of_memory(primitive) is None  # oneDNN fails so for other reasons too
    assert out_of_memory(primitive, capped=True).requested_bytes is None


def test_measured_figures_skip_the_warm_up():
    records = [
        {"iteration": 1, "step_time_s": 9.0, "mfu": 0.1},
        {"iteration": 2, "step_time_s": 2.0, "mfu": 0.4, "mem_allocated_bytes": 5},
        {"iteration": 3, "step_time_s": 4.0, "mfu": 0.2, "mem_allocated_bytes": 7},
    ]
    figures = measured_figures(records, warmup_steps=1)
    assert figures["step_time_s"] == 3.0 and figures["mfu"] == pytest.approx(0.3)
    assert figures["mem_allocated_bytes"] == 7 and figures["steps"] == 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--methods", "none"], "give --seq-lengths, --find-max or both"),
        (["--seq-lengths", "64", "--methods", "none", "none"], "names a method twice"),
        (["--seq-lengths", "64", "--nproc-per-node", "3", "--methods", "full@tp3"], "heads"),
        (["--seq-lengths", "64", "--nnodes", "2"], "--rdzv-endpoint"),
        (["--seq-lengths", "64", "--granularity", "0"], "--granularity must be positive"),
    ],
)
def test_bad_comparisons_stop_before_any_job(argv, says, tmp_path, capsys):
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    status = cm.main([*model, "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2 and says in err and "\n" not in err
    assert not (tmp_path / "jobs").exists()


def test_model_flags_need_a_preset_or_the_sizes():
    args = argparse.Namespace(model=None, **{f"shape.{n}": None for n in cm.MODEL_FIELDS})
    with pytest.raises(UsageError, match="--num-layers, --hidden-size, --num-attention-heads"):
        cm._model(args)


@pytest.mark.parametrize(
    "extra, installed, expect",
    [
        ([], {"transformer_engine", "flash_attn"}, "flash"),  # not te: MEMO cannot run on it
        (["--bf16"], {"transformer_engine"}, "sdpa"),
        (["--attention-backend", "sdpa", "--bf16"], {"transformer_engine", "flash_attn"}, "sdpa"),
        (["--attention-backend=auto"], {"flash_attn"}, "flash"),
    ],
)
def test_every_method_runs_on_one_attention_backend(monkeypatch, extra, installed, expect):
    """``auto`` resolved per job would give the baselines transformer-engine's attention and
    MEMO flash-attn's: the comparison picks one backend for all, MEMO's, and passes it."""
    from memo_ext.config import network

    monkeypatch.setattr(network.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(network, "installed", lambda module: module in installed)
    methods = [cm.parse_method("full"), cm.parse_method("memo")]
    flags, backend = cm._one_attention_backend(extra, methods)
    assert backend == expect
    assert (
        flags.count("--attention-backend") == 1
        and flags[flags.index("--attention-backend") + 1] == expect
    )
    assert "--bf16" in flags or "--bf16" not in extra


def test_transformer_engine_attention_cannot_compare_memo():
    with pytest.raises(UsageError, match="--attention-backend te cannot run MEMO"):
        cm._one_attention_backend(["--attention-backend", "te"], [cm.parse_method("memo")])
