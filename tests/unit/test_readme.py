"""The flag reference (docs/flags.md) is the trainer's, the metrics table (docs/metrics.md) the
documented keys', the README keeps its two quick-start commands and stays short."""

from __future__ import annotations

from memo_ext.arguments import build_parser
from memo_ext.training.metric_keys import metrics_table
from tools.flag_reference import (
    FLAGS_DOC,
    METRICS_BEGIN,
    METRICS_DOC,
    METRICS_END,
    flag_tables,
    readme_section,
)

README = FLAGS_DOC.parents[1] / "README.md"


def test_flag_reference_matches_the_parser():
    # regenerate with: python -m tools.flag_reference --update
    assert readme_section(FLAGS_DOC.read_text()) == flag_tables(build_parser()).strip("\n")


def test_metrics_table_matches_the_documented_keys():
    # regenerate with: python -m tools.flag_reference --update
    assert readme_section(METRICS_DOC.read_text(), METRICS_BEGIN, METRICS_END) == metrics_table()


def test_every_flag_has_help():
    missing = [
        a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help
    ]
    assert not missing


def test_quick_start_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_the_readme_stays_a_five_minute_read():
    # the detail lives in docs/; every page the README links to is there
    import re

    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (README.parent / link).exists(), link


def test_make_test_uses_every_core_under_an_exported_omp_num_threads():
    # `nproc` obeys OMP_NUM_THREADS; a cluster shell exporting 1 must not shrink the test run
    import os
    import re
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = subprocess.run(["nproc"], env=env, capture_output=True, text=True, check=True)
    dry = subprocess.run(
        ["make", "-n", "test"],
        cwd=README.parent,
        env={**env, "OMP_NUM_THREADS": "1", "JOBS": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    workers = re.findall(r"pytest .* -n (\d+) ", dry.stdout)
    assert workers and set(workers) == {cores.stdout.strip()}, dry.stdout
