"""Exact-cover search for problems whose every time section is full at the capacity.

When the tensors live in every section add up to exactly the capacity (a time x memory rectangle
cut into pieces is the extreme case), a placement within that capacity leaves no byte free: it
is an exact cover of the rectangle. The search then works like Knuth's Algorithm X with the
minimum-remaining-values rule: at each node it takes, over all sections, the lowest free byte
of the section with the fewest tensors that fit there (a tensor fits when it is live in the
section, unplaced, and its bytes from that offset up are free in every section of its life),
and branches on which of them covers it. A section with no tensor that fits fails the node.
The canonical search couples all time through its increasing-offset order; this one works
where the choice is tightest, so a bad decision shows up as a dead section a few levels down.

What is left to do at a node depends only on the free region and on which tensors are placed,
not on how they were arranged to get there: two arrangements of the same tensors below a flat
level leave the same problem above it. A state whose subtree failed is remembered (in the table
kind of ``canonical_kernel``, by a 128-bit fingerprint) and fails at once when met again, in
the same run or a later one at the same capacity.

The loop is compiled with numba and runs on an explicit frame stack, like ``canonical_kernel``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from memo_ext.planner.solvers.canonical_kernel import (
    FAILED,
    FOUND,
    OUT_OF_NODES,
    fold,
    remember_failed,
    seen_failed,
)
from memo_ext.planner.solvers.kernel_cache import install_cache_locator

install_cache_locator()  # before the decorators below, which choose the cache folder


@njit(cache=True, nogil=True)
def _fits(i, f, capacity, sizes, nb_ptr, nb_idx, offsets):
    """Whether tensor ``i`` can sit at offset ``f`` next to the tensors placed so far."""
    top = f + sizes[i]
    if top > capacity:
        return False
    for q in range(nb_ptr[i], nb_ptr[i + 1]):
        j = nb_idx[q]
        if offsets[j] >= 0 and offsets[j] < top and f < offsets[j] + sizes[j]:
            return False
    return True


@njit(cache=True, nogil=True)
def _toggle(c, f, size, lo, hi, key):
    """Adds tensor ``c`` at offset ``f`` to the state's fingerprint, or takes it out.

    The fingerprint XORs a term per placed tensor (which tensors are left) and a term per
    (section, byte) where the occupied region of the section starts or ends. Tensors that touch
    share such a byte and its two terms cancel, so the boundary terms describe the free region
    alone, whatever the tensors that cover the rest.
    """
    key[0] ^= fold(uint64(0x9E3779B97F4A7C15), c)
    key[1] ^= fold(uint64(0x2545F4914F6CDD1D), c)
    for s in range(lo, hi):
        for y in (f, f + size):
            key[0] ^= fold(fold(uint64(0xD6E8FEB86659FD93), s), y)
            key[1] ^= fold(fold(uint64(0xA0761D6478BD642F), y), s)


@njit(cache=True, nogil=True)
def cover_kernel(
    capacity, node_limit, sizes, lo, hi, nb_ptr, nb_idx, sec_ptr, sec_idx, rank, tables
):
    """One depth-first run; candidates for a byte are tried by increasing ``rank``.

    Args:
        sec_ptr, sec_idx: CSR lists of the tensors live in each section.
        tables: failed-state table for this capacity (``CanonicalSearch._tables_for``).

    Returns:
        ``(outcome, nodes, offsets, deepest, work)``: FOUND (``offsets`` is the cover), FAILED
        (there is none) or OUT_OF_NODES (``offsets`` is then the deepest partial cover, -1 for
        the tensors it leaves, and ``deepest`` how many it placed); ``work`` counts the section
        entries and neighbours scanned, what the run cost.
    """
    n, num_sections = len(sizes), len(sec_ptr) - 1
    offsets = np.full(n, -1, dtype=np.int64)
    deepest_offsets = np.full(n, -1, dtype=np.int64)
    # low[s]: the lowest free byte of section s (capacity once the section is full).
    low = np.zeros(num_sections, dtype=np.int64)
    max_live = 1
    for s in range(num_sections):
        max_live = max(max_live, sec_ptr[s + 1] - sec_ptr[s])
    pool = np.empty(n * max_live + 1, dtype=np.int64)
    # Undo log of ``low`` changes: section and previous value.
    log_s = np.empty(int((hi - lo).sum()) + 1, dtype=np.int64)
    log_v = np.empty_like(log_s)
    # Frames: the section branched on, where its candidates lie in ``pool``, how many, the next
    # one to try, the one placed and where its ``low`` changes start in the log.
    f_sec, f_base = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    f_num, f_next = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    f_placed, f_log = np.full(n + 1, -1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    # The fingerprint of the current state (see ``_toggle``) and of each frame's node.
    key = np.zeros(2, dtype=np.uint64)
    f_key = np.zeros((n + 1, 2), dtype=np.uint64)
    depth, nodes, deepest, pool_top, log_top, work = 0, 0, 0, 0, 0, 0
    entering = True
    while True:
        if entering:
            nodes += 1
            if nodes > node_limit:
                return OUT_OF_NODES, nodes, deepest_offsets, deepest, work
            if depth == n:
                return FOUND, nodes, offsets, n, work
            if depth > deepest:
                deepest = depth
                deepest_offsets[:] = offsets
            # A state that failed once (in this run or an earlier one at this capacity) fails
            # again; otherwise, the open section with the fewest tensors that fit its lowest
            # free byte.
            f_key[depth, 0], f_key[depth, 1] = key[0], key[1]
            best, best_count = -1, n + 1
            if seen_failed(key[0], key[1], tables):
                best_count = 0  # no candidates: the node fails at once
            else:
                for s in range(num_sections):
                    f = low[s]
                    if f >= capacity:
                        continue
                    count = 0
                    work += sec_ptr[s + 1] - sec_ptr[s]
                    for k in range(sec_ptr[s], sec_ptr[s + 1]):
                        i = sec_idx[k]
                        work += (nb_ptr[i + 1] - nb_ptr[i]) * (offsets[i] < 0)
                        if offsets[i] < 0 and _fits(i, f, capacity, sizes, nb_ptr, nb_idx, offsets):
                            count += 1
                    if count < best_count:
                        best, best_count = s, count
                        if count <= 1:
                            break
            num = 0
            if best_count > 0:
                f = low[best]
                for k in range(sec_ptr[best], sec_ptr[best + 1]):
                    i = sec_idx[k]
                    if offsets[i] >= 0 or not _fits(i, f, capacity, sizes, nb_ptr, nb_idx, offsets):
                        continue
                    p = pool_top + num
                    while p > pool_top and rank[pool[p - 1]] > rank[i]:
                        pool[p] = pool[p - 1]
                        p -= 1
                    pool[p] = i
                    num += 1
            f_sec[depth], f_base[depth], f_num[depth], f_next[depth] = best, pool_top, num, 0
            f_placed[depth] = -1
            pool_top += num
            entering = False
            continue
        c = f_placed[depth]
        if c >= 0:  # take back the candidate tried last
            _toggle(c, offsets[c], sizes[c], lo[c], hi[c], key)
            offsets[c] = -1
            while log_top > f_log[depth]:
                log_top -= 1
                low[log_s[log_top]] = log_v[log_top]
            f_placed[depth] = -1
        if f_next[depth] == f_num[depth]:  # every candidate failed: so does this state
            remember_failed(f_key[depth, 0], f_key[depth, 1], tables)
            pool_top = f_base[depth]
            if depth == 0:
                return FAILED, nodes, deepest_offsets, deepest, work
            depth -= 1
            continue
        c = pool[f_base[depth] + f_next[depth]]
        f_next[depth] += 1
        f = low[f_sec[depth]]
        offsets[c], f_placed[depth], f_log[depth] = f, c, log_top
        _toggle(c, f, sizes[c], lo[c], hi[c], key)
        work += hi[c] - lo[c]
        # Sections whose lowest free byte it covers move up past it and past any tensor
        # already placed right above.
        for s in range(lo[c], hi[c]):
            if low[s] != f:
                continue
            log_s[log_top], log_v[log_top] = s, low[s]
            log_top += 1
            low[s] = f + sizes[c]
            moved = True
            while moved:
                moved = False
                for k in range(sec_ptr[s], sec_ptr[s + 1]):
                    j = sec_idx[k]
                    if offsets[j] == low[s]:
                        low[s] += sizes[j]
                        moved = True
        depth += 1
        entering = True
