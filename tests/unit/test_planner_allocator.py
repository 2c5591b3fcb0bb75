"""The caching-allocator model on a hand-worked sequence."""

from memo_ext.planner import Alloc, Free, Trace
from memo_ext.planner.caching_allocator import (
    replay_caching_allocator,
    round_request,
    segment_bytes,
)

MIB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_request(1) == 512 and round_request(513) == 1024
    assert segment_bytes(MIB) == 2 * MIB  # small pool
    assert segment_bytes(3 * MIB) == 20 * MIB  # large request under 10 MiB
    assert segment_bytes(11 * MIB + 1) == 12 * MIB  # rounded up to 2 MiB


def test_hand_worked_replay():
    events = [
        Alloc("a", 3 * MIB),  # new 20 MiB segment; a = [0, 3), free [3, 20)
        Alloc("b", 12 * MIB),  # best fit [3, 20), split; b = [3, 15), free [15, 20)
        Free("a"),  # free [0, 3) (b is live, no merge)
        Alloc("c", 1000),  # 1024 bytes, small pool: new 2 MiB segment at 20 MiB
        Alloc("d", 2 * MIB),  # best fit is [0, 3); 1 MiB left is not > 1 MiB: whole block
        Alloc("e", 4 * MIB),  # [15, 20), 1 MiB left: whole block
        Free("b"),  # [3, 15) free
        Alloc("f", 11 * MIB),  # [3, 15), 1 MiB left: whole block
        Free("d"),
        Free("f"),  # merges [0, 3) + [3, 15) into [0, 15)
        Alloc("g", 14 * MIB),  # fits the merged block: no new segment
    ]
    replay = replay_caching_allocator(Trace(events=events))
    assert replay.segments == [(0, 20 * MIB), (20 * MIB, 2 * MIB)]
    assert replay.reserved_peak_bytes == 22 * MIB
    expected = {"a": 0, "b": 3 * MIB, "c": 20 * MIB, "d": 0, "e": 15 * MIB, "f": 3 * MIB, "g": 0}
    assert replay.addresses == expected
    assert replay.sizes["d"] == 3 * MIB and replay.sizes["c"] == 1024
    # c + d (3 MiB block) + e (5 MiB block) + f (12 MiB block)
    assert replay.allocated_peak_bytes == 1024 + 20 * MIB
