"""The README's flag reference is the trainer's, its metrics table the documented keys', and its
two quick-start commands stay."""

from __future__ import annotations

from memo_ext.arguments import build_parser
from memo_ext.training.metric_keys import metrics_table
from tools.flag_reference import METRICS_BEGIN, METRICS_END, README, flag_tables, readme_section


def test_flag_reference_matches_the_parser():
    # regenerate with: python -m tools.flag_reference --update
    assert readme_section(README.read_text()) == flag_tables(build_parser()).strip("\n")


def test_metrics_table_matches_the_documented_keys():
    # regenerate with: python -m tools.flag_reference --update
    assert readme_section(README.read_text(), METRICS_BEGIN, METRICS_END) == metrics_table()


def test_every_flag_has_help():
    missing = [
        a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help
    ]
    assert not missing


def test_quick_start_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


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
