"""Where an offloaded layer's saved tensors go: MEMO's offload rule, and the seam for another.

MEMO sends three kinds of storage to host memory whole whatever the rule: the layer input (the
recompute pass starts from it), the core attention's output and its own state (attention is
never run again), and the views of q / k / v the core attention saves are token-wise (their
dropped tokens are what the recompute pass rebuilds). Every other tensor the layer's forward
saves for its backward, parameters apart, is put to an :class:`OffloadRule`, which places it:

- :attr:`Placement.TOKENWISE`: α of each token block to host memory, the rest dropped and
  recomputed (MEMO's rule, :class:`TokenWise`; a tensor without a token dimension stays on the
  device);
- :attr:`Placement.WHOLE`: its whole storage to host memory, nothing of it recomputed;
- :attr:`Placement.KEEP`: it stays on the device until its backward.

The backward rebuilds every tensor bit for bit whatever its placement, so a rule changes memory,
copies and recomputation, never the gradients. The trainer runs the rule ``--memo-offload-rule``
names; the estimator traces a layer with the same rule (``memo_ext.estimate.measure``), so the
preflight and ``memo-estimate`` price it. A rule of one's own is a subclass registered once
(:func:`register`, usable as a class decorator); it applies to layers that run whole (chunked
MEMO places its saves by chunk).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from memo_ext.errors import UsageError

if TYPE_CHECKING:
    import torch  # a saved tensor's dtype, as a type: the rules are read without torch
from memo_ext.features.memo.config import DEFAULT_OFFLOAD_RULE


class Placement(enum.Enum):
    """Where a saved tensor stays until its layer's backward."""

    TOKENWISE = "tokenwise"
    WHOLE = "whole"
    KEEP = "keep"


@dataclass(frozen=True)
class SavedTensor:
    """What a rule sees of one tensor an offloaded layer's forward saves."""

    layer: int
    """The layer's index in the model (0-based, over all pipeline stages)."""
    position: int
    """Its order among the layer's saves outside the core attention."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    """Bytes of the saved view."""
    hidden_size: int
    """The layer input's last dimension (a wider tensor is the MLP's)."""


class OffloadRule(abc.ABC):
    """Places each saved tensor of an offloaded layer (see the module)."""

    name: ClassVar[str]
    """What ``--memo-offload-rule`` calls it."""

    @abc.abstractmethod
    def place(self, saved: SavedTensor) -> Placement:
        """Where ``saved`` goes; called once per save, in the forward's order."""


class TokenWise(OffloadRule):
    """MEMO's rule: every saved tensor token-wise (α to host memory, the rest recomputed)."""

    name = DEFAULT_OFFLOAD_RULE

    def place(self, saved: SavedTensor) -> Placement:
        return Placement.TOKENWISE


RULES: dict[str, type[OffloadRule]] = {TokenWise.name: TokenWise}
"""Every rule ``--memo-offload-rule`` can name."""


def register(rule: type[OffloadRule]) -> type[OffloadRule]:
    """Make ``rule`` nameable by ``--memo-offload-rule``; usable as a class decorator."""
    known = RULES.get(rule.name)
    if known is not None and known is not rule:
        raise ValueError(f"an offload rule named {rule.name!r} is registered already: {known}")
    RULES[rule.name] = rule
    return rule


def unregister(rule: type[OffloadRule]) -> None:
    """Take ``rule`` out of :data:`RULES` (a test's own, after the test)."""
    if RULES.get(rule.name) is rule:
        del RULES[rule.name]


def offload_rule(name: str) -> OffloadRule:
    """The rule ``name`` registered; UsageError naming the registered ones otherwise."""
    if name not in RULES:
        raise UsageError(
            f"--memo-offload-rule {name!r} is no registered rule; registered: "
            f"{', '.join(sorted(RULES))} (memo_ext.memo.rules.register adds one)"
        )
    return RULES[name]()
