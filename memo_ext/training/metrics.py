"""Model FLOPs, MFU, and the metrics each logged step writes.

FLOPs are counted analytically per global batch (attention included) the way MFU is usually
reported: model FLOPs only, so recomputation does not inflate it. The causal attention
products count half of the full ``s × s`` matrix, since a causal kernel skips the rest.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets (SXM parts).
DEVICE_PEAK_TFLOPS = {
    "A100": 312.0,
    "A800": 312.0,
    "H100": 989.0,
    "H800": 989.0,
    "H200": 989.0,
}


def device_peak_tflops(override: float | None = None) -> float | None:
    """Peak of this process's device: the override, else looked up by CUDA device name."""
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    for key, peak in DEVICE_PEAK_TFLOPS.items():
        if key in name:
            return peak
    logger.warning("no peak known for %s; pass --device-peak-tflops to get MFU", name)
    return None


def gpt_forward_flops(
    *,
    config: TransformerConfig,
    vocab_size: int,
    seq_length: int,
    sequences: int,
    causal_fraction: float = 0.5,
) -> float:
    """Forward FLOPs of ``sequences`` samples of ``seq_length`` tokens through the whole GPT.

    ``causal_fraction`` is the share of the ``s × s`` attention products that is computed: 0.5
    for a causal kernel that skips the masked half, 1.0 to count the full matrices.
    """
    h, s, layers = config.hidden_size, seq_length, config.num_layers
    heads, groups = (
        config.num_attention_heads,
        config.num_query_groups or config.num_attention_heads,
    )
    d = config.kv_channels or h // heads
    tokens = sequences * s
    qkv = 2 * tokens * h * (heads + 2 * groups) * d
    # QK^T and PV, each 2·s·s·d per head, of which the causal kernel computes a fraction
    attention = 2 * (2 * sequences * heads * s * s * d) * causal_fraction
    proj = 2 * tokens * heads * d * h
    mlp_matrices = 3 if config.gated_linear_unit else 2
    mlp = 2 * tokens * h * config.ffn_hidden_size * mlp_matrices
    logits = 2 * tokens * h * vocab_size
    return layers * (qkv + attention + proj + mlp) + logits


def packed_train_flops(
    *, config: TransformerConfig, vocab_size: int, document_lengths: list[int]
) -> float:
    """Training FLOPs of packed documents: each attends only within itself, so the attention
    term is per document while everything else is per token."""
    return sum(
        gpt_train_flops(config=config, vocab_size=vocab_size, seq_length=n, sequences=1)
        for n in document_lengths
    )


def gpt_train_flops(**kwargs) -> float:
    """Forward + backward (twice the forward) model FLOPs; recomputation not counted."""
    return 3.0 * gpt_forward_flops(**kwargs)


@dataclass
class StepMetrics:
    """One logged step; keys of the metrics file (DESIGN §5)."""

    iteration: int
    loss: float
    grad_norm: float | None
    lr: float
    step_time_s: float
    tokens_per_s: float
    consumed_samples: int
    skipped_iterations: int = 0
    tflops_per_device: float | None = None
    mfu: float | None = None
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    extra: dict = field(default_factory=dict)
    """Further figures of this step (validation, MEMO, HotSPa), written as top-level keys."""

    def to_json(self) -> dict:
        record = {k: v for k, v in self.__dict__.items() if v is not None and k != "extra"}
        record.update(self.extra)
        return record

    def console_line(self, train_iters: int) -> str:
        parts = [
            f"iter {self.iteration:>6}/{train_iters}",
            f"loss {self.loss:.4f}",
            f"grad norm {self.grad_norm:.3f}" if self.grad_norm is not None else "grad norm -",
            f"lr {self.lr:.3e}",
            f"{self.step_time_s * 1e3:.0f} ms/step",
            f"{self.tokens_per_s:,.0f} tok/s",
        ]
        if self.tflops_per_device is not None:
            parts.append(f"{self.tflops_per_device:.3g} TFLOP/s/dev")
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        if self.mem_allocated_bytes is not None:
            parts.append(f"mem {self.mem_allocated_bytes / 2**30:.2f} GiB")
        if "val_loss" in self.extra:
            parts.append(f"val loss {self.extra['val_loss']:.4f} (ppl {self.extra['val_ppl']:.2f})")
        return " | ".join(parts)


def cuda_memory() -> tuple[int | None, int | None]:
    """(allocated, reserved) peak bytes on this device since the last call, CUDA only."""
    if not torch.cuda.is_available():
        return None, None
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    return allocated, reserved


class MetricsWriter:
    """Appends one JSON object per logged step; a no-op when no file was asked for.

    A fresh run starts the file empty. A resumed run (``resume_from`` = the checkpoint's
    iteration) keeps the records up to that iteration and drops later ones, which a run that
    died after its last checkpoint left behind, so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str | None, *, resume_from: int = 0):
        self.path = Path(path) if path else None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_from and self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line)["iteration"] <= resume_from:
                    kept.append(line + "\n")
        self.path.write_text("".join(kept))

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


class TensorBoardWriter:
    """Scalars of each logged record under ``train/`` (``val/`` for validation), rank 0 only."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["iteration"]
        for key, value in record.items():
            if key == "iteration" or not isinstance(value, (int, float)):
                continue
            group = "val" if key.startswith("val_") else "train"
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
