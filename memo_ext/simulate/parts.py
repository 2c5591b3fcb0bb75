"""The GPUs the emulated device can be: what CUDA reports for each, by the device table's preset
names (``memo_ext.hardware``).

This module imports neither torch nor the rest of the package (the launcher reads it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmulatedGpu:
    """What ``torch.cuda.get_device_properties`` reports for one GPU model."""

    name: str
    """The device name, as ``nvidia-smi`` and ``torch.cuda.get_device_name`` give it."""
    total_memory: int
    """Bytes, as torch reports them (nvidia-smi's MiB)."""
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132
    gcnArchName: str = ""  # noqa: N815 (torch's name)


GPUS = {
    "a100-80g": EmulatedGpu("NVIDIA A100-SXM4-80GB", 81920 * 2**20, 8, 0, 108),
    "a800-80g": EmulatedGpu("NVIDIA A800-SXM4-80GB", 81920 * 2**20, 8, 0, 108),
    "h100-80g": EmulatedGpu("NVIDIA H100 80GB HBM3", 81559 * 2**20),
    "h800-80g": EmulatedGpu("NVIDIA H800", 81559 * 2**20),
    "h200-141g": EmulatedGpu("NVIDIA H200", 143771 * 2**20),
}
"""The parts the device can be, by the device table's preset names (``memo_ext.hardware``):
real names, so every path that recognises its GPU (device presets, the preflight's traces,
calibration, ``auto`` choices) runs as it does on that GPU, and the clock takes the preset's
rates."""
ALIASES = {"h100": "h100-80g", "h200": "h200-141g"}
"""Short names of the parts (``emulated_cuda(gpu="h200")``)."""


def part(name: str) -> str:
    """The preset name of a part given by preset or short name.

    Raises:
        ValueError: for a part the device cannot be.
    """
    name = ALIASES.get(name, name)
    if name not in GPUS:
        raise ValueError(f"the emulated GPU is one of {', '.join(GPUS)}, got {name!r}")
    return name
