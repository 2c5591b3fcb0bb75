"""MEMO's rule for α, the fraction of token-wise activations kept in host memory.

α is the largest value for which (a) copying one layer's offloaded bytes to the host takes no
longer than the layer's forward, so the copy hides under compute, and (b) the offloaded bytes of
every layer this process holds at once fit the host-memory budget. A layer offloads
``full_bytes`` (input, attention output and state) whatever α is, plus ``α · tokenwise_bytes``.

:func:`slots_after_forward` is the runtime's rule for the ping-pong slots at the end of the
forward, shared by the estimator and ``tools.memory_report``.
"""

from __future__ import annotations

from dataclasses import dataclass

from memo_ext.errors import UsageError


class HostMemoryError(UsageError):
    """MEMO needs more host memory than its budget allows; the message says what to change."""


@dataclass
class LayerCost:
    """One layer's offload sizes and, when measured, its forward time and the copy bandwidth."""

    full_bytes: int
    """Bytes copied whole to the host per layer (input, attention output and state)."""
    tokenwise_bytes: int
    """Bytes of the token-wise tensors of one layer; α of them go to the host."""
    forward_s: float | None = None
    """Seconds of one layer's forward."""
    copy_gbps: float | None = None
    """Device → host copy bandwidth, GB/s (1e9 bytes)."""
    rounding_bytes: int = 0
    """Host bytes one layer's buffers may take beyond their sizes: pinned buffers take whole
    pages, up to a page more each (0 when unpinned, or unknown)."""

    def host_bytes(self, alpha: float) -> float:
        return self.full_bytes + alpha * self.tokenwise_bytes


def solve_alpha(cost: LayerCost, *, budget_bytes: int, resident_layers: int) -> float:
    """Largest α in [0, 1] whose copy hides under the forward and whose bytes fit the budget.

    ``resident_layers`` layers' host data are held at once. Without a measured time or bandwidth
    only the budget limits α.

    Raises:
        HostMemoryError: when even α = 0 does not fit the budget.
    """
    alpha = 1.0
    if cost.forward_s is not None and cost.copy_gbps is not None:
        hidden_bytes = cost.copy_gbps * 1e9 * cost.forward_s
        alpha = min(alpha, _fraction(hidden_bytes - cost.full_bytes, cost.tokenwise_bytes))
    if resident_layers > 0:
        # the buffers' page rounding counted in: a budget filled to the byte by the sizes
        # alone overflows by their pages
        per_layer = budget_bytes / resident_layers - cost.rounding_bytes
        if per_layer < cost.full_bytes:
            raise HostMemoryError(
                f"MEMO needs at least {resident_layers * cost.full_bytes / 2**30:.2f} GiB of host "
                f"memory per process even at α = 0, but the budget is {budget_bytes / 2**30:.2f} "
                "GiB; raise --memo-host-memory-gb, keep more layers on the device "
                "(--memo-keep-last-layers) or shard the sequence further (TP / CP / PP)"
            )
        alpha = min(alpha, _fraction(per_layer - cost.full_bytes, cost.tokenwise_bytes))
    return max(0.0, alpha)


def skeleton_layers(
    cost: LayerCost, *, budget_bytes: int, offloaded_layers: int, in_flight: int = 1
) -> int:
    """Chunked MEMO: how many of a stage's offloaded layers keep their whole storages (input,
    attention output and state: the layer's skeleton) on the device so that the others fit the
    host budget at α = 0; 0 when all fit. ``in_flight`` micro-batches hold each layer's data.

    Raises:
        HostMemoryError: when even every skeleton on the device leaves too little host memory.
    """
    per_layer = in_flight * cost.full_bytes
    over = offloaded_layers * per_layer - budget_bytes
    if over <= 0:
        return 0
    layers = -(-over // per_layer) if per_layer else 0
    if layers >= offloaded_layers:
        raise HostMemoryError(
            f"MEMO needs {offloaded_layers * per_layer / 2**30:.2f} GiB of host memory per "
            f"process even at α = 0, and the budget of {budget_bytes / 2**30:.2f} GiB holds not "
            "one layer's whole storages; raise --memo-host-memory-gb or shard the sequence "
            "further (TP / CP / PP)"
        )
    return int(layers)


def _fraction(room: float, tokenwise_bytes: int) -> float:
    if tokenwise_bytes <= 0:
        return 1.0 if room >= 0 else 0.0
    return max(0.0, min(1.0, room / tokenwise_bytes))


def slots_after_forward(*, offloaded: int, kept: int) -> int:
    """Ping-pong slots still holding copy sources when a stage's forward ends.

    The offloaded layers keep at most two slots in flight; a kept layer first waits for every
    copy but the previous layer's (``MemoRuntime.before_kept_layer``), so one kept layer ends
    the forward next to one slot and two or more next to none.
    """
    if offloaded == 0:
        return 0
    if kept == 0:
        return min(2, offloaded)
    return 1 if kept == 1 else 0
