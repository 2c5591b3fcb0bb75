"""``memo_ext.benchmarks.hotspa_strategies``: the length spec language, the CommonCrawl fit,
cutting at the context, the HotSPa artifact's layouts, and a ``--quick --check`` run end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from memo_ext.benchmarks.hotspa_strategies import (
    ARTIFACT_MODELS,
    HOTSPA_ARTIFACT_LAYOUTS,
    STRATEGIES,
    NotInArtifact,
    artifact_buckets,
    artifact_layouts,
    artifact_row,
    benchmark_model,
    check_summary,
    main,
)
from memo_ext.data.lengths import (
    BUILTIN_SPECS,
    COMMONCRAWL_SIGMA,
    SpecError,
    cut_to_context,
    parse_named_spec,
    parse_spec,
    read_lengths_file,
)
from memo_ext.features.hotspa.auto import BucketStats
from memo_ext.hardware import device_spec


def test_spec_components_weights_and_argument_forms():
    mix = parse_spec(" 0.7 * lognormal(median=300, sigma=1.3) + 0.3*uniform(8192,32768) ")
    assert mix.weights == pytest.approx((0.7, 0.3))
    assert [c.kind for c in mix.components] == ["lognormal", "uniform"]
    assert mix.components[0].params == (300, 1.3)
    assert mix.components[1].params == (8192, 32768)
    # named out of order, positional, scientific notation; an omitted weight is 1 (relative)
    mix = parse_spec("3*pareto(alpha=1.5, xm=8e3)+lognormal(1000,0)")
    assert mix.weights == pytest.approx((0.75, 0.25))
    assert mix.components[0].params == (8000, 1.5)
    # the printed form parses back to the same mixture
    assert parse_spec(str(mix)) == mix


def test_spec_samples_follow_their_components():
    lengths = parse_spec("uniform(5,5)").sample_lengths(1000, seed=0)
    assert set(lengths.tolist()) == {5}
    # sigma 0: every draw is the median
    assert set(parse_spec("lognormal(median=777,sigma=0)").sample_lengths(50, seed=0)) == {777}
    # Pareto: never below xm, and P(> 2 xm) = 2^-alpha (binomial s.d. at 20,000 draws: 0.0035)
    pareto = parse_spec("pareto(xm=1000,alpha=2)").sample_lengths(20000, seed=1)
    assert pareto.min() >= 1000
    assert np.mean(pareto > 2000) == pytest.approx(0.25, abs=0.015)
    # mixture weights: 0.2 of draws from the short component (s.d. 0.004 at 10,000 draws)
    mix = parse_spec("0.2*uniform(1,10)+0.8*uniform(100,200)").sample_lengths(10000, seed=2)
    assert np.mean(mix <= 10) == pytest.approx(0.2, abs=0.02)
    assert mix.min() >= 1


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("normal(300,1)", "unknown component 'normal'"),
        ("lognormal(300)", "takes 2 parameters"),
        ("lognormal(median=300,scale=2)", "no parameter 'scale'"),
        ("lognormal(median=300,median=2)", "median twice"),
        ("lognormal(median=-3,sigma=1)", "needs median > 0"),
        ("pareto(xm=100,alpha=0)", "needs xm > 0 and alpha > 0"),
        ("uniform(100,10)", "needs 1 <= lo <= hi"),
        ("0*uniform(1,2)", "must be positive"),
        ("uniform(1,2)+", "expected a component"),
        ("lognormal median=3", "expected '\\('"),
        ("uniform(1,2", "expected ',' or '\\)'"),
        ("uniform(1,2) uniform(3,4)", "unexpected 'uniform'"),
        ("uniform(1;2)", "unexpected ';2\\)'"),
        ("   ", "the spec is empty"),
    ],
)
def test_bad_specs_are_one_sentence(spec, match):
    with pytest.raises(SpecError, match=match) as err:
        parse_spec(spec)
    assert "\n" not in str(err.value)


def test_named_specs():
    name, mix = parse_named_spec("web=lognormal(300,1.27)")
    assert name == "web" and mix.components[0].params == (300, 1.27)
    for text in ("lognormal(300,1.27)", "=uniform(1,2)", "a b=uniform(1,2)"):
        with pytest.raises(SpecError, match="must be NAME=SPEC"):
            parse_named_spec(text)


def test_commoncrawl_fit():
    # σ = ln(4096 / 300) / z_0.98, computed by hand
    sigma = COMMONCRAWL_SIGMA
    assert sigma == pytest.approx(2.61400 / 2.05375, rel=1e-4)
    lengths = parse_spec(BUILTIN_SPECS["commoncrawl"]).sample_lengths(200_000, seed=3)
    # sampling noise at 200,000 draws: the median's s.e. is about 0.3%, the 98% share's 0.03 pt;
    # rounding to whole tokens moves neither visibly
    assert np.median(lengths) == pytest.approx(300, rel=0.02)
    assert np.mean(lengths <= 4096) == pytest.approx(0.98, abs=0.002)


def test_github_is_longer_and_control_is_long():
    github = parse_spec(BUILTIN_SPECS["github"]).sample_lengths(50_000, seed=4)
    web = parse_spec(BUILTIN_SPECS["commoncrawl"]).sample_lengths(50_000, seed=4)
    assert np.median(github) > 2 * np.median(web)
    assert np.percentile(github, 98) > 4 * np.percentile(web, 98)
    control = parse_spec(BUILTIN_SPECS["control"]).sample_lengths(10_000, seed=4)
    assert control.min() >= 16384 and control.max() <= 32768


def test_cut_to_context_keeps_every_token():
    lengths = np.array([10, 32768, 32769, 70000, 1])
    pieces = cut_to_context(lengths, 32768)
    # 32769 → 32768 + 1; 70000 → 2 × 32768 + 4464
    assert sorted(pieces.tolist()) == sorted([10, 32768, 32768, 1, 32768, 32768, 4464, 1])
    assert pieces.sum() == lengths.sum() and pieces.max() <= 32768 and pieces.min() >= 1
    rng = np.random.default_rng(5)
    many = rng.integers(1, 10**6, size=1000)
    cut = cut_to_context(many, 4096)
    assert cut.sum() == many.sum() and cut.max() <= 4096
    assert len(cut) == sum(math.ceil(n / 4096) for n in many.tolist())


def test_lengths_file(tmp_path):
    good = tmp_path / "corpus.txt"
    good.write_text("12\n\n40000\n 7 \n")
    assert read_lengths_file(str(good)).tolist() == [12, 40000, 7]
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n3.5\n")
    with pytest.raises(SpecError, match="line 2: '3.5' is not a positive integer"):
        read_lengths_file(str(bad))
    with pytest.raises(SpecError, match="cannot read it"):
        read_lengths_file(str(tmp_path / "missing.txt"))


def _triples(key):
    _, layouts = artifact_buckets(*HOTSPA_ARTIFACT_LAYOUTS[key])
    return [(x.dp, x.tp, x.pp) for x in layouts]


def test_artifact_layouts_go_to_the_buckets_the_artifact_trains_them_on():
    # the HotSPa artifact's CommonCrawl 32K runs, as its authors' configs list them per bucket,
    # shortest first (stated by hand, not derived from the table)
    bounds, _ = artifact_buckets(*HOTSPA_ARTIFACT_LAYOUTS[("7b", 8, "c1", 32768)])
    assert bounds == [4096, 16384, 32768]
    assert _triples(("7b", 8, "c1", 32768)) == [(8, 1, 1), (2, 2, 2), (1, 4, 2)]
    assert _triples(("32b", 32, "c1", 32768)) == [(4, 2, 4), (2, 8, 2), (1, 16, 2)]
    assert _triples(("7b", 8, "c2", 32768)) == [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2)]


def test_artifact_table_is_consistent():
    # 5 model × GPU pairs, 2 combinations, 4 contexts; a transcription slip shows up here
    assert len(HOTSPA_ARTIFACT_LAYOUTS) == 40
    for (model, gpus, combination, context), row in HOTSPA_ARTIFACT_LAYOUTS.items():
        bounds, layouts = artifact_buckets(*row)
        assert bounds[-1] == context and len(layouts) == len(bounds)
        assert all(x.dp * x.tp * x.pp == gpus for x in layouts), (model, gpus, combination)
        # c1: 4K, 16K and the context; c2 adds 8K
        lower = (4096, 8192, 16384) if combination == "c2" else (4096, 16384)
        assert bounds == [b for b in lower if b < context] + [context]
        ours = benchmark_model({v: k for k, v in ARTIFACT_MODELS.items()}[model])
        for layout, length in zip(layouts, bounds):
            layout.check_fits(ours, length)  # heads, FFN and layers divide


def test_artifact_row_picks_by_buckets_and_says_why_not():
    assert artifact_row("llama-13b", gpus=16, bounds=[4096, 16384, 32768])[2] == "c1"
    assert artifact_row("llama-13b", gpus=16, bounds=[4096, 8192, 16384, 32768])[2] == "c2"
    with pytest.raises(NotInArtifact, match="only on 8, 16 GPUs"):
        artifact_row("llama-7b", gpus=32, bounds=[4096, 8192, 16384, 32768])
    with pytest.raises(NotInArtifact, match="its 32B is hotspa-32b"):
        artifact_row("llama-30b", gpus=32, bounds=[4096, 8192, 16384, 32768])
    with pytest.raises(NotInArtifact, match="buckets for llama-7b on 8 GPUs are"):
        artifact_row("llama-7b", gpus=8, bounds=[2048, 32768])


def test_artifact_tp16_is_priced_on_the_network():
    # the 32B's 32K bucket runs TP 16: two 8-GPU nodes, so its collectives cross the network;
    # the same layouts on a (hypothetical) 16-GPU node keep them on NVLink and run faster
    bounds = [4096, 16384, 32768]
    stats = [BucketStats(rows=r, attention_fraction=0.1) for r in (60.0, 2.0, 1.0)]
    price = dict(gpus=32, bounds=bounds, stats=stats, method="full")
    a800 = device_spec("a800-80g")
    two_nodes = artifact_layouts(benchmark_model("hotspa-32b"), a800, **price)
    one_node = artifact_layouts(
        benchmark_model("hotspa-32b"), device_spec("a800-80g", gpus_per_node=16), **price
    )
    assert [x.tp for x in two_nodes.layouts] == [2, 8, 16]
    assert two_nodes.choices[-1].compute_s > 1.5 * one_node.choices[-1].compute_s
    # the TP 2 and TP 8 buckets stay inside a node either way
    assert two_nodes.choices[1].compute_s == pytest.approx(one_node.choices[1].compute_s)


def test_check_fails_below_threshold():
    def workload(ratio, fits=True):
        key = dict(distribution="d", model="m", gpus=8, device="x")
        auto = {"fits_worst_step": fits}
        return {**key, "auto_vs_best_static": ratio, "strategies": {"auto": auto}}

    summary = check_summary([workload(1.0), workload(0.98), workload(None)])
    assert not summary["passed"] and summary["min_auto_vs_best_static"] == 0.98
    assert summary["checked"] == 2 and summary["worst_workload"] == "d m 8×x"
    summary = check_summary([workload(0.995), workload(None, fits=False)])
    assert summary["passed"] and summary["fit_on_mean_rows_only"] == ["d m 8×x auto"]


def test_bad_distribution_flag_exits_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--quick", "--distribution", "mix=gauss(1,2)"])
    assert exit_info.value.code == 2
    assert "unknown component 'gauss'" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_check_end_to_end(tmp_path, capsys):
    out = tmp_path / "quick.json"
    argv = ["--quick", "--check", "--steps", "4", "--documents", "4000", "--json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert set(results["distributions"]) == {"commoncrawl", "control"}
    assert len(results["workloads"]) == 2
    for w in results["workloads"]:
        assert set(w["strategies"]) == set(STRATEGIES)
        assert "hotspa-artifact" in w["strategies"]
        # llama-7b on 8 GPUs at buckets 4K/8K/16K/32K: the artifact's combination c2
        # (llama_hot_switch.sh L146-148), DP × TP × PP per bucket, shortest first
        artifact = w["strategies"]["hotspa-artifact"]
        assert artifact["artifact"]["combination"] == "c2"
        assert artifact["artifact"]["dp_tp_pp"] == [[8, 1, 1], [4, 2, 1], [2, 2, 2], [1, 4, 2]]
        # priced as given, or (where it does not fit) priced again with memory no limit
        priced = artifact.get("ignoring_memory", artifact)
        assert [b["layout"] for b in priced["buckets"]] == [
            "dp8",
            "dp4tp2",
            "dp2tp2pp2",
            "dp1tp4pp2",
        ]
        assert priced["speedup_vs_packed_causal"] > 0
        auto, best = w["strategies"]["auto"], w["strategies"][w["best_static"]]
        assert w["auto_vs_best_static"] == pytest.approx(best["step_s"] / auto["step_s"])
        assert w["auto_vs_best_static"] >= 0.99
        packed = w["strategies"]["packed-causal"]
        assert packed["speedup_vs_packed_causal"] == 1.0
        # the busiest sampled step needs at least the memory of the mean one
        for record in w["strategies"].values():
            if record.get("fits_worst_step"):
                assert record["worst_step_peak_gib"] >= record["peak_gib"] - 1e-9
    by_name = {w["distribution"]: w for w in results["workloads"]}
    # control: no document shorter than 16K, so buckets cannot help
    assert by_name["control"]["auto_vs_best_static"] < 1.02
    # commoncrawl: per-document attention over packed rows beats causal attention over them
    assert by_name["commoncrawl"]["strategies"]["static"]["speedup_vs_packed_causal"] > 1.1
    summary = results["summary"]
    assert summary["passed"] and summary["checked"] == 2
    printed = capsys.readouterr()
    assert "| commoncrawl | llama-7b | 8 | a800-80g |" in printed.out
    assert "| paper-layouts | hotspa-artifact | auto |" in printed.out
    assert "auto / best static: min" in printed.out
    assert "[2/2] control" in printed.err
