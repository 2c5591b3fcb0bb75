"""megatron-core's own activation offloading, the in-library baselines MEMO is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memo_ext.config.common import installed
from memo_ext.device import on_gpu
from memo_ext.errors import UsageError

if TYPE_CHECKING:
    from memo_ext.config.data import DataConfig
    from memo_ext.config.output import EvaluationConfig
    from memo_ext.config.train import TrainConfig
    from memo_ext.features.hotspa.config import HotSPaConfig
    from memo_ext.features.recompute.config import RecomputeConfig
    from memo_ext.parallel import ParallelLayout

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
"""megatron-core's ``offload_modules`` of a dense GPT layer (its ``expert_fc1`` and ``moe_act``
belong to mixture-of-experts layers, which this trainer does not build)."""
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
"""megatron-core's default of ``min_offloaded_tensor_size``, elements."""


def megatron_offload_missing() -> str | None:
    """What megatron-core's activation offloading needs and this process lacks (``"CUDA"``,
    ``"transformer-engine"`` or both, as a phrase), or ``None``.

    Both of its variants copy on CUDA streams and go through transformer-engine: the layer-level
    one is transformer-engine's own offload context, which megatron-core builds only where
    transformer-engine imports; the fine-grained one raises without transformer-engine's
    ``cpu_offload`` module when it enters a module.
    """
    present = {
        "CUDA": on_gpu(),
        "transformer-engine": installed("transformer_engine"),
    }
    missing = [name for name, here in present.items() if not here]
    return " and ".join(missing) or None


@dataclass(frozen=True, kw_only=True)
class MegatronOffloadConfig:
    """megatron-core's own activation offloading to host memory: the in-library baselines MEMO is
    compared with (CUDA and transformer-engine only; never together with --memo)."""

    cpu_offloading_num_layers: int = 0
    """Layer-level offloading (megatron-core's cpu_offloading, through transformer-engine's offload
    context): the activations of this many layers, at least 1 and fewer than --num-layers, go to
    host memory after their forward and come back for their backward; 0 is off. CUDA and
    transformer-engine; no PP, no recomputation."""
    fine_grained_activation_offloading: bool = False
    """Module-level offloading (megatron-core's fine_grained_activation_offloading): in every layer,
    what the --offload-modules save for backward goes to pinned host memory on a copy stream and
    comes back before their backward; the last layer's stay on the device, its backward comes
    first. CUDA and transformer-engine; no recomputation."""
    offload_modules: tuple[str, ...] = field(default=(), metadata={"choices": OFFLOAD_MODULES})
    """The modules whose saved activations --fine-grained-activation-offloading moves: attn_norm,
    qkv_linear, core_attn, attn_proj (with core_attn), mlp_norm (a norm fused into the next linear
    layer, as in the te layer spec, has nothing of its own to move)."""
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    """Saved tensors of fewer elements than this stay on the device
    (--fine-grained-activation-offloading)."""

    @property
    def layer_offloading(self) -> bool:
        return self.cpu_offloading_num_layers != 0

    @property
    def enabled(self) -> bool:
        return self.layer_offloading or self.fine_grained_activation_offloading

    def megatron_fields(self) -> dict:
        """The ``TransformerConfig`` fields that make megatron-core offload this way."""
        return dict(
            cpu_offloading=self.layer_offloading,
            cpu_offloading_num_layers=self.cpu_offloading_num_layers,
            fine_grained_activation_offloading=self.fine_grained_activation_offloading,
            offload_modules=list(self.offload_modules),
            min_offloaded_tensor_size=self.min_offloaded_tensor_size,
        )

    @property
    def flag(self) -> str:
        """The flag that turned offloading on (for messages)."""
        if self.fine_grained_activation_offloading:
            return "--fine-grained-activation-offloading"
        return "--cpu-offloading-num-layers"

    def check(self, *, num_layers: int) -> None:
        """Refuse what megatron-core would reject (in one sentence instead of its assertion) and
        module flags without --fine-grained-activation-offloading."""
        if self.layer_offloading and not 0 < self.cpu_offloading_num_layers < num_layers:
            raise UsageError(
                f"--cpu-offloading-num-layers must be at least 1 and below --num-layers "
                f"({num_layers}), got {self.cpu_offloading_num_layers}"
            )
        if not self.fine_grained_activation_offloading:
            if self.offload_modules or self.min_offloaded_tensor_size != MIN_OFFLOADED_TENSOR_SIZE:
                raise UsageError(
                    "--offload-modules / --min-offloaded-tensor-size only apply with "
                    "--fine-grained-activation-offloading; add it"
                )
        else:
            self._check_fine_grained()

    def check_machine(self) -> None:
        """Refuse offloading on a machine without CUDA or transformer-engine."""
        missing = megatron_offload_missing() if self.enabled else None
        if missing:
            raise UsageError(
                f"{self.flag} needs {missing} (megatron-core offloads on CUDA copy streams "
                "through transformer-engine), which this machine lacks; drop it (--memo offloads "
                "activations without them)"
            )

    def _check_fine_grained(self) -> None:
        if self.layer_offloading:
            raise UsageError(
                "--cpu-offloading-num-layers and --fine-grained-activation-offloading are "
                "exclusive (megatron-core runs one or the other); choose one"
            )
        if not self.offload_modules:
            raise UsageError(
                "--fine-grained-activation-offloading needs --offload-modules, one or more of "
                f"{' '.join(OFFLOAD_MODULES)}"
            )
        if "attn_proj" in self.offload_modules and "core_attn" not in self.offload_modules:
            raise UsageError(
                "--offload-modules attn_proj needs core_attn too: the projection's input is the "
                "core attention's output, which the core attention's backward needs"
            )
        if self.min_offloaded_tensor_size < 0:
            raise UsageError(
                f"--min-offloaded-tensor-size must be >= 0, got {self.min_offloaded_tensor_size}"
            )

    def check_with(
        self,
        *,
        recompute: RecomputeConfig,
        hotspa: HotSPaConfig,
        layout: ParallelLayout,
        data: DataConfig,
        train: TrainConfig,
        evaluation: EvaluationConfig,
    ) -> None:
        """The offloading against the rest of the run (the sections it reads: what
        megatron-core refuses, what this trainer does not run it with), then the machine;
        --memo refuses it itself."""
        if not self.enabled:
            return
        # (given?, the other flag, why) for each combination this offloading refuses
        conflicts = [
            (
                recompute.granularity is not None,
                "--recompute-granularity",
                "megatron-core refuses layer-level offloading with recomputation, and the "
                "fine-grained one is run here as a baseline of its own, without it",
            ),
            (hotspa.enabled, "--hotspa", "its bucket models are built without it"),
        ]
        if self.layer_offloading:
            no_pp = "megatron-core's layer-level offloading has no pipeline support"
            conflicts.append((layout.pp > 1, "--pipeline-model-parallel-size > 1", no_pp))
        else:
            # fine-grained: megatron-core caches the first training step's micro-batches and
            # walks that cache in every later step (a micro-batch past it is not offloaded), and
            # resets its state only at the end of a training pass of its schedules
            replay = (
                "megatron-core replays the first step's micro-batches, and more would stay on "
                "the device"
            )
            conflicts += [
                (data.variable_seq_lengths, "--variable-seq-lengths", replay),
                (train.rampup_batch_size is not None, "--rampup-batch-size", replay),
                (train.step_batch_size_schedule is not None, "--step-batch-size-schedule", replay),
                (
                    evaluation.enabled,
                    "--eval-interval",
                    "megatron-core resets its offload state only after training passes, so an "
                    "evaluation pass would leave it out of step with the next training step",
                ),
            ]
        for given, other, why in conflicts:
            if given:
                raise UsageError(
                    f"{self.flag} does not run with {other} here: {why}; drop one of them"
                )
        self.check_machine()
