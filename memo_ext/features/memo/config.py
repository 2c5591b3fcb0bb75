"""MEMO's section: token-wise activation swapping and recomputation, chunking, the planned
allocator, and what MEMO cannot run with."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from memo_ext.config.common import AUTO, check_writable_directory
from memo_ext.device import on_gpu
from memo_ext.errors import UsageError
from memo_ext.flags import finite_float

if TYPE_CHECKING:
    from memo_ext.config.data import DataConfig
    from memo_ext.config.network import ModelConfig
    from memo_ext.features.megatron_offload.config import MegatronOffloadConfig
    from memo_ext.features.recompute.config import RecomputeConfig
    from memo_ext.parallel import ParallelLayout
    from memo_ext.shapes import ModelShape

DEFAULT_OFFLOAD_RULE = "tokenwise"
"""MEMO's own offload rule (``memo_ext.memo.rules.TokenWise``)."""

DEFAULT_HOST_SHARE = 0.8
"""Share of the available host memory MEMO may take when no budget is given: the rest is for the
data loader, the optimizer's host state and the operating system."""


def _value_or_auto(text: str, convert, *, auto, expected: str):
    """``auto`` as ``auto``, anything else through ``convert``; argparse's error otherwise."""
    if text == AUTO:
        return auto
    try:
        return convert(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"must be {expected} or 'auto', got {text!r}") from None


def parse_alpha(text: str) -> float | None:
    """``--memo-alpha``: a number, or ``auto`` (``None``: solved at the first layer)."""
    return _value_or_auto(text, finite_float, auto=None, expected="a number in [0, 1]")


def parse_chunk_tokens(text: str) -> int | str:
    """``--memo-chunk-tokens``: a token count, or ``auto`` (settled by ``resolve_run``)."""
    return _value_or_auto(text, int, auto=AUTO, expected="a positive token count")


@dataclass(frozen=True, kw_only=True)
class MemoConfig:
    """Token-wise activation swapping and recomputation (MEMO) for every transformer layer."""

    FLAG_PREFIX: ClassVar[str] = "memo"

    enabled: bool = field(default=False, metadata={"flag": "--memo"})
    """Turn MEMO on."""
    alpha: float | None = field(default=None, metadata={"parse": parse_alpha})
    """Fraction of each token-wise activation's tokens kept in host memory, in [0, 1], or 'auto'
    (largest α whose copy hides under a layer's forward and fits the host budget). Default: auto."""
    host_memory_gb: float | None = None
    """Host memory MEMO may use per process, GiB. Default: 80% of the available memory divided by
    the processes on this node."""
    keep_last_layers: int | None = None
    """Layers at the end of each pipeline stage that keep their activations on the device: their
    backward starts right after their forward, so a round trip to the host would not pay.
    Default: 2; 0 with --memo-chunk-tokens (a kept layer holds its whole saved set on the device,
    which chunking otherwise keeps off it)."""
    chunk_tokens: int | Literal["auto"] | None = field(
        default=None, metadata={"parse": parse_chunk_tokens}
    )
    """Run each layer's token-local work (norms, QKV and output projections, MLP, residual adds)
    over sub-sequence chunks of this many local tokens (after SP / CP sharding), the core
    attention still over the whole sequence; MEMO then offloads or drops saved tensors chunk by
    chunk, so a layer's device memory beyond attention's inputs and output is a few chunks, not
    the sequence. 'auto': the smallest chunk whose matrix products and collectives the estimator
    puts within 2% of the whole sequence's time on this run's device. Default: off."""
    offload_rule: str = DEFAULT_OFFLOAD_RULE
    """Where each offloaded layer's saved tensors go, beyond the layer input and attention's
    output and state (always to host memory whole): a rule registered in memo_ext.memo.rules
    places each one token-wise (α of its tokens to host memory, the rest recomputed), whole to
    host memory, or kept on the device. tokenwise is MEMO's rule; a rule of one's own is a
    registered subclass of memo_ext.memo.rules.OffloadRule. Layers that run whole only (not with
    --memo-chunk-tokens)."""
    allocator: Literal["off", "plan"] = "off"
    """plan: serve each offloaded layer's forward / backward transients at the offsets the memory
    planner computed for its recorded request sequence, inside one arena (no fragmentation); off:
    the default allocator."""
    plan_cache: str | None = None
    """Directory of cached pass plans (by digest of the request sequence and the run's shapes).
    Default: $XDG_CACHE_HOME/memo_ext/plans (~/.cache/memo_ext/plans)."""
    plan_work_limit: float = 30.0
    """Work the planner may spend on one pass sequence, in work units of about a second of one
    core each: counted, not timed, so a busy machine makes the same plan, later."""
    plan_time_limit: float | None = None
    """Safety net of one pass sequence's plan, CPU seconds of the process (default 10 per work
    unit, plus 10): a search still running then stops where it is, with a valid plan and a
    warning."""

    @property
    def plan_cache_dir(self) -> str:
        """Where pass plans are cached."""
        if self.plan_cache:
            return self.plan_cache
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "memo_ext", "plans")

    @property
    def kept_layers(self) -> int:
        """``keep_last_layers``, its default settled (see the field)."""
        if self.keep_last_layers is not None:
            return self.keep_last_layers
        return 0 if self.chunk_tokens is not None else 2

    @property
    def auto_alpha(self) -> bool:
        return self.alpha is None

    def check(self) -> None:
        """Refuse values MEMO cannot honour; MEMO flags without --memo."""
        if not self.enabled:
            given = [
                f"--memo-{f.name.replace('_', '-')}"
                for f in dataclasses.fields(self)
                if f.name != "enabled" and getattr(self, f.name) != f.default
            ]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise UsageError(f"{', '.join(given)} only {verb} with --memo; add --memo")
            return
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise UsageError(f"--memo-alpha must be in [0, 1] or 'auto', got {self.alpha}")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            raise UsageError(f"--memo-host-memory-gb must be positive, got {self.host_memory_gb}")
        if self.keep_last_layers is not None and self.keep_last_layers < 0:
            raise UsageError(f"--memo-keep-last-layers must be >= 0, got {self.keep_last_layers}")
        if self.plan_cache:
            check_writable_directory(self.plan_cache, flag="--memo-plan-cache")
        if not self.plan_work_limit > 0:
            raise UsageError(f"--memo-plan-work-limit must be positive, got {self.plan_work_limit}")
        if self.plan_time_limit is not None and not self.plan_time_limit > 0:
            raise UsageError(f"--memo-plan-time-limit must be positive, got {self.plan_time_limit}")
        if isinstance(self.chunk_tokens, int) and self.chunk_tokens < 1:
            raise UsageError(f"--memo-chunk-tokens must be >= 1 or 'auto', got {self.chunk_tokens}")
        if self.offload_rule != DEFAULT_OFFLOAD_RULE and self.chunk_tokens is not None:
            raise UsageError(
                f"--memo-offload-rule {self.offload_rule} places the saves of layers that run "
                "whole; chunked MEMO (--memo-chunk-tokens) places its own by chunk; drop one"
            )

    @staticmethod
    def check_combination(
        *,
        hidden_dropout: float,
        recompute_granularity: str | None,
        attention_backend: str,
        cpu_offloading: bool = False,
        fine_grained_activation_offloading: bool = False,
    ) -> None:
        """Refuse what MEMO cannot run with, one sentence each.

        Hidden dropout sits in the token-local part that is recomputed on a token slice, where it
        would draw other masks; attention dropout is fine (attention is never re-run).
        """
        if hidden_dropout > 0.0:
            raise UsageError(
                f"--memo recomputes token slices and cannot reproduce hidden-dropout masks; "
                f"use --hidden-dropout 0 (got {hidden_dropout})"
            )
        if recompute_granularity is not None:
            raise UsageError(
                "--memo replaces megatron's activation recomputation; drop --recompute-granularity"
            )
        if attention_backend == "te":
            raise UsageError(
                "--memo works on layers with our core attention; use --attention-backend sdpa or "
                "flash"
            )
        if cpu_offloading or fine_grained_activation_offloading:
            raise UsageError(
                "--memo cannot run with megatron-core's own activation offloading "
                "(--cpu-offloading-num-layers, --fine-grained-activation-offloading); drop one"
            )

    def check_with(
        self,
        *,
        model: ModelConfig,
        recompute: RecomputeConfig,
        offload: MegatronOffloadConfig,
        data: DataConfig,
        shape: ModelShape,
        layout: ParallelLayout,
    ) -> None:
        """MEMO against the rest of the run (the sections it reads): what it cannot run with,
        what chunking and the planned allocator cannot, and a stage it would leave without an
        offloaded layer."""
        if not self.enabled:
            return
        self.check_combination(
            hidden_dropout=model.hidden_dropout,
            recompute_granularity=recompute.granularity,
            attention_backend=model.attention_backend,
            cpu_offloading=offload.layer_offloading,
            fine_grained_activation_offloading=offload.fine_grained_activation_offloading,
        )
        if self.allocator == "plan":
            self._check_planned_allocator(variable_seq_lengths=data.variable_seq_lengths)
        if self.chunk_tokens is not None and data.variable_seq_lengths:
            raise UsageError(
                "--memo-chunk-tokens cannot chunk packed documents (--variable-seq-lengths, "
                "--hotspa): RoPE positions restart per document; drop one of them"
            )
        self.check_offloads(stage_layers=shape.num_layers // layout.pp)

    def check_offloads(self, *, stage_layers: int) -> None:
        """Raises UsageError when the kept last layers leave a stage nothing to offload."""
        if self.kept_layers >= stage_layers:
            raise UsageError(
                f"--memo would offload no layer: each pipeline stage has {stage_layers} layers and "
                f"--memo-keep-last-layers {self.kept_layers} keeps them all on the "
                "device; lower --memo-keep-last-layers or drop --memo"
            )

    @staticmethod
    def _check_planned_allocator(*, variable_seq_lengths: bool) -> None:
        """What cannot run under a process-wide plan-serving allocator, one sentence each."""
        if variable_seq_lengths:
            raise UsageError(
                "--memo-allocator plan serves one recorded request sequence per layer pass, and "
                "packed documents (--variable-seq-lengths, --hotspa) change it every step; drop "
                "one of them"
            )
        if on_gpu() and "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise UsageError(
                "--memo-allocator plan replaces PyTorch's caching allocator, so "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments cannot apply; unset it"
            )
