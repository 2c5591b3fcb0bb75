"""HotSPa building blocks without processes: layouts, length buckets, switch plans, auto choice."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from memo_ext.config import parse_buckets
from memo_ext.data.documents import MockDocuments, global_batches
from memo_ext.estimate.cost_model import Efficiency
from memo_ext.features.hotspa.auto import (
    BucketStats,
    StrategyError,
    _estimate,
    bucket_statistics,
    candidate_layouts,
    choose_strategies,
    expected_rows,
)
from memo_ext.hardware import device_spec
from memo_ext.hotspa.buckets import bucket_rows, pack_buckets
from memo_ext.hotspa.switch import Shard, build_plan, element_count, merge_shards
from memo_ext.parallel import LayoutError, ParallelLayout, parse_layout, parse_strategies
from memo_ext.shapes import model_shape


def Layout(**sizes) -> ParallelLayout:
    """A HotSPa layout: SP on whenever TP > 1, as ``--hotspa-strategies`` makes them."""
    return ParallelLayout(**sizes, sp=sizes.get("tp", 1) > 1)


def check_layout(layout: ParallelLayout, *, config, bucket_length: int) -> None:
    layout.check_fits(config, bucket_length, length=f"the {bucket_length}-token bucket")


def test_parse_layouts_and_names():
    assert parse_layout("dp2tp2", 4) == Layout(dp=2, tp=2)
    assert parse_layout(" TP2PP2 ", 8) == Layout(dp=2, tp=2, pp=2)
    assert parse_layout("tp2pp2", 4) == Layout(dp=1, tp=2, pp=2)
    assert parse_layout("cp2", 8) == Layout(dp=4, cp=2)
    layouts = parse_strategies("dp4;dp2tp2;tp2pp2", 4)
    assert [lay.name for lay in layouts] == ["dp4", "dp2tp2", "dp1tp2pp2"]
    assert [lay.sp for lay in layouts] == [False, True, True]


@pytest.mark.parametrize(
    ("text", "world", "match"),
    [
        ("dp2xx2", 4, "not a product"),
        ("dp2 tp2", 4, "not a product"),
        ("", 4, "not a product"),
        ("dp2;", 2, "not a product"),
        ("dp2tp2dp1", 4, "dp twice"),
        ("dp0tp4", 4, "at least 1"),
        ("dp2tp2", 8, "uses 4 processes but the job has 8"),
        ("tp3", 8, "does not divide"),
        ("tp2pp3", 8, "does not divide"),
    ],
)
def test_parse_layout_errors(text, world, match):
    with pytest.raises(LayoutError, match=match):
        parse_strategies(text, world)


def test_coords_rank_round_trip():
    layout = Layout(dp=2, tp=2, pp=2)
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank(**c) == rank
        seen.add((c["tp"], c["cp"], c["dp"], c["pp"]))
    assert len(seen) == 8
    assert layout.coords(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert layout.coords(2) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert layout.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    with_cp = Layout(dp=2, tp=2, cp=2)
    assert with_cp.coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0}
    assert with_cp.rank(tp=1, cp=1, dp=1) == 7


def test_groups_in_megatron_order():
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.groups(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(("cp", "dp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups(("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups(("tp", "pp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with_cp = Layout(dp=2, tp=2, cp=2)
    assert with_cp.groups(("cp", "dp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert with_cp.groups(("tp", "cp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert with_cp.groups(("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("layout", [Layout(dp=2, tp=2, pp=2), Layout(dp=2, tp=2, cp=2, pp=2)])
def test_groups_match_hyper_comm_grid(layout, monkeypatch):
    pytest.importorskip("einops")
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", str(layout.world_size))
    grid = HyperCommGrid([layout.tp, layout.cp, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"])
    for dims in [
        ("tp",),
        ("cp",),
        ("dp",),
        ("pp",),
        ("cp", "dp"),
        ("tp", "cp"),
        ("tp", "pp"),
        ("tp", "cp", "dp"),
    ]:
        assert layout.groups(dims) == grid.get_rank_enum(list(dims)), dims


def _config(**overrides):
    base = dict(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64, num_layers=4)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(
    ("layout", "config", "length", "match"),
    [
        (Layout(tp=4), _config(num_attention_heads=6, num_query_groups=None), 64, "heads"),
        (Layout(tp=8), _config(), 64, r"query groups \(4\) not divisible by TP \(8\)"),
        (Layout(tp=4), _config(ffn_hidden_size=66), 64, r"FFN width \(66\)"),
        (Layout(pp=3), _config(), 64, r"layers \(4\) not divisible by PP \(3\)"),
        (Layout(tp=4), _config(), 66, r"\(66\) not divisible by TP \(sequence parallel\) \(4\)"),
        (Layout(cp=2), _config(), 66, r"sequence length \(66\) not divisible by 2 × CP \(4\)"),
    ],
)
def test_check_layout_errors(layout, config, length, match):
    with pytest.raises(LayoutError, match=match):
        check_layout(layout, config=config, bucket_length=length)


def test_check_layout_accepts_runnable_layouts():
    check_layout(Layout(dp=1, tp=4, pp=2, cp=2), config=_config(), bucket_length=64)
    # without SP (TP = 1) the length need not be a multiple of TP
    check_layout(Layout(dp=8), config=_config(), bucket_length=66)


def test_parse_buckets():
    assert parse_buckets("4096,16384,32768", seq_length=32768) == (4096, 16384, 32768)
    assert parse_buckets("32768", seq_length=32768) == (32768,)
    for text, match in [
        ("4096,abc", "comma-separated"),
        ("16384,4096", "ascending"),
        ("4096,4096,8192", "ascending"),
        ("1,8192", "2 or more"),
        ("4096,16384", "must equal --seq-length"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_buckets(text, seq_length=8192)


def test_bucket_rows_with_and_without_backfill():
    lengths = [3, 0, 8, 9, 16, 5, 9, 1]
    # every document in the smallest bucket that holds it, first-fit decreasing per bucket
    assert bucket_rows(lengths, [8, 16], backfill=False) == [[[2], [5, 0], [7]], [[4], [3], [6]]]
    # backfill: short documents fill the room long ones left before short rows open
    assert bucket_rows(lengths, [8, 16]) == [[[2]], [[4], [3, 5, 7], [6, 0]]]
    # slots round up to the row's pad multiple: 9 -> 12 leaves no room for 5 -> 8
    assert bucket_rows([9, 5], [8, 16], pad_multiples=[1, 4]) == [[[1]], [[0]]]
    assert bucket_rows([0, 0], [8, 16]) == [[], []]
    with pytest.raises(ValueError, match="17 tokens is longer than the last bucket"):
        bucket_rows([4, 17], [8, 16])


def _documents(lengths):
    return [np.arange(n, dtype=np.int64) + 1000 * (i + 1) for i, n in enumerate(lengths)]


def _split(micro_batch):
    """The documents of a packed row: slots start at ``cu_seqlens_padded``."""
    tokens = micro_batch["tokens"][0]
    starts = micro_batch["cu_seqlens_padded"][:-1].tolist()
    lengths = micro_batch["cu_seqlens"].diff().tolist()
    return [tuple(tokens[a : a + n].tolist()) for a, n in zip(starts, lengths) if n > 0]


@pytest.mark.parametrize("strategies", ["dp4;dp2tp2;tp2pp2", "dp4;dp2tp2;cp2tp2"])
def test_pack_buckets_across_layouts(strategies):
    bounds = [8, 16, 32]
    layouts = parse_strategies(strategies, 4)
    lengths = [3, 7, 0, 20, 5, 8, 2, 31, 1, 17, 4, 6, 32]  # nothing falls in (8, 16]
    documents = _documents(lengths)
    per_rank = [
        pack_buckets(documents, bounds=bounds, layouts=layouts, rank=r, backfill=False)
        for r in range(4)
    ]
    assert all([(bb.bucket, bb.length) for bb in bbs] == [(0, 8), (2, 32)] for bbs in per_rank)
    seen = []
    for k, b in enumerate([0, 2]):
        layout = layouts[b]
        batches = [per_rank[r][k] for r in range(4)]
        expected_lengths = sorted(n for n in lengths if 0 < n <= bounds[b] and n > [0, 8, 16][b])
        assert sorted(batches[0].document_lengths) == expected_lengths
        assert batches[0].labelled_tokens == sum(n - 1 for n in expected_lengths)
        assert len({len(bb.micro_batches) for bb in batches}) == 1, "same count on every rank"
        real_rows = 0
        for dp in range(layout.dp):
            ranks = [r for r in range(4) if layout.coords(r)["dp"] == dp]
            first = batches[ranks[0]].micro_batches
            for r in ranks[1:]:  # e.g. the TP ranks of one DP index see the same rows
                pairs = zip(first, batches[r].micro_batches, strict=True)
                assert all(torch.equal(x[key], y[key]) for x, y in pairs for key in x)
            for mb in first:
                assert mb["tokens"].shape == mb["loss_mask"].shape == (1, bounds[b])
                if int(mb["cu_seqlens"][-1]) == 0:
                    assert mb["loss_mask"].sum() == 0
                else:
                    real_rows += 1
                    assert mb["loss_mask"].sum() == sum(len(d) - 1 for d in _split(mb))
                    slots = mb["cu_seqlens_padded"].diff()
                    assert bool((slots % (2 * layout.cp if layout.cp > 1 else 1) == 0).all())
                seen.extend(_split(mb))
        assert real_rows == batches[0].rows
    assert sorted(seen) == sorted(tuple(d.tolist()) for d in documents if len(d))


def test_pack_buckets_single_document_and_padding():
    layouts = [Layout(dp=4), Layout(dp=2, tp=2)]
    documents = _documents([5, 12])
    for rank in range(4):
        short, long = pack_buckets(documents, bounds=[8, 16], layouts=layouts, rank=rank)
        assert (short.rows, long.rows) == (1, 1)
        assert long.document_lengths == [12] and long.labelled_tokens == 11
        assert len(short.micro_batches) == len(long.micro_batches) == 1
        holds_short = layouts[0].coords(rank)["dp"] == 0
        holds_long = layouts[1].coords(rank)["dp"] == 0
        assert _split(short.micro_batches[0]) == ([tuple(range(1000, 1005))] if holds_short else [])
        assert bool(long.micro_batches[0]["loss_mask"].sum()) == holds_long
    assert pack_buckets(_documents([0, 0]), bounds=[8, 16], layouts=layouts, rank=0) == []


REPLICATED = {"w": [Shard(0, 0, ((0, 8, 0),), 3), Shard(1, 0, ((0, 8, 0),), 3)]}
TP2 = {"w": [Shard(0, 0, ((0, 4, 0),), 3), Shard(1, 0, ((4, 4, 0),), 3)]}
GATED_TP2 = {"w": [Shard(0, 0, ((0, 2, 0), (4, 2, 2)), 3), Shard(1, 0, ((2, 2, 0), (6, 2, 2)), 3)]}


def _spans(pieces):
    return sorted((p.src, p.dst, p.src_start, p.dst_start, p.length) for p in pieces)


def test_replicated_and_tp2_hand_counts():
    for rank in range(2):
        plan = build_plan(REPLICATED, TP2, rank=rank, ranks_per_node=8)
        assert plan.sends == {} and plan.recvs == {}
        assert (plan.world_elements_moved, plan.world_elements_reused) == (0, 24)
        assert _spans(plan.local) == [(rank, rank, 4 * rank, 0, 4)]
    assert element_count(TP2) == element_count(REPLICATED) == 24
    plan = build_plan(TP2, REPLICATED, rank=0, ranks_per_node=8)
    assert (plan.world_elements_moved, plan.world_elements_reused) == (24, 24)
    assert list(plan.sends) == [1] and list(plan.recvs) == [1]
    assert sum(p.numel for p in plan.sends[1]) == sum(p.numel for p in plan.recvs[1]) == 12
    assert _spans(plan.recvs[1]) == [(1, 0, 0, 4, 4)]
    assert _spans(plan.sends[1]) == [(0, 1, 0, 0, 4)]
    assert _spans(plan.local) == [(0, 0, 0, 0, 4)]


def test_gated_shards_cut_into_the_finest_common_pieces():
    gather = build_plan(GATED_TP2, REPLICATED, rank=0, ranks_per_node=8)
    assert (gather.world_elements_moved, gather.world_elements_reused) == (24, 24)
    assert _spans(gather.local) == [(0, 0, 0, 0, 2), (0, 0, 2, 4, 2)]
    assert _spans(gather.recvs[1]) == [(1, 0, 0, 2, 2), (1, 0, 2, 6, 2)]
    scatter = build_plan(REPLICATED, GATED_TP2, rank=1, ranks_per_node=8)
    assert (scatter.world_elements_moved, scatter.world_elements_reused) == (0, 24)
    assert _spans(scatter.local) == [(1, 1, 2, 0, 2), (1, 1, 6, 2, 2)]


def _senders(source, target, world, ranks_per_node):
    """``{(dst, start): src}`` of every piece crossing between processes (whole-tensor targets)."""
    out = {}
    for rank in range(world):
        plan = build_plan(source, target, rank=rank, ranks_per_node=ranks_per_node)
        for p in (p for pieces in plan.recvs.values() for p in pieces):
            out[(p.dst, p.dst_start)] = p.src
    return out


def test_senders_prefer_self_then_node_then_least_loaded():
    # two TP2 replicas: rows 0-3 on ranks 0 and 2, rows 4-7 on ranks 1 and 3
    source = merge_shards([{"w": Shard(r, 0, ((4 * (r % 2), 4, 0),), 3)} for r in range(4)])
    target = merge_shards([{"w": Shard(r, 0, ((0, 8, 0),), 3)} for r in range(4)])
    two_nodes = _senders(source, target, 4, ranks_per_node=2)
    assert two_nodes == {(0, 4): 1, (1, 0): 0, (2, 4): 3, (3, 0): 2}
    # one node: replicas share the sends, each rank serves exactly one other
    one_node = _senders(source, target, 4, ranks_per_node=4)
    assert set(one_node) == set(two_nodes) and sorted(one_node.values()) == [0, 1, 2, 3]
    assert all(src % 2 == start // 4 for (_, start), src in one_node.items())
    # replicas on ranks 0 and 1 share the work of filling ranks 2 and 3
    spread = merge_shards([{"w": Shard(r, 0, ((0, 8, 0),), 3)} for r in range(2)])
    empty_target = merge_shards([{"w": Shard(r, 0, ((0, 8, 0),), 3)} for r in (2, 3)])
    assert _senders(spread, empty_target, 4, ranks_per_node=4) == {(2, 0): 0, (3, 0): 1}


@pytest.mark.parametrize(
    ("source", "target"), [(TP2, REPLICATED), (GATED_TP2, TP2), (REPLICATED, GATED_TP2)]
)
def test_plans_agree_across_ranks(source, target):
    plans = [build_plan(source, target, rank=r, ranks_per_node=1) for r in range(2)]
    sends = [p for plan in plans for pieces in plan.sends.values() for p in pieces]
    recvs = [p for plan in plans for pieces in plan.recvs.values() for p in pieces]
    assert sorted(sends, key=repr) == sorted(recvs, key=repr)
    assert len(set(sends)) == len(sends)
    assert {plan.world_elements_moved for plan in plans} == {sum(p.numel for p in sends)}
    local = sum(p.numel for plan in plans for p in plan.local)
    assert {plan.world_elements_reused for plan in plans} == {local}
    assert local + sum(p.numel for p in sends) == sum(
        n * s.inner for s in target["w"] for _, n, _ in s.segments
    )


def test_build_plan_errors():
    with pytest.raises(ValueError, match="different parameters"):
        build_plan(TP2, {"v": TP2["w"]}, rank=0, ranks_per_node=8)
    by_columns = {"w": [Shard(0, 1, ((0, 3, 0),), 8), Shard(1, 1, ((0, 3, 0),), 8)]}
    with pytest.raises(ValueError, match="different dimensions"):
        build_plan(by_columns, REPLICATED, rank=0, ranks_per_node=8)
    half = {"w": [Shard(0, 0, ((0, 4, 0),), 3)]}
    with pytest.raises(ValueError, match=r"no source process holds \[4, 8\)"):
        build_plan(half, REPLICATED, rank=0, ranks_per_node=8)


@pytest.mark.parametrize(
    ("source", "target"), [(REPLICATED, TP2), (TP2, REPLICATED), (REPLICATED, GATED_TP2)]
)
def test_weight_switch_writes_every_element_once(source, target):
    # what a working copy allocated uninitialised relies on; the engine checks its own plans
    for rank in range(2):
        plan = build_plan(source, target, rank=rank, ranks_per_node=8)
        rows = sum(n for _, n, _ in target["w"][rank].segments)
        plan.check_fills({"w": torch.empty(rows, 3)})
        with pytest.raises(ValueError, match=r"every element of w \(9, 3\) exactly once"):
            plan.check_fills({"w": torch.empty(9, 3)})
        with pytest.raises(ValueError, match=r"every element of v"):
            plan.check_fills({"w": torch.empty(rows, 3), "v": torch.empty(2)})
    overlapping = build_plan(REPLICATED, TP2, rank=0, ranks_per_node=8)
    overlapping.local.append(overlapping.local[0])
    with pytest.raises(ValueError, match="exactly once"):
        overlapping.check_fills({"w": torch.empty(4, 3)})
    with pytest.raises(ValueError, match=r"writes tensors the target lacks: \['w'\]"):
        overlapping.check_fills({})


@pytest.mark.parametrize("dim", [0, 1])
def test_run_all_local_plan(dim):
    full = torch.arange(24, dtype=torch.float32).view(8, 3)
    src_tensor = full if dim == 0 else full.t().contiguous()
    source = {"w": [Shard(0, dim, ((0, 8, 0),), 3)]}
    target = {"w": [Shard(0, dim, ((4, 2, 0), (0, 2, 2)), 3)]}  # [up; gate] halves, swapped
    plan = build_plan(source, target, rank=0, ranks_per_node=1)
    assert plan.sends == {} and plan.recvs == {} and len(plan.local) == 2
    expected = src_tensor.index_select(dim, torch.tensor([4, 5, 0, 1]))
    dst = torch.zeros_like(expected)
    stats = plan.run({"w": src_tensor}, {"w": dst})
    assert torch.equal(dst, expected)
    assert (stats.bytes_sent, stats.bytes_reused, stats.world_bytes_moved) == (0, 48, 0)
    plan.run({"w": src_tensor}, {"w": dst}, accumulate=True)
    assert torch.equal(dst, 2 * expected)
    with pytest.raises(TypeError, match="one dtype"):
        plan.run({"w": src_tensor}, {"w": dst.double()})


class _Fixed(list):
    def document(self, index):
        return np.ones(self[index], dtype=np.int64)


def test_expected_rows():
    # every global batch is one whole epoch: 4 × 4 tokens → 2 rows of 8; 2 × 10 → 2 rows of 16
    source = _Fixed([4, 10, 4, 4, 10, 4])
    rows = expected_rows(
        source, bounds=[8, 16], global_batch_size=6, seed=3, steps=3, backfill=False
    )
    assert rows == [2.0, 2.0]
    # backfill: two 4-token documents fill the room each 10-token one leaves in its 16-row
    assert expected_rows(source, bounds=[8, 16], global_batch_size=6, seed=3, steps=3) == [1, 2]
    stats = bucket_statistics(source, bounds=[8, 16], global_batch_size=6, seed=3, steps=3)
    assert stats[0].attention_fraction == pytest.approx((4**2 + 4**2) / 8**2)
    assert stats[1].attention_fraction == pytest.approx((10**2 + 4**2) / 16**2)
    mock = MockDocuments(num_documents=200, seq_length=512, vocab_size=50, seed=1)
    rows = expected_rows(
        mock, bounds=[64, 512], global_batch_size=32, seed=1, steps=4, backfill=False
    )
    batches = global_batches(mock, global_batch_size=32, seq_length=512, seed=1)
    sampled = [len(d) for _, batch in zip(range(4), batches) for d in batch]
    short, long = [n for n in sampled if n <= 64], [n for n in sampled if n > 64]
    assert all(float(r * 4).is_integer() for r in rows)  # a mean over 4 steps of whole rows
    # first-fit rows hold every token, and all but one row per step are more than half full
    for n, bound, lengths in ((rows[0], 64, short), (rows[1], 512, long)):
        assert sum(lengths) <= n * 4 * bound < 2 * sum(lengths) + 4 * bound
    assert rows == expected_rows(
        mock, bounds=[64, 512], global_batch_size=32, seed=1, steps=4, backfill=False
    )


def test_candidate_layouts_pass_check_layout():
    model = model_shape("gpt-7b", num_layers=6)
    found = list(candidate_layouts(model, world_size=8, gpus_per_node=8, length=4096))
    assert len(set(found)) == len(found) and all(lay.world_size == 8 for lay in found)
    for lay in found:
        check_layout(lay, config=model, bucket_length=4096)
    assert {(lay.tp, lay.pp) for lay in found if lay.cp == 1} == {
        (1, 1),
        (1, 2),
        (2, 1),
        (2, 2),
        (4, 1),
        (4, 2),
        (8, 1),
    }
    narrow = list(candidate_layouts(model, world_size=8, gpus_per_node=2, length=4096))
    assert max(lay.tp for lay in narrow) == 2
    # 4098 tokens cut into 4 or 8 sequence-parallel shards do not divide evenly
    odd = list(candidate_layouts(model, world_size=8, gpus_per_node=8, length=4098))
    assert {lay.tp for lay in odd} == {1, 2}


BOUNDS = [4096, 16384, 32768]


@pytest.mark.parametrize(
    ("mode", "rows"),
    [
        ("dynamic-cp", [16, 4, 2]),
        ("dynamic-cp", [4, 8, 4]),
        ("switch", [16, 4, 2]),
        ("switch", [4, 8, 4]),
    ],
)
def test_choose_strategies(mode, rows):
    model, device = model_shape("gpt-7b"), device_spec("h100-80g")
    usable = int(device.memory_bytes * (1 - Efficiency().headroom))
    stats = [BucketStats(rows=r, attention_fraction=1.0) for r in rows]
    plan = choose_strategies(
        model=model, device=device, bounds=BOUNDS, stats=stats, world_size=8, mode=mode
    )
    choices = plan.choices
    assert plan.step_s == pytest.approx(
        sum(c.compute_s + c.sync_s + c.switch_s for c in choices) + plan.home_sync_s
    )
    assert [c.length for c in choices] == BOUNDS and [c.rows for c in choices] == rows
    for c in choices:
        assert c.layout.world_size == 8 and 0 < c.peak_bytes <= usable and c.compute_s > 0
        check_layout(c.layout, config=model, bucket_length=c.length)
    home = choices[-1].layout
    assert choices[-1].switch_s == 0
    for c in choices:  # only a layout with the home model's TP and PP runs without a switch
        assert (c.switch_s == 0) == ((c.layout.tp, c.layout.pp) == (home.tp, home.pp))
    for c in choices[:-1]:  # never slower than staying at home, which is always a candidate
        at_home = _estimate(
            model,
            device,
            home,
            length=c.length,
            stats=stats[BOUNDS.index(c.length)],
            eff=Efficiency(),
        )
        staying = at_home.step_time_s - at_home.grad_sync_s  # home reduces once for all buckets
        assert c.total_s <= staying * (1 + 1e-9)


def test_choose_strategies_refusals():
    model, device = model_shape("gpt-7b"), device_spec("h100-80g")
    with pytest.raises(StrategyError, match="1048576-token bucket does not fit any layout"):
        choose_strategies(
            model=model,
            device=device,
            bounds=[4096, 1048576],
            stats=[
                BucketStats(rows=16, attention_fraction=1.0),
                BucketStats(rows=1, attention_fraction=1.0),
            ],
            world_size=8,
        )
    with pytest.raises(ValueError, match="mode must be one of"):
        choose_strategies(
            model=model,
            device=device,
            bounds=BOUNDS,
            stats=[BucketStats(rows=1, attention_fraction=1.0)] * 3,
            world_size=8,
            mode="fastest",
        )
