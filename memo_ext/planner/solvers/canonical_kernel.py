"""The canonical search's inner loop, compiled with numba.

One call is one depth-first decision run (see ``canonical.py`` for the method): it places tensors
at their minimum offsets in canonical order, prunes by dominance, spatial inference and the
failed-state table, splits the time axis where nothing unplaced crosses, and stops at the first
complete placement, when the tree is exhausted, or when its node budget is spent. Everything it
touches is a flat integer array, so a node at 400 tensors costs about ten microseconds instead of
the hundred-odd a numpy version spends, mostly in call overhead.

Failed states are kept in an open-addressing table of 128-bit fingerprints (two independent
64-bit hashes of the residual state): two different states share a fingerprint with probability
about ``entries**2 / 2**129``, far below anything a run can reach.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from memo_ext.planner.solvers.kernel_cache import install_cache_locator

install_cache_locator()  # before the decorators below, which choose the cache folder

FOUND, FAILED, OUT_OF_NODES = 1, 0, -1
"""Outcomes of a search (and of one call of ``run_kernel``)."""

# The problem: a tuple of int64 arrays.
SIZES, LO, HI, NB_PTR, NB_IDX, RANK = range(6)
"""Sizes, first section and one past the last section of each tensor, its neighbours (tensors
live with it, CSR) and its rank in the canonical tie-breaking order."""
# The search state: a tuple of int64 arrays.
MIN_OFF, PLACED, OFFSETS, TOTAL, CROSSINGS = range(5)
"""Per tensor: minimum offset, placed flag, offset (-1: unplaced); per section: unplaced total;
per section boundary: unplaced tensors crossing it."""
STACK_C, STACK_RAISED, RAISED_IDX, RAISED_OLD = range(5, 9)
"""Undo stack: the tensor placed at each depth, where its raised neighbours start in
``RAISED_IDX`` / ``RAISED_OLD`` (the neighbours and their previous minimum offsets)."""
COUNTERS, DEEPEST_OFFSETS, SCRATCH, USABLE, ALLOWED = range(9, 14)
"""Counters below, the offsets of the deepest partial placement, a zeroed ``[S]`` buffer and two
``[n]`` buffers for a node's usable offsets and allowed flags."""
# Counters shared by every frame of a run. ``WORK`` adds up, over the nodes, the members and
# sections each one scans: what a node costs, counted (``work.py`` turns it into work units).
DEPTH, NODES, BUDGET, DEEPEST, RAISED_TOP, WORK = range(6)

_NO_FLOOR = np.iinfo(np.int64).max


def new_state(num_tensors: int, num_sections: int, num_raised: int) -> tuple:
    """Zeroed search state arrays, in the order of the indices above (``num_raised``: how many
    minimum-offset raises one branch can record, twice the overlapping pairs is enough)."""
    n, sections = num_tensors, num_sections
    lengths = {
        MIN_OFF: n,
        PLACED: n,
        OFFSETS: n,
        TOTAL: sections,
        CROSSINGS: sections,
        STACK_C: n,
        STACK_RAISED: n,
        RAISED_IDX: num_raised,
        RAISED_OLD: num_raised,
        COUNTERS: WORK + 1,
        DEEPEST_OFFSETS: n,
        SCRATCH: sections,
        USABLE: n,
        ALLOWED: n,
    }
    return tuple(np.zeros(lengths[k], dtype=np.int64) for k in range(len(lengths)))


@njit(cache=True, nogil=True)
def _mix(z):
    """splitmix64's finaliser: a bijection of uint64 that scatters every input bit."""
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    return z ^ (z >> uint64(31))


@njit(cache=True, nogil=True)
def fold(h, value):
    """Mixes ``value`` into the hash ``h`` (the fingerprints of both searches are built of it)."""
    return _mix(h ^ uint64(value))


@njit(cache=True, nogil=True)
def _table_slot(table_a, table_b, key_a, key_b):
    """Index of the key's slot, or of the empty slot where it would go (linear probing);
    ``key_a`` must be odd, since 0 marks an empty slot."""
    mask = uint64(len(table_a) - 1)
    slot = key_a & mask
    while table_a[slot] != 0 and (table_a[slot] != key_a or table_b[slot] != key_b):
        slot = (slot + uint64(1)) & mask
    return slot


@njit(cache=True, nogil=True)
def seen_failed(key_a, key_b, tables):
    """Whether the state with fingerprint ``(key_a, key_b)`` is recorded as failed."""
    key_a |= uint64(1)
    return tables[0][_table_slot(tables[0], tables[1], key_a, key_b)] != 0


@njit(cache=True, nogil=True)
def remember_failed(key_a, key_b, tables):
    """Records a failed state; a half-full table is emptied (it is only a cache)."""
    table_a, table_b, used = tables
    if uint64(2) * used[0] > uint64(len(table_a)):
        table_a[:] = 0
        table_b[:] = 0
        used[0] = 0
    key_a |= uint64(1)
    slot = _table_slot(table_a, table_b, key_a, key_b)
    if table_a[slot] == 0:
        table_a[slot], table_b[slot] = key_a, key_b
        used[0] += uint64(1)


@njit(cache=True, nogil=True)
def _place(c, off, pb, st):
    """Puts tensor ``c`` at ``off``: raises its unplaced neighbours' minimum offsets, takes it
    out of the section totals and crossings, and pushes what to undo."""
    sizes, lo, hi, nb_ptr, nb_idx = pb[SIZES], pb[LO], pb[HI], pb[NB_PTR], pb[NB_IDX]
    min_off, placed, counters = st[MIN_OFF], st[PLACED], st[COUNTERS]
    depth, r, top = counters[DEPTH], counters[RAISED_TOP], off + sizes[c]
    st[STACK_RAISED][depth] = r
    for k in range(nb_ptr[c], nb_ptr[c + 1]):
        j = nb_idx[k]
        if placed[j] == 0 and min_off[j] < top:
            st[RAISED_IDX][r], st[RAISED_OLD][r] = j, min_off[j]
            min_off[j] = top
            r += 1
    counters[RAISED_TOP] = r
    counters[WORK] += nb_ptr[c + 1] - nb_ptr[c] + hi[c] - lo[c]
    for s in range(lo[c], hi[c]):
        st[TOTAL][s] -= sizes[c]
    for s in range(lo[c], hi[c] - 1):
        st[CROSSINGS][s] -= 1
    placed[c] = 1
    st[OFFSETS][c] = off
    st[STACK_C][depth] = c
    counters[DEPTH] = depth + 1
    if depth + 1 > counters[DEEPEST]:
        counters[DEEPEST] = depth + 1
        st[DEEPEST_OFFSETS][:] = st[OFFSETS]


@njit(cache=True, nogil=True)
def _undo_to(mark, pb, st):
    """Reverts placements, latest first, until ``mark`` remain."""
    sizes, lo, hi = pb[SIZES], pb[LO], pb[HI]
    counters = st[COUNTERS]
    while counters[DEPTH] > mark:
        depth = counters[DEPTH] - 1
        c = st[STACK_C][depth]
        for r in range(counters[RAISED_TOP] - 1, st[STACK_RAISED][depth] - 1, -1):
            st[MIN_OFF][st[RAISED_IDX][r]] = st[RAISED_OLD][r]
        counters[RAISED_TOP] = st[STACK_RAISED][depth]
        for s in range(lo[c], hi[c]):
            st[TOTAL][s] += sizes[c]
        for s in range(lo[c], hi[c] - 1):
            st[CROSSINGS][s] += 1
        st[PLACED][c] = 0
        st[OFFSETS][c] = -1
        counters[DEPTH] = depth


@njit(cache=True, nogil=True)
def sections_fit(unplaced, usable, s_lo, s_hi, capacity, sizes, lo, hi, total, scratch):
    """Spatial inference, section by section (``scratch``: ``[S]`` int64, left zeroed).

    A tensor that can go no lower than ``u`` shares the bytes above ``u`` with every tensor of
    its section that can go no lower either: ``u`` plus their sizes must fit the capacity. The
    lowest ``u`` of a section with everything left there (its floor plus its remaining total) is
    checked first: it is cheap and cuts most nodes.
    """
    for s in range(s_lo, s_hi):
        scratch[s] = capacity
    for k in range(len(unplaced)):
        for s in range(lo[unplaced[k]], hi[unplaced[k]]):
            scratch[s] = min(scratch[s], usable[k])
    ok = True
    for s in range(s_lo, s_hi):
        ok = ok and scratch[s] + total[s] <= capacity
        scratch[s] = 0
    if ok:
        # By decreasing usable offset, a section's running size sum is the size of its tensors
        # that can go no lower than the current one.
        for k in np.argsort(-usable):
            i = unplaced[k]
            for s in range(lo[i], hi[i]):
                scratch[s] += sizes[i]
                if usable[k] + scratch[s] > capacity:
                    ok = False
                    break
            if not ok:
                break
        for s in range(s_lo, s_hi):
            scratch[s] = 0
    return ok


@njit(cache=True, nogil=True)
def _reserve(pool, needed):
    """``pool``, or a copy twice as long when it holds fewer than ``needed`` entries."""
    if needed <= len(pool):
        return pool
    grown = np.empty(max(needed, 2 * len(pool)), dtype=np.int64)
    grown[: len(pool)] = pool
    return grown


# What the search loop does next.
_ENTER, _NEXT_CANDIDATE, _NEXT_PART, _RETURN = range(4)
# A frame of the explicit recursion stack: where its unplaced tensors and its candidates lie in
# the pool, its time range and canonical position, the next candidate to try, and for the
# candidate placed the depth to undo to and the next time partition to search.
(
    _F_BASE,
    _F_NUM,
    _F_CANDS,
    _F_NUM_CANDS,
    _F_NEXT,
    _F_S_LO,
    _F_S_HI,
    _F_MARK,
    _F_C,
    _F_PART_LO,
    _F_PART_HI,
) = range(11)
_NUM_FIELDS = 11


@njit(cache=True, nogil=True)
def _search(capacity, pb, st, tables, pool, pool_top):
    """Depth-first search for the unplaced tensors of ``pool[:pool_top]`` over all sections.

    The recursion runs on an explicit stack of frames (one per search node on the current
    branch), so the compiled code can be cached. A node with tensors ``members`` living in
    sections ``[s_lo, s_hi)`` keeps its unplaced tensors and its candidates in ``pool``; after
    placing a candidate it searches either the same members from the candidate's offset on, or,
    when the placement leaves section boundaries that nothing unplaced crosses, each of the
    independent time partitions from offset 0, one after another.

    Returns FOUND (the placement stays in ``st``), FAILED or OUT_OF_NODES.
    """
    sizes, lo, hi, rank = pb[SIZES], pb[LO], pb[HI], pb[RANK]
    nb_ptr, nb_idx = pb[NB_PTR], pb[NB_IDX]
    min_off, placed, total, counters = st[MIN_OFF], st[PLACED], st[TOTAL], st[COUNTERS]
    usable_buf, allowed_buf = st[USABLE], st[ALLOWED]
    n = len(sizes)
    frames = np.empty((n + 2, _NUM_FIELDS), dtype=np.int64)
    keys = np.empty((n + 2, 2), dtype=np.uint64)
    depth = -1  # of the frame stack
    # Arguments of the node to enter.
    members, num_members, s_lo, s_hi = 0, pool_top, 0, len(total)
    last_off, last_rank = -1, -1
    action, result = _ENTER, FAILED
    while True:
        if action == _ENTER:
            counters[NODES] += 1
            counters[WORK] += num_members + s_hi - s_lo
            counters[BUDGET] -= 1
            if counters[BUDGET] < 0:
                return OUT_OF_NODES
            m = 0
            for k in range(members, members + num_members):
                m += placed[pool[k]] == 0
            if m == 0:
                action, result = _RETURN, FOUND
                continue
            pool = _reserve(pool, pool_top + 2 * m)
            base = pool_top
            unplaced = pool[base : base + m]
            # The residual state depends only on what is left, where it can go and which
            # tensors the canonical order still allows at ``last_off``; a state that failed
            # once fails again.
            key_a = fold(fold(uint64(0x9E3779B97F4A7C15), s_lo), last_off)
            key_b = fold(fold(uint64(0x2545F4914F6CDD1D), last_off), s_lo)
            min_height, m, stranded = _NO_FLOOR, 0, False
            for k in range(members, members + num_members):
                i = pool[k]
                if placed[i] != 0:
                    continue
                mo = min_off[i]
                counters[WORK] += hi[i] - lo[i]  # its sections, scanned by sections_fit
                ok = mo > last_off or (mo == last_off and rank[i] > last_rank)
                unplaced[m], allowed_buf[m] = i, ok
                usable_buf[m] = mo
                if not ok:
                    # The canonical order forbids this tensor at its minimum offset: it must
                    # rest on a neighbour still to be placed (at or above ``last_off``).
                    lowest = _NO_FLOOR
                    counters[WORK] += nb_ptr[i + 1] - nb_ptr[i]
                    for q in range(nb_ptr[i], nb_ptr[i + 1]):
                        j = nb_idx[q]
                        if placed[j] == 0:
                            lowest = min(lowest, max(min_off[j], last_off) + sizes[j])
                    stranded = stranded or lowest == _NO_FLOOR
                    usable_buf[m] = max(lowest, last_off + 1)
                key_a = fold(fold(key_a, i), 2 * mo + ok)
                key_b = fold(fold(key_b, 2 * i + ok), mo)
                min_height = min(min_height, mo + sizes[i])
                m += 1
            if seen_failed(key_a, key_b, tables):
                action, result = _RETURN, FAILED
                continue
            if stranded:
                # A forbidden tensor with no neighbour left to lift it can never be placed.
                remember_failed(key_a, key_b, tables)
                action, result = _RETURN, FAILED
                continue
            usable = usable_buf[:m]
            if not sections_fit(
                unplaced, usable, s_lo, s_hi, capacity, sizes, lo, hi, total, st[SCRATCH]
            ):
                remember_failed(key_a, key_b, tables)
                action, result = _RETURN, FAILED
                continue
            # Whatever is placed next sits at or below every later offset, so the fullest
            # section must still fit above it: offset + total[s] <= capacity.
            highest = capacity - total[s_lo:s_hi].max()
            # Candidates by (minimum offset, rank). One whose minimum offset is at or above
            # another tensor's lowest top is dominated: that tensor could slide under it.
            cands = pool[base + m : base + 2 * m]
            nc = 0
            for k in range(m):
                i = unplaced[k]
                if not (allowed_buf[k] and min_off[i] < min_height and min_off[i] <= highest):
                    continue
                j = nc
                while j > 0 and (min_off[cands[j - 1]], rank[cands[j - 1]]) > (min_off[i], rank[i]):
                    cands[j] = cands[j - 1]
                    j -= 1
                cands[j] = i
                nc += 1
            depth += 1
            f = frames[depth]
            f[_F_BASE], f[_F_NUM], f[_F_CANDS], f[_F_NUM_CANDS] = base, m, base + m, nc
            f[_F_NEXT], f[_F_S_LO], f[_F_S_HI] = 0, s_lo, s_hi
            keys[depth, 0], keys[depth, 1] = key_a, key_b
            pool_top = base + m + nc
            action = _NEXT_CANDIDATE
        elif action == _NEXT_CANDIDATE:
            f = frames[depth]
            if f[_F_NEXT] == f[_F_NUM_CANDS]:
                remember_failed(keys[depth, 0], keys[depth, 1], tables)
                pool_top = f[_F_BASE]
                depth -= 1
                action, result = _RETURN, FAILED
                continue
            c = pool[f[_F_CANDS] + f[_F_NEXT]]
            f[_F_NEXT] += 1
            f[_F_C], f[_F_MARK] = c, counters[DEPTH]
            _place(c, min_off[c], pb, st)
            f[_F_PART_LO], f[_F_PART_HI] = f[_F_S_LO], max(lo[c], f[_F_S_LO]) + 1
            action = _NEXT_PART
        elif action == _NEXT_PART:
            # Boundaries the placed candidate spanned that no unplaced tensor crosses any more
            # split the rest into independent parts, each searched from offset 0.
            f = frames[depth]
            c, s_lo, s_hi = f[_F_C], f[_F_S_LO], f[_F_S_HI]
            a, b, last_cut = f[_F_PART_LO], f[_F_PART_HI], min(hi[c], s_hi)
            pool_top = f[_F_BASE] + f[_F_NUM] + f[_F_NUM_CANDS]
            if a >= s_hi:  # every part placed
                depth -= 1
                action, result = _RETURN, FOUND
                continue
            while b < last_cut and st[CROSSINGS][b - 1] != 0:
                b += 1
            if b >= last_cut and a == s_lo:  # no cut: go on from the candidate's offset
                members, num_members = f[_F_BASE], f[_F_NUM]
                last_off, last_rank = st[OFFSETS][c], rank[c]
                f[_F_PART_LO] = s_hi
                action = _ENTER
                continue
            b = s_hi if b >= last_cut else b
            pool = _reserve(pool, pool_top + f[_F_NUM])
            num_members = 0
            for k in range(f[_F_BASE], f[_F_BASE] + f[_F_NUM]):
                i = pool[k]
                if placed[i] == 0 and lo[i] < b and hi[i] > a:
                    pool[pool_top + num_members] = i
                    num_members += 1
            f[_F_PART_LO], f[_F_PART_HI] = b, b + 1
            if num_members > 0:
                members, s_lo, s_hi, last_off, last_rank = pool_top, a, b, -1, -1
                pool_top += num_members
                action = _ENTER
        else:  # _RETURN: hand ``result`` to the frame below
            if depth < 0:
                return result
            if result == FOUND:
                action = _NEXT_PART
            else:
                _undo_to(frames[depth, _F_MARK], pb, st)
                action = _NEXT_CANDIDATE


@njit(cache=True, nogil=True)
def run_kernel(capacity, node_limit, fixed, base_total, base_crossings, pb, st, tables):
    """One decision run: a placement with peak <= ``capacity`` in ``st[OFFSETS]``, if found.

    Resets the state, places the ``fixed`` tensors (offset >= 0) where they are and searches the
    rest. Returns FOUND, FAILED (the tree holds no placement) or OUT_OF_NODES; the nodes visited
    and the deepest placement are left in the counters and ``st[DEEPEST_OFFSETS]``.
    """
    n = len(pb[SIZES])
    st[MIN_OFF][:] = 0
    st[PLACED][:] = 0
    st[OFFSETS][:] = -1
    st[TOTAL][:] = base_total
    st[CROSSINGS][:] = base_crossings
    counters = st[COUNTERS]
    counters[:] = 0
    counters[BUDGET] = node_limit
    st[DEEPEST_OFFSETS][:] = -1
    for c in range(n):
        if fixed[c] >= 0:
            _place(c, fixed[c], pb, st)
    pool = np.empty(8 * n + 64, dtype=np.int64)
    pool[:n] = np.arange(n)
    return _search(capacity, pb, st, tables, pool, n)
