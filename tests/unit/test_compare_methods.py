"""tools.compare_methods without jobs: method specs, the trainer's command line, the search for
the longest length (against a fake runner whose answer is known), and how job outputs are read."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from memo_ext.arguments import parse_args
from memo_ext.commands import compare_methods as cm
from memo_ext.compare import comparison
from memo_ext.compare.jobs import (
    OK,
    OOM,
    TIMEOUT,
    Launch,
    _classify,
    measured_figures,
    parse_method,
)
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.errors import UsageError, out_of_memory
from memo_ext.parallel import ParallelLayout
from memo_ext.shapes import ModelShape

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "label", "flags"),
    [
        ("none", "none", []),
        ("full", "full", ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
        ("selective", "selective", ["--recompute-granularity", "selective"]),
        ("memo", "memo", ["--memo", "--memo-alpha", "auto"]),
        ("memo:alpha=0.25", "memo:alpha=0.25", ["--memo", "--memo-alpha", "0.25"]),
        ("memo:alpha=.50", "memo:alpha=0.5", ["--memo", "--memo-alpha", "0.5"]),
        ("memo:alpha=auto@tp4cp2", "memo@tp4cp2", ["--memo", "--memo-alpha", "auto"]),
        ("memo:rule=tokenwise,alpha=1", "memo:alpha=1", ["--memo", "--memo-alpha", "1"]),
        ("memo+plan:alpha=1", "memo+plan:alpha=1",
         ["--memo", "--memo-alpha", "1", "--memo-allocator"]),
        ("megatron-offload", "megatron-offload", ["--fine-grained-activation-offloading"]),
    ],
)  # fmt: skip
def test_method_specs(text, label, flags):
    method = parse_method(text, notice=pytest.fail)
    assert method.label == label
    assert method.trainer_flags()[: len(flags)] == flags
    assert parse_method(label, notice=pytest.fail) == method  # the label reads back as itself


@pytest.mark.parametrize(
    ("old", "new"), [("memo=0.25", "memo:alpha=0.25"), ("memo+plan=auto@tp2", "memo+plan@tp2")]
)
def test_the_old_alpha_spelling_is_read_with_a_notice(old, new):
    notices = []
    assert parse_method(old, notice=notices.append) == parse_method(new, notice=pytest.fail)
    assert len(notices) == 1 and "is spelt" in notices[0], notices


def test_a_compared_rule_reaches_the_trainer_the_estimator_and_the_trace():
    """A MEMO of another offload rule is run, priced and traced with that rule (the default
    rule's spelling is the plain method)."""
    from memo_ext.memo import rules

    @rules.register
    class EverythingKept(rules.TokenWise):
        name = "test-everything-kept"

    try:
        method = parse_method("memo:alpha=0.5,rule=test-everything-kept")
        assert method.label == "memo:alpha=0.5,rule=test-everything-kept"
        flags = method.trainer_flags()
        assert flags[flags.index("--memo-offload-rule") + 1] == "test-everything-kept"
        settings = method.spec.estimator_settings(dict(method.settings), keep_last_layers=None)
        assert settings.offload_rule == "test-everything-kept" and settings.alpha == 0.5
        traced, at = method.spec.traced(dict(method.settings), measured={}, predicted={})
        assert traced.traced_name(at) == "memo-0.5:test-everything-kept"
        auto = parse_method("memo:rule=test-everything-kept")
        traced, at = auto.spec.traced(
            dict(auto.settings), measured={"memo_alpha": 0.25}, predicted={"alpha": 0.75}
        )
        assert traced.traced_name(at) == "memo-0.25:test-everything-kept"  # what the run chose
        traced, at = auto.spec.traced(dict(auto.settings), measured={}, predicted={"alpha": 0.75})
        assert traced.traced_name(at) == "memo-0.75:test-everything-kept"  # it did not train
    finally:
        rules.unregister(EverythingKept)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fast", "no method 'fast'"),
        ("memo@", "is not NAME[:KEY=VALUE,...][@LAYOUT]"),
        ("full:alpha=0.5", "full takes no settings, not alpha"),
        ("memo:alpha=1.5", "alpha must be in [0, 1]"),
        ("memo:alpha=x", "alpha: must be a number in [0, 1] or 'auto'"),
        ("memo:beta=1", "memo takes alpha, rule, not beta"),
        ("memo:alpha=1,alpha=0", "gives alpha twice"),
        ("memo:alpha", "'alpha' is not KEY=VALUE"),
        ("memo:rule=nope", "no registered rule"),
        ("megatron-offload:alpha=0.5", "megatron-offload takes no settings"),
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
    methods = [parse_method("none"), parse_method("memo:alpha=0.5"), parse_method("full@tp2")]
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
        trainer_args = argv[argv.index(comparison.TRAINER) + 1 :]
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
        is_memo = method.name.startswith("memo")
        assert run.memo.enabled == is_memo
        if is_memo:
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


@pytest.mark.parametrize(
    ("failure", "bound"),
    [(OOM, "1,024 does not train"), (TIMEOUT, "1,024 ran past --job-timeout-s 60")],
)
def test_a_timed_out_length_is_reported_as_timed_out(tmp_path, failure, bound):
    # a job stopped at its time limit says nothing of memory: the bound keeps its status
    comp = _comparison(tmp_path, find_max_start=256, timeout_s=60.0)
    found = cm.find_longest(comp, _FakeRunner(1000, failure), comp.methods[0])
    assert found["longest"] == 960 and found["bound"].startswith(bound)
    assert ("not a memory one" in found["bound"]) == (failure == TIMEOUT)
    tiny = _comparison(tmp_path, find_max_start=64, timeout_s=60.0)
    found = cm.find_longest(tiny, _FakeRunner(10, failure), tiny.methods[0])
    fails = "fails" if failure == OOM else "ran past --job-timeout-s 60"
    assert found["longest"] is None and found["bound"].startswith(f"64 {fails}")


def test_the_bound_from_the_grid_keeps_its_status(tmp_path):
    known = [
        {"method": "none", "seq_length": 128, "status": OK},
        {"method": "none", "seq_length": 512, "status": TIMEOUT},
    ]
    # 512 ran out of time, every shorter length trains: the bound is the time limit
    runner = _FakeRunner(10**6, known=known)
    found = cm.find_longest(_comparison(tmp_path, timeout_s=60.0), runner, parse_method("none"))
    assert found["longest"] == 448 and found["bound"].startswith("512 ran past --job-timeout-s 60")
    # below the timeout, 320 runs out of memory: that is the bound
    found = cm.find_longest(
        _comparison(tmp_path), _FakeRunner(300, known=known), parse_method("none")
    )
    assert found == {"longest": 256, "bound": "320 does not train"}


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

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(network, "installed", lambda module: module in installed)
    monkeypatch.setattr(network, "flash_attn_imports", lambda: "flash_attn" in installed)
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


def _script_argv(tmp_path, script: str, *extra: str) -> list[str]:
    """What ``scripts/SCRIPT`` passes to ``python -m tools.compare_methods``: the script runs
    with ``python`` on the PATH standing in, which writes its arguments down and exits."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_FILE"\n')
    python.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "ARGV_FILE": str(tmp_path / "argv"),
        "OUT": str(tmp_path / "out"),
    }
    subprocess.run(["bash", str(ROOT / "scripts" / script), *extra], env=env, check=True)
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[:2] == ["-m", "tools.compare_methods"]
    return argv[2:]


def _resolve_on_gpus(monkeypatch, argv: list[str]) -> cm.Comparison:
    """``compare_methods``' own resolution of ``argv``, as on an H100 node (no kernels timed;
    the trainer's parser accepts --bf16 only where CUDA is)."""
    import torch

    from memo_ext.hardware import device_spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpus = (device_spec("h100-80g"), True, None, [])
    monkeypatch.setattr(cm, "_device", lambda args, model, launch: gpus)
    own, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    return cm.resolve(cm.build_parser().parse_args(own), extra)


@pytest.mark.parametrize(("extra", "chunks"), [((), 16), (("--loss-chunks", "4"), 4)])
def test_the_7b_script_runs_and_predicts_with_the_papers_loss_chunks(
    tmp_path, monkeypatch, extra, chunks
):
    """The paper's 7B figures, and the estimator fitted to them, have the loss over 16 slices;
    with the whole-sequence loss its logits would cap every method's length. Every job and
    every prediction of the script gets the 16 (a flag given to the script overrides it)."""
    comp = _resolve_on_gpus(monkeypatch, _script_argv(tmp_path, "compare_7b_8gpu.sh", *extra))
    assert comp.loss_chunks == chunks and comp.efficiency.loss_chunks == chunks
    assert [m.label for m in comp.methods] == ["full@tp8", "full@tp4cp2", "memo@tp8"]
    for method in comp.methods:
        argv = comparison.job_argv(comp, method, 65536, metrics=tmp_path / "m.jsonl", job_id="x")
        trainer_args = argv[argv.index(comparison.TRAINER) + 1 :]
        run = parse_args(trainer_args, world_size=comp.launch.world_size)
        assert run.model.loss_chunks == chunks


def _host_memory_refusals() -> list[str]:
    """The sentences MEMO refuses a length with for its host budget, raised by the code that
    raises them."""
    from memo_ext.memo.alpha import HostMemoryError, LayerCost, skeleton_layers, solve_alpha
    from memo_ext.memo.transfer import HostPool

    gib = 2**30
    refusals = [
        lambda: solve_alpha(
            LayerCost(full_bytes=gib, tokenwise_bytes=gib), budget_bytes=gib, resident_layers=4
        ),
        lambda: skeleton_layers(
            LayerCost(full_bytes=gib, tokenwise_bytes=0), budget_bytes=gib // 2, offloaded_layers=2
        ),
        lambda: HostPool(budget_bytes=1, pin_memory=False).acquire(4096),
    ]
    sentences = []
    for refuse in refusals:
        with pytest.raises(HostMemoryError) as err:
            refuse()
        sentences.append(str(err.value))
    return sentences


class _ExitingRunner(_FakeRunner):
    """Trains the lengths up to ``longest``; a longer job exits with ``code`` after printing
    ``sentence`` as the launcher prints a failed rank's, and is classified as a real job is."""

    def __init__(self, longest: int, *, code: int, sentence: str) -> None:
        super().__init__(longest)
        self.code, self.sentence = code, sentence

    def run(self, method, seq: int) -> dict:
        self.calls.append(seq)
        if seq <= self.longest:
            return {"status": OK, "message": ""}
        output = f"noise\npretrain_gpt_memo.py: rank 0 failed: {self.sentence}\n"
        outcome = _classify(self.code, output, timed_out=False)
        return {"status": outcome.status, "message": outcome.message}


@pytest.mark.parametrize("sentence", _host_memory_refusals())
def test_a_host_memory_refusal_narrows_the_search_as_out_of_memory_does(tmp_path, sentence):
    """MEMO's limit at long lengths can be its host budget (exit status 2, as bad input): a
    shorter length needs less host memory, so the search bisects below it instead of stopping
    at the last length that trained."""
    comp = _comparison(tmp_path, find_max_start=256)
    runner = _ExitingRunner(1000, code=UsageError.exit_status, sentence=sentence)
    found = cm.find_longest(comp, runner, comp.methods[1])
    assert found == {"longest": 960, "bound": "1,024 does not train"}  # 960 = 1000 // 64 * 64
    assert len(runner.calls) == len(set(runner.calls)), "a length ran twice"


def test_other_refusals_still_stop_the_search(tmp_path):
    """Bad input fails at every length: bisecting would only rerun it."""
    comp = _comparison(tmp_path, find_max_start=256)
    sentence = "--memo-alpha must be in [0, 1], got 1.5"
    runner = _ExitingRunner(1000, code=UsageError.exit_status, sentence=sentence)
    found = cm.find_longest(comp, runner, comp.methods[1])
    assert found["longest"] == 512 and found["bound"].endswith(f"failed: {sentence}")
    assert runner.calls == [256, 512, 1024]


_FLASH_ATTN_STAND_INS = {
    # a wheel built for another torch: found, but its extension does not load
    "broken": {
        "flash_attn/__init__.py": "from flash_attn.flash_attn_interface import flash_attn_func\n",
        "flash_attn/flash_attn_interface.py": "import flash_attn_2_cuda\n",
        "flash_attn_2_cuda.py": 'raise ImportError("flash_attn_2_cuda.so: undefined symbol: '
        '_ZN3c104cuda9SetDeviceEi")\n',
    },
    "without flash_attn_func": {"flash_attn/__init__.py": '__version__ = "2.6.3"\n'},
    "working": {
        "flash_attn/__init__.py": "def flash_attn_func(q, k, v, dropout_p=0.0, **kw):\n"
        "    return q\n",
    },
}


@pytest.fixture
def flash_attn_on_path(tmp_path, monkeypatch):
    """``put(name)``: a stand-in ``flash_attn`` (:data:`_FLASH_ATTN_STAND_INS`) first on
    ``sys.path``, on a machine that says it has CUDA; the imports are forgotten afterwards."""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_2_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    def put(name: str) -> None:
        for path, source in _FLASH_ATTN_STAND_INS[name].items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))

    yield put
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_2_cuda"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("stand_in", "expect"),
    [("broken", "sdpa"), ("without flash_attn_func", "sdpa"), ("working", "flash")],
)
def test_auto_attention_takes_flash_attn_only_when_it_imports(flash_attn_on_path, stand_in, expect):
    """A flash-attn that is found but does not import would be chosen for every job, each of
    which would die at its first attention call."""
    from memo_ext.config.network import resolve_attention_backend

    flash_attn_on_path(stand_in)
    assert resolve_attention_backend("auto", allow_te=False) == expect
    flags, backend = cm._one_attention_backend(["--bf16"], [cm.parse_method("memo")])
    assert backend == expect and flags == ["--bf16", "--attention-backend", expect]


def test_asking_for_a_flash_attn_that_does_not_import_is_refused(flash_attn_on_path):
    from memo_ext.config.network import resolve_attention_backend

    flash_attn_on_path("broken")
    with pytest.raises(ValueError, match="flash_attn is installed but does not import"):
        resolve_attention_backend("flash")


def test_a_failing_estimator_leaves_the_run_recorded(tmp_path, monkeypatch, caplog):
    """A prediction is a side figure: an estimator that raises (any error, not only a refusal)
    gives a record with the error, and the comparison goes on to its next job."""
    from memo_ext.compare import comparison

    def broken(*args, **kwargs):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(comparison, "estimate_configuration", broken)
    monkeypatch.setattr(comparison, "trace_layer", broken, raising=False)
    comp = _comparison(tmp_path)
    method = comp.methods[0]
    predicted = comparison.predict(comp, method, 128)
    assert predicted["step_time_s"] is None
    assert predicted["error"] == (
        "the estimator failed: RuntimeError: Expected all tensors to be on the same device"
    )
    assert "no prediction for none @ 128" in caplog.text


@pytest.mark.parametrize(
    "text, match",
    [
        ("[1, 2]", "compare.json holds a list, not an object; remove it to start over"),
        ('{"format": ', "compare.json is cut short"),
    ],
)
def test_a_damaged_compare_json_is_one_sentence(tmp_path, text, match):
    from memo_ext.compare.runs import Results
    from memo_ext.errors import UsageError

    (tmp_path / "compare.json").write_text(text)
    with pytest.raises(UsageError, match=match):
        Results(_comparison(tmp_path))


def test_damaged_run_records_in_a_matching_compare_json_are_named(tmp_path):
    from memo_ext.compare.runs import FORMAT, Results, _jsonable
    from memo_ext.errors import UsageError

    comp = _comparison(tmp_path)
    doc = {"format": FORMAT, "signature": _jsonable(comp.signature()), "runs": ["not a record"]}
    (tmp_path / "compare.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="holds damaged run records; remove it to start over"):
        Results(comp)


def test_a_memo_that_would_offload_no_layer_is_refused_before_any_job(tmp_path):
    """Two layers and MEMO's default two kept last layers: one sentence, exit 2, no job."""
    from memo_ext.commands import compare_methods as tool

    argv = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "256", "--methods", "full", "memo", "--seq-lengths", "128",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    with pytest.raises(UsageError, match=r"--methods memo: --memo would offload no layer"):
        tool.resolve(tool.build_parser().parse_args(argv), [])
    fine = tool.resolve(tool.build_parser().parse_args([*argv, "--memo-keep-last-layers", "1"]), [])
    assert [m.label for m in fine.methods] == ["full", "memo"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "fixed", "says"),
    [
        ("memo", {}, None),
        ("memo:alpha=0.5", {"alpha": 0.5}, None),
        ("memo:alpha=auto,rule=tokenwise", {}, None),
        ("full", {}, None),
        ("full:alpha=1", None, "full takes no settings"),
        ("memo@tp8", None, "no @LAYOUT here"),
        ("memo:alpha=2", None, "alpha must be in [0, 1]"),
        ("memo:beta=1", None, "memo takes alpha, rule, not beta"),
        ("fast", None, "--method must be one of none, full, selective, memo"),
    ],
)
def test_memo_estimate_reads_a_method_as_memo_compare_does(text, fixed, says):
    """``memo-estimate --method`` takes the spelling with settings; the method reads them."""
    from memo_ext.commands.estimate import method_of

    if says is None:
        method, got = method_of(text)
        assert method.name == text.partition(":")[0] and got == fixed
    else:
        with pytest.raises(UsageError, match=re.escape(says)):
            method_of(text)
