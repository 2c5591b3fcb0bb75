"""Replay of a trace through a model of PyTorch's CUDA caching allocator.

The model follows the rules of ``c10/cuda/CUDACachingAllocator.cpp`` that decide how much memory
is reserved (torch 2.x defaults, one stream, no ``max_split_size_mb``):

* requests are rounded up to a multiple of 512 bytes;
* requests of at most 1 MiB come from the *small* pool, larger ones from the *large* pool;
* a request takes the best-fitting free block of its pool (smallest size, then lowest address);
  the block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB
  (large pool), otherwise the whole block is handed out;
* with no fitting block a new segment is reserved: 2 MiB for small requests, 20 MiB for large
  requests under 10 MiB, and the request rounded up to 2 MiB otherwise;
* a freed block merges with free neighbours of its segment; segments are never released, except
  when a new segment would pass the device's limit (``limit_bytes``): the allocator then releases
  every wholly free segment (``cudaFree``, as ``release_cached_blocks`` does) and tries again; if
  the segment still does not fit, the request fails (:class:`OutOfMemory`).

The reserved peak against the plan's peak is the fragmentation a static plan removes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from memo_ext.planner.trace import Alloc, Trace

MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20
SMALL_SEGMENT_BYTES = 2 << 20
LARGE_SEGMENT_BYTES = 20 << 20
MIN_LARGE_ALLOC_BYTES = 10 << 20
ROUND_LARGE_BYTES = 2 << 20


def round_request(size: int) -> int:
    """Bytes the allocator hands out for a ``size``-byte request."""
    return max(MIN_BLOCK_BYTES, -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_bytes(size: int) -> int:
    """Bytes reserved by a new segment for a (rounded) request that found no free block."""
    if size <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass
class _Block:
    address: int
    size: int
    segment: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class OutOfMemory(Exception):
    """A request that does not fit under the limit even after the cache was emptied."""


@dataclass
class CachingAllocatorReplay:
    """What the caching allocator would do with a trace."""

    reserved_peak_bytes: int = 0
    """Largest total of reserved segments (``torch.cuda.max_memory_reserved``)."""
    allocated_peak_bytes: int = 0
    """Largest total of live rounded requests (``torch.cuda.max_memory_allocated``)."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """``(address, size)`` of each segment, addresses laid out one after another."""
    addresses: dict[str, int] = field(default_factory=dict)
    """Address each tensor was served at."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Rounded size each tensor took."""


class CachingAllocatorModel:
    """Best-fit pools with splitting and merging, as described in the module docstring.

    Args:
        limit_bytes: most bytes the segments may reserve (``None``: no limit).
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self.live: dict[str, _Block] = {}
        self.report = CachingAllocatorReplay()
        self.reserved = self.allocated = 0
        self.limit_bytes = limit_bytes
        self.next_address = 0
        self.retries = 0
        """Times the cache was emptied to serve a request."""
        self.segment_calls = 0
        """Segments released by those retries plus the segments reserved right after them."""

    def malloc(self, tensor_id: str, size: int) -> int:
        """Serves a request; returns its address."""
        size = round_request(size)
        small = size <= SMALL_REQUEST_BYTES
        block = self._take_free(size, small) or self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_BYTES:
            self._split(block, size)
        block.free = False
        self.live[tensor_id] = block
        self.allocated += block.size
        self.report.allocated_peak_bytes = max(self.report.allocated_peak_bytes, self.allocated)
        self.report.addresses[tensor_id] = block.address
        self.report.sizes[tensor_id] = block.size
        return block.address

    def free(self, tensor_id: str) -> None:
        """Returns a tensor's block to its pool, merged with free neighbours."""
        block = self.live.pop(tensor_id)
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                block = self._merge(block, neighbour)
        self._add_free(block)

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self.pools[small]
        k = bisect.bisect_left(pool, (size, -1))
        if k == len(pool):
            return None
        return self._remove_free(pool[k][2])

    def _new_segment(self, size: int, small: bool) -> _Block:
        nbytes = segment_bytes(size)
        if self.limit_bytes is not None and self.reserved + nbytes > self.limit_bytes:
            self.retries += 1
            self.segment_calls += self.empty_cache() + 1
            if self.reserved + nbytes > self.limit_bytes:
                raise OutOfMemory(
                    f"{nbytes} bytes more do not fit: {self.reserved} reserved of "
                    f"{self.limit_bytes} after emptying the cache"
                )
        address = self.next_address
        self.next_address += nbytes
        self.report.segments.append((address, nbytes))
        self.reserved += nbytes
        self.report.reserved_peak_bytes = max(self.report.reserved_peak_bytes, self.reserved)
        return _Block(address, nbytes, len(self.report.segments) - 1, small, free=False)

    def empty_cache(self) -> int:
        """Releases every wholly free segment (``torch.cuda.empty_cache``); returns how many."""
        released = 0
        for pool in self.pools.values():
            whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
            for _, _, block in whole:
                self._remove_free(block)
                self.reserved -= block.size
                released += 1
        return released

    def _split(self, block: _Block, size: int) -> None:
        rest = _Block(block.address + size, block.size - size, block.segment, block.small)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        self._add_free(rest)

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        low, high = (block, neighbour) if block.address < neighbour.address else (neighbour, block)
        low.size += high.size
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        low.free = True
        return low

    def _add_free(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self.pools[block.small], (block.size, block.address, block))

    def _remove_free(self, block: _Block) -> _Block:
        pool = self.pools[block.small]
        k = bisect.bisect_left(pool, (block.size, block.address))
        del pool[k]
        block.free = False
        return block


def replay_caching_allocator(trace: Trace) -> CachingAllocatorReplay:
    """Runs every event of ``trace`` through ``CachingAllocatorModel``."""
    model = CachingAllocatorModel()
    for event in trace.events:
        if isinstance(event, Alloc):
            model.malloc(event.id, event.size)
        else:
            model.free(event.id)
    return model.report
