"""MEMO's flags, their checks, and the α rule."""

from __future__ import annotations

import argparse

import pytest

from memo_ext.config import MemoConfig
from memo_ext.errors import UsageError
from memo_ext.flags import add_flags, from_flags
from memo_ext.hardware import GIB
from memo_ext.memo.alpha import HostMemoryError, LayerCost, solve_alpha
from memo_ext.memo.transfer import host_budget_bytes
from tests.launch import cli


def parse(argv: list[str]) -> MemoConfig:
    """MEMO's flags as the trainer generates them."""
    parser = argparse.ArgumentParser()
    add_flags(parser, MemoConfig, section="memo")
    return from_flags(MemoConfig, parser.parse_args(argv), section="memo")


def check(config: MemoConfig, **rest) -> MemoConfig:
    """MEMO's own checks, and the ones against the rest of the run (as RunConfig.check)."""
    config.check()
    if config.enabled:
        others = dict(hidden_dropout=0.0, recompute_granularity=None, attention_backend="sdpa")
        config.check_combination(**{**others, **rest})
    return config


def test_defaults_and_values():
    config = check(parse(["--memo"]))
    assert config == MemoConfig(enabled=True, alpha=None, host_memory_gb=None)
    assert config.auto_alpha
    assert config.kept_layers == 2 and config.chunk_tokens is None
    config = parse(
        cli(memo=True, memo_alpha="0.3", memo_host_memory_gb=12, memo_keep_last_layers=0)
    )
    check(config)
    assert (config.alpha, config.host_memory_gb, config.keep_last_layers) == (0.3, 12.0, 0)
    assert host_budget_bytes(config) == 12 * GIB
    assert parse(["--memo", "--memo-alpha", "auto"]).alpha is None
    assert not parse([]).enabled


def test_default_budget_shares_available_memory(monkeypatch):
    monkeypatch.setattr("memo_ext.memo.transfer.available_host_memory_bytes", lambda: 100 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_budget_bytes(MemoConfig(enabled=True)) == int(100 * GIB * 0.8 / 4)


@pytest.mark.parametrize(
    "argv, rest, message",
    [
        (["--memo", "--memo-alpha", "1.5"], {}, r"--memo-alpha must be in \[0, 1\]"),
        (["--memo", "--memo-host-memory-gb", "0"], {}, "must be positive"),
        (["--memo", "--memo-keep-last-layers", "-1"], {}, ">= 0"),
        (["--memo-alpha", "0.5"], {}, "only applies with --memo"),
        (["--memo"], dict(hidden_dropout=0.1), "hidden-dropout"),
        (["--memo"], dict(recompute_granularity="full"), "recompute-granularity"),
        (["--memo"], dict(attention_backend="te"), "attention-backend sdpa or flash"),
        (["--memo-offload-rule", "mine"], {}, "only applies with --memo"),
        (
            ["--memo", "--memo-offload-rule", "mine", "--memo-chunk-tokens", "64"],
            {},
            "--memo-offload-rule mine places the saves of layers that run whole",
        ),
    ],
)
def test_refusals_are_one_sentence(argv, rest, message):
    with pytest.raises(UsageError, match=message) as err:
        check(parse(argv), **rest)
    assert "\n" not in str(err.value)


def test_alpha_flag_rejects_words():
    with pytest.raises(SystemExit):
        parse(["--memo", "--memo-alpha", "half"])


def test_solve_alpha_hides_copies_under_the_forward():
    # 1 GB/s for 10 ms hides 10 MB: 4 MB whole + α · 12 MB → α = 0.5
    cost = LayerCost(full_bytes=4_000_000, tokenwise_bytes=12_000_000, forward_s=0.01, copy_gbps=1)
    assert solve_alpha(cost, budget_bytes=10**12, resident_layers=30) == pytest.approx(0.5)
    # a faster link hides everything
    cost.copy_gbps = 10
    assert solve_alpha(cost, budget_bytes=10**12, resident_layers=30) == 1.0
    # a link too slow even for the whole tensors: α = 0 (still correct, copies just show)
    cost.copy_gbps = 0.1
    assert solve_alpha(cost, budget_bytes=10**12, resident_layers=30) == 0.0


def test_solve_alpha_fits_the_budget():
    cost = LayerCost(full_bytes=100, tokenwise_bytes=400)
    # 10 layers, 2,000 bytes: 200 per layer, 100 whole → α = 0.25
    assert solve_alpha(cost, budget_bytes=2000, resident_layers=10) == pytest.approx(0.25)
    assert solve_alpha(cost, budget_bytes=2000, resident_layers=0) == 1.0
    with pytest.raises(HostMemoryError, match="even at α = 0"):
        solve_alpha(cost, budget_bytes=999, resident_layers=10)


def test_alpha_leaves_room_for_the_pinned_buffers_pages():
    """A budget filled to the byte by the buffers' sizes overflowed by their page rounding: a
    7B run at 672K tokens on 8 A800s solved α = 0.678 for exactly 240 GiB, then its pool (which
    counts whole pinned pages) refused the last layer's buffers in the first step."""
    from memo_ext.memo.alpha import LayerCost, solve_alpha

    full, tokenwise, layers, pages = 1_354 * 2**20, 10_081 * 2**20, 30, 21 * 4096
    budget = layers * (full + tokenwise // 2)  # α = 0.5 by the sizes alone, to the byte
    sizes_only = solve_alpha(LayerCost(full, tokenwise), budget_bytes=budget,
                             resident_layers=layers)  # fmt: skip
    rounded = solve_alpha(LayerCost(full, tokenwise, rounding_bytes=pages), budget_bytes=budget,
                          resident_layers=layers)  # fmt: skip
    assert sizes_only == pytest.approx(0.5)
    assert rounded < sizes_only
    assert layers * (full + rounded * tokenwise + pages) <= budget


def test_a_layer_counts_the_host_buffers_it_takes():
    """One buffer per whole storage, needed attention input and token-wise payload, as the
    forward's end takes them (none of the token-wise ones at α = 0)."""
    from types import SimpleNamespace

    from memo_ext.memo.activations import LayerActivations, Role

    acts = LayerActivations.__new__(LayerActivations)  # the record's fields, not a layer's run
    acts.full_storages = {1: 10, 2: 20}
    acts.attention_inputs = [SimpleNamespace(needed=True), SimpleNamespace(needed=False)]
    acts.payloads = [SimpleNamespace(role=Role.TOKENWISE), SimpleNamespace(role=Role.SMALL),
                     SimpleNamespace(role=Role.TOKENWISE)]  # fmt: skip
    acts.host_tokens = 5
    assert acts.host_buffer_count() == 2 + 1 + 2
    assert acts.host_buffer_count(0) == 2
