"""The device table: accelerators, their peaks and links, and this machine's memory.

:data:`DEVICES` is the one place device facts live: MFU in the training metrics divides by its
peaks, the estimator and the preflight check runs against its memory and bandwidths, HotSPa's
``auto`` plans for one of its entries. :func:`cuda_device` finds this process's entry by its CUDA
name. A :class:`Calibration` file holds what one machine was measured to achieve (kernel
efficiencies, host-link bandwidth) in place of the table's assumptions.

This module imports nothing else from the package (but ``memo_ext.errors``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from memo_ext.device import on_gpu
from memo_ext.errors import UsageError

logger = logging.getLogger(__name__)

GIB = 2**30


def parse_gib(text: str) -> int:
    """A size in GiB (``80``, ``79.5``) as bytes."""
    return int(float(text) * GIB)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and the links around it (bandwidths achieved, not nominal)."""

    name: str = dataclasses.field(metadata={"cli": False})
    """Preset name (or ``custom``)."""
    peak_tflops: float = dataclasses.field(metadata={"flag": "--device-peak-tflops"})
    """Dense bf16 tensor-core peak, TFLOP/s."""
    memory_bytes: int = dataclasses.field(
        metadata={"flag": "--device-memory-gb", "parse": parse_gib, "metavar": "GIB"}
    )
    """Device memory capacity (given in GiB)."""
    host_link_gbps: float
    """Achieved bandwidth of one host-link uplink (the PCIe switch's link to the CPU) per
    direction, GB/s (1e9 bytes): what one GPU reaches copying alone."""
    nvlink_gbps: float
    """Achieved collective bus bandwidth inside a node, GB/s (NCCL ``busbw``)."""
    internode_gbps: float
    """Achieved network bandwidth per GPU between nodes, GB/s."""
    gpus_per_node: int = 8
    """GPUs sharing one node (one NVLink domain and one host memory)."""
    gpus_per_host_link: int = 2
    """GPUs behind one host-link uplink: GPUs copying at once share its bandwidth."""
    numa_nodes: int = 2
    """CPU sockets (NUMA nodes) of a node; the node's GPUs and uplinks split evenly among them.
    Host buffers are assumed on their GPU's own socket (a copy crossing the socket link is
    not modelled)."""
    hbm_gbps: float | None = None
    """Device memory bandwidth, GB/s (data sheet); bounds the speed of thin matrix products.
    ``None``: not modelled (matrix products run at the matmul efficiency whatever their shape)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "gpus_per_host_link", "numa_nodes"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be at least 1, got {getattr(self, name)}")

    def host_copy_gbps(self, gpus_copying: int) -> float:
        """Device ↔ host bandwidth per GPU and direction, GB/s, while ``gpus_copying`` GPUs of a
        node copy at once (MEMO's ranks all copy each layer's activations at the same time):
        GPUs behind one uplink share it."""
        sharing = max(1, min(self.gpus_per_host_link, gpus_copying))
        return self.host_link_gbps / sharing

    @property
    def topology(self) -> str:
        """The node as one line: GPUs, uplinks and sockets."""
        links = max(1, self.gpus_per_node // self.gpus_per_host_link)
        return (
            f"{self.gpus_per_node} GPUs, {self.gpus_per_host_link} per host link of "
            f"{self.host_link_gbps:g} GB/s ({links} links), {self.numa_nodes} sockets"
        )

    @property
    def cuda_name(self) -> str:
        """What the CUDA device name contains for this part (``A100``, ``H200``)."""
        return self.name.split("-")[0].upper()


# Sources and assumptions, per figure:
# - peak: NVIDIA data sheets, dense bf16 of the SXM parts: A100 / A800 312, H100 / H800 / H200 989
#   TFLOP/s.
# - memory: data sheets; "80 GB" parts have 80 GiB of HBM (81,920 MiB reported by nvidia-smi for
#   A100 / A800; H100 / H800 report 81,559 MiB); H200 reports 143,771 MiB.
# - host link: PCIe Gen4 x16 is 32 GB/s per direction nominal, about 25 GB/s achieved with pinned
#   memory (A100 / A800); Gen5 x16 is 64 GB/s nominal, about 50 GB/s achieved (H100 / H800 /
#   H200).
# - GPUs per host link: on the 8-GPU HGX / DGX boards of these parts (A100 / A800: DGX A100 and
#   HGX A100 8-GPU; H100 / H800 / H200: DGX H100 / HGX H100 and H200 8-GPU) the GPUs sit in pairs
#   behind PCIe switches, each switch with one x16 uplink to a CPU (NVIDIA's DGX A100 and DGX H100
#   system architecture documents, their PCIe topology figures; ``nvidia-smi topo -m`` shows
#   the pairs as PIX / PXB). Two GPUs copying at once get half an uplink each: 12.5 GB/s per GPU
#   on A100 / A800. The MEMO paper's Fig. 1(b) (a 7B layer's offload hides under its forward
#   beyond about 192K tokens at TP 8 on 8 A800) is consistent with that figure, not with 25
#   (see docs/estimate.md, "Held against the MEMO paper").
# - sockets: two CPUs per node on those boards, four GPUs (two uplinks) on each.
# - NVLink: per-direction NVLink bandwidth (A100 300, A800 and H800 200, H100 / H200 450 GB/s)
#   times about 0.8, what NCCL's all-gather / reduce-scatter bus bandwidth reaches on 8 GPUs.
# - HBM: data sheets of the SXM parts: A100 / A800 80 GB 2,039 GB/s, H100 / H800 3,350 GB/s, H200
#   4,800 GB/s (the time model applies an achieved fraction, ``memo_ext.estimate.cost_model``).
# - network: assumption of one 200 Gb/s NIC per GPU (HDR InfiniBand, ~22 GB/s achieved) for
#   A100 / A800 and one 400 Gb/s NIC per GPU (NDR, ~45 GB/s achieved) for the Hopper parts.
DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("a100-80g", 312.0, 80 * GIB, 25.0, 240.0, 22.0, hbm_gbps=2039.0),
        DeviceSpec("a800-80g", 312.0, 80 * GIB, 25.0, 160.0, 22.0, hbm_gbps=2039.0),
        DeviceSpec("h100-80g", 989.0, 81559 * 2**20, 50.0, 360.0, 45.0, hbm_gbps=3350.0),
        DeviceSpec("h800-80g", 989.0, 81559 * 2**20, 50.0, 160.0, 45.0, hbm_gbps=3350.0),
        DeviceSpec("h200-141g", 989.0, 143771 * 2**20, 50.0, 360.0, 45.0, hbm_gbps=4800.0),
    )
}
"""Device presets by name."""


def device_spec(name: str, **overrides) -> DeviceSpec:
    """A device preset with fields replaced by the non-``None`` ``overrides``.

    Raises:
        UsageError: for an unknown device name.
    """
    if name not in DEVICES:
        raise UsageError(f"--gpu must be one of {', '.join(DEVICES)}, got {name!r}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(DEVICES[name], **changes)


def cuda_device() -> DeviceSpec | None:
    """This process's CUDA device as a preset with its real memory, or ``None`` (no CUDA, or a
    device the table does not know)."""
    if not on_gpu():
        return None
    import torch  # only on a GPU: the flags are parsed before torch loads

    name = torch.cuda.get_device_name().upper()
    total = torch.cuda.get_device_properties(0).total_memory
    for spec in DEVICES.values():
        if spec.cuda_name in name:
            return dataclasses.replace(spec, memory_bytes=total)
    return None


def device_peak_tflops(override: float | None = None) -> float | None:
    """Dense peak of this process's device for MFU: the override, else the table's entry for the
    CUDA device (``None`` on the CPU or for an unknown device, with a warning for the latter)."""
    if override is not None:
        return override
    if not on_gpu():
        return None
    spec = cuda_device()
    if spec is None:
        import torch

        logger.warning(
            "no peak known for %s; pass --device-peak-tflops to get MFU",
            torch.cuda.get_device_name(),
        )
        return None
    return spec.peak_tflops


def available_host_memory_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, or total physical memory where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---------------------------------------------------------------------------------------------
# Calibration: what a machine really achieves, measured by memo-compare --calibrate
# ---------------------------------------------------------------------------------------------

CALIBRATION_FORMAT = "memo-calibration/1"


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Achieved kernel rates and host-link bandwidth of one machine, which replace the
    estimator's assumed efficiencies (``memo_ext.estimate.calibration.apply_calibration``)."""

    device: str
    """The device measured: a preset name (``h200-141g``), or ``cpu``."""
    peak_tflops: float
    """The peak the efficiencies are fractions of (the preset's, or on CPU the measured rate of a
    large square matrix product)."""
    matmul_efficiency: float
    """Achieved fraction of ``peak_tflops`` on a layer's non-attention FLOPs."""
    attention_efficiency: float
    """Achieved fraction of ``peak_tflops`` on attention FLOPs (causal half counted)."""
    host_link_gbps: float
    """Achieved device ↔ host copy bandwidth per GPU, GB/s (the slower direction), measured with
    every visible GPU copying at once (``host_link_gpus`` of them: uplinks shared by GPUs are
    shared here too)."""
    host_link_gpus: int = 0
    """GPUs that copied at once when ``host_link_gbps`` was measured (``0``: not recorded, as in
    files written before it was; read as one GPU alone)."""
    source: str = "microbenchmark"
    """How the efficiencies were found: ``microbenchmark`` (kernels timed alone) or ``fit``
    (least squares on the measured step times of real runs)."""
    details: dict = dataclasses.field(default_factory=dict)
    """What was measured: kernel timings, the runs fitted and their errors (free-form)."""

    def check(self, *, path: str = "calibration") -> None:
        """Raises UsageError for a value no machine has."""
        for name in ("matmul_efficiency", "attention_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise UsageError(f"{path}: {name} must be in (0, 1], got {value}")
        for name in ("peak_tflops", "host_link_gbps"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{path}: {name} must be positive, got {getattr(self, name)}")


def read_calibration(path: str) -> Calibration:
    """A calibration file (``memo-calibration/1`` JSON) as a checked :class:`Calibration`.

    Raises:
        UsageError: for a missing, unreadable or malformed file, naming it.
    """
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the open
        raise UsageError(f"--calibration {path} is not a regular file; give the JSON file")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise UsageError(f"--calibration {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"--calibration {path}: not JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise UsageError(
            f"--calibration {path}: not a {CALIBRATION_FORMAT} file (write one with "
            "memo-compare --calibrate)"
        )
    names = {f.name for f in dataclasses.fields(Calibration)}
    try:
        calibration = Calibration(**{k: v for k, v in data.items() if k in names})
    except TypeError:
        missing = sorted(n for n in names - set(data) if n not in ("source", "details"))
        raise UsageError(f"--calibration {path}: lacks {', '.join(missing)}") from None
    calibration.check(path=f"--calibration {path}")
    return calibration


def write_calibration(path: str, calibration: Calibration) -> None:
    """Writes ``calibration`` as a ``memo-calibration/1`` JSON file."""
    calibration.check()
    with open(path, "w") as f:
        json.dump({"format": CALIBRATION_FORMAT, **dataclasses.asdict(calibration)}, f, indent=1)
        f.write("\n")
