"""The traced figures' disk cache: a hit traces nothing, any changed input misses, a damaged
file is traced again, writers at the same time leave a whole file, and off means off."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
from pathlib import Path

import pytest

from memo_ext.estimate import fragmentation, measure, trace_cache
from memo_ext.estimate.stage import MemoryMethod
from memo_ext.features.registry import memory_method, traced
from tests.models import GPT_SMALL


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, and the tracers' in-process caches emptied around it."""
    folder = tmp_path / "traces"
    monkeypatch.setenv(trace_cache.ENV, str(folder))
    _forget()
    yield folder
    _forget()


def _forget() -> None:
    for fn in (
        measure._layer_figures,
        measure.layer_max_live_bytes,
        measure.loss_max_live_bytes,
        fragmentation.iteration_fit,
    ):
        fn.cache_clear()


def _files(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _counting(value):
    calls = []

    def compute():
        calls.append(1)
        return value

    return calls, compute


def _get(compute, **call):
    return trace_cache.cached("test", call, compute, encode=lambda v: v, decode=lambda v: v)


def test_a_hit_returns_the_traced_figures_without_tracing(monkeypatch, cache):
    layer = traced("memo-0.5")
    kw = dict(tp=2, sp=True, tokens=512, micro_batch_size=1, **layer)
    first = measure.trace_layer(GPT_SMALL, **kw)
    assert len(_files(cache / "layer")) == 1

    def no_trace(*args, **kwargs):
        raise AssertionError("traced although the figures were on disk")

    monkeypatch.setattr(measure, "_trace_layer", no_trace)
    _forget()
    assert measure.trace_layer(GPT_SMALL, **kw) == first


def test_sp_without_tp_is_one_trace(monkeypatch, cache):
    a = measure.trace_layer(GPT_SMALL, tp=1, sp=True, tokens=256, micro_batch_size=1)
    monkeypatch.setattr(measure, "_trace_layer", None)  # a second trace would fail
    assert measure.trace_layer(GPT_SMALL, tp=1, sp=False, tokens=256, micro_batch_size=1) == a


def test_the_output_ends_and_iterations_come_back_equal(monkeypatch):
    kw = dict(tp=2, sp=True, tokens=512, micro_batch_size=1)
    live = (
        measure.layer_max_live_bytes(GPT_SMALL, **kw),
        measure.loss_max_live_bytes(GPT_SMALL, **kw),
    )
    fit_kw = dict(tp=2, sp=True, method=memory_method("full"), layers=2, loss=True)
    fit = fragmentation.iteration_fit(GPT_SMALL, **fit_kw)
    for name in ("trace_transformer_layer", "trace_module"):
        monkeypatch.setattr("memo_ext.planner.capture." + name, None)
    monkeypatch.setattr(fragmentation, "_trace", None)
    _forget()
    assert (
        measure.layer_max_live_bytes(GPT_SMALL, **kw),
        measure.loss_max_live_bytes(GPT_SMALL, **kw),
    ) == live
    assert fragmentation.iteration_fit(GPT_SMALL, **fit_kw) == fit


def test_every_input_is_in_the_key():
    calls, compute = _counting({"bytes": 1})
    _get(compute, tokens=512, tp=2)
    _get(compute, tokens=512, tp=2)
    assert len(calls) == 1
    _get(compute, tokens=1024, tp=2)
    _get(compute, tokens=512, tp=4)
    assert len(calls) == 3


def test_the_code_and_library_versions_are_in_the_key(monkeypatch):
    calls, compute = _counting(7)
    _get(compute, tokens=1)
    code = dict(trace_cache.code_key())
    monkeypatch.setattr(trace_cache, "code_key", lambda: {**code, "sources": "edited"})
    _get(compute, tokens=1)
    monkeypatch.setattr(trace_cache, "code_key", lambda: {**code, "torch": "0.0"})
    _get(compute, tokens=1)
    assert len(calls) == 3


def test_the_digest_follows_the_traced_sources_only(tmp_path, monkeypatch):
    package = tmp_path / "memo_ext"
    (package / "estimate").mkdir(parents=True)
    (package / "commands").mkdir()
    (package / "estimate" / "trace_cache.py").write_text("")
    (package / "estimate" / "measure.py").write_text("a = 1\n")
    (package / "commands" / "estimate.py").write_text("b = 1\n")
    monkeypatch.setattr(trace_cache, "__file__", str(package / "estimate" / "trace_cache.py"))
    digest = trace_cache.package_digest()
    (package / "commands" / "estimate.py").write_text("b = 2\n")
    assert trace_cache.package_digest() == digest
    (package / "estimate" / "measure.py").write_text("a = 2\n")
    assert trace_cache.package_digest() != digest


class _Plain(MemoryMethod):
    name = "plain"

    def price(self, ctx):
        raise NotImplementedError

    def selected_by(self, run):
        return False


class _Lookalike(_Plain):
    """Another method under the same name (a plugin's, say)."""


def test_a_method_of_another_class_never_takes_anothers_figures():
    calls, compute = _counting(1)
    for method in (_Plain(), _Lookalike(), _Plain()):
        trace_cache.cached(
            "test", {}, compute, encode=int, decode=int, method=method, settings=None
        )
    assert len(calls) == 2
    full = trace_cache.full_key("test", {}, method=_Lookalike(), settings=None)
    assert full["method"]["class"].endswith("_Lookalike")
    assert __name__ in full["outside"]  # a method from outside the package: its source too


def test_a_key_without_a_stable_form_is_not_cached():
    calls, compute = _counting(1)
    for _ in range(2):
        trace_cache.cached(
            "test", {}, compute, encode=int, decode=int, method=_Plain(), settings=object()
        )
    assert len(calls) == 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2].encode(),
        lambda text: b"\x00\xff",
        lambda text: json.dumps({"key": "another", "value": 1}).encode(),
        lambda text: text.replace('"value": {"bytes": 1}', '"value": {"bytes": "x"}').encode(),
    ],
)
def test_a_damaged_file_is_traced_again(cache, damage):
    def decode(value):
        if not isinstance(value["bytes"], int):
            raise TypeError(value)
        return value

    calls, compute = _counting({"bytes": 1})
    get = lambda: trace_cache.cached("test", {"t": 1}, compute, encode=dict, decode=decode)  # noqa: E731
    get()
    (path,) = _files(cache)
    path.write_bytes(damage(path.read_text()))
    assert get() == {"bytes": 1}
    assert len(calls) == 2
    assert get() == {"bytes": 1} and len(calls) == 2  # written again, whole


def test_off_reads_and_writes_nothing(monkeypatch, cache):
    monkeypatch.setenv(trace_cache.ENV, "off")
    calls, compute = _counting(3)
    _get(compute, t=1)
    _get(compute, t=1)
    assert len(calls) == 2 and not cache.exists()


def test_a_folder_that_cannot_be_written_is_no_error(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(trace_cache.ENV, str(blocker / "below"))
    calls, compute = _counting(5)
    assert _get(compute, t=1) == 5 and _get(compute, t=1) == 5 and len(calls) == 2


def _writer(folder: str, rounds: int) -> list[bool]:
    """Asks for one large value ``rounds`` times, deleting its file every other time so that
    the writers keep writing it over each other."""
    os.environ[trace_cache.ENV] = folder
    big = list(range(20_000))  # long enough that a torn write would show
    seen = []
    for k in range(rounds):
        value = trace_cache.cached("race", {"k": 1}, lambda: big, encode=list, decode=list)
        seen.append(value == big)
        if k % 2:
            for path in Path(folder, "race").glob("*.json"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    return seen


def test_writers_at_the_same_time_leave_a_whole_file(cache):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        seen = pool.starmap(_writer, [(str(cache), 15)] * 3)
    assert all(all(run) for run in seen)
    assert _writer(str(cache), 1) == [True]
    (path,) = _files(cache)
    assert len(json.loads(path.read_text())["value"]) == 20_000


def test_the_real_cache_folder_is_under_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv(trace_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert trace_cache.folder() == tmp_path / "memo_ext" / "estimate"
    monkeypatch.setenv(trace_cache.ENV, "0")
    assert trace_cache.folder() is None


def test_the_memo_settings_name_the_key():
    memo = memory_method("memo")
    a, b = (memo.traced_layer(x, chunk_tokens=4096) for x in (0.0, 1.0))
    keys = [trace_cache.full_key("t", {}, method=memo, settings=s) for s in (a, b)]
    assert keys[0]["method"]["traced"] == "memo-0@4096" and keys[0] != keys[1]
