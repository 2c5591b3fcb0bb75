"""What ``pretrain_gpt_memo.py`` does with each Megatron-LM flag that is not one of its own.

A flag of Megatron-LM's list (:mod:`.flags`) is either one of ours (same spelling, implemented:
the trainer's parser has it), or it has a :class:`Handling` here:

- ``same``: accepted, because its meaning is already what this trainer does
  (``--use-mcore-models``, ``--ckpt-format torch_dist``); ``values`` limits it to the values
  that are (another value is refused with ``otherwise``);
- ``mapped``: rewritten onto our flags (``--recompute-activations`` →
  ``--recompute-granularity selective``); a CUDA-only switch (``--use-flash-attn``) has no
  effect on a machine without CUDA, as our own CUDA-only switches: noticed, and the run goes on;
- ``no effect``: accepted and logged as doing nothing here (Megatron's timer and console
  cosmetics that have no counterpart in this trainer and change no result);
- ``refused``: named, with the reason, in the one message that lists every refused flag of the
  command line.

Whole Megatron-LM argument groups this trainer has no part of (mixture of experts, multi-latent
attention, vision, retrieval, RL, inference serving, fault-tolerance services) are refused by
group (:data:`GROUP_REASONS`), except where a flag is given its Megatron-LM default, which asks
for nothing (``--expert-model-parallel-size 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from memo_ext.config.common import installed
from memo_ext.config.data import TOKENIZER_TYPES
from memo_ext.config.network import resolve_attention_backend
from memo_ext.device import on_gpu
from memo_ext.megatron_lm.flag_table import MegatronFlag

Status = Literal["same", "mapped", "no effect", "refused"]
Given = Mapping[str, list[str]]
"""Every flag of the command line (its main Megatron-LM spelling, or ours) → its value texts."""


@dataclass(frozen=True)
class Handling:
    """How one Megatron-LM flag is handled here (see the module docstring)."""

    status: Status
    note: str
    """What it does here (same, mapped, no effect) or why it is refused, as one clause."""
    to: Callable[[list[str], Given], list[str]] | tuple[str, ...] | None = None
    """``mapped``: our flags for it, fixed or from its values and the rest of the command line."""
    values: tuple[str, ...] | None = None
    """``same``: the values that are our behaviour (``None``: any)."""
    otherwise: str = ""
    """``same`` with ``values``: why another value is refused."""

    def rewrite(self, values: list[str], given: Given) -> list[str]:
        if self.to is None:
            return []
        if callable(self.to):
            return self.to(values, given)
        return list(self.to)


class Refuse(Exception):
    """Raised by a mapping that cannot run on this machine; its message is the reason."""


class NoEffectHere(Exception):
    """Raised by the mapping of a CUDA-only switch on a machine without CUDA (a GPU launch
    script smoke-tested on CPU): the run goes on without it; its message is the reason."""


def same(
    note: str, *, values: tuple[str, ...] | None = None, otherwise: str = "not implemented here"
) -> Handling:
    return Handling("same", note, values=values, otherwise=otherwise)


def mapped(note: str, to: Callable[[list[str], Given], list[str]] | tuple[str, ...]) -> Handling:
    return Handling("mapped", note, to=to)


def no_effect(note: str) -> Handling:
    return Handling("no effect", note)


def refused(reason: str) -> Handling:
    return Handling("refused", reason)


def _attention_backend(values: list[str], given: Given) -> list[str]:
    """Megatron-LM's fused / unfused backends are transformer-engine's, local is its own unfused
    PyTorch attention; ours are SDPA, flash-attn and transformer-engine."""
    (value,) = values
    if value == "local":
        return ["--attention-backend", "sdpa"]
    if on_gpu() and installed("transformer_engine"):
        return ["--attention-backend", "te"]
    return ["--attention-backend", "sdpa"]


def _use_flash_attn(values: list[str], given: Given) -> list[str]:
    if not on_gpu():  # as --cross-entropy-loss-fusion and the other CUDA-only switches here
        raise NoEffectHere("flash attention needs CUDA; the run goes on without it")
    try:
        resolve_attention_backend("flash")
    except ValueError:
        raise Refuse("flash attention needs CUDA and the flash_attn package here") from None
    return ["--attention-backend", "flash"]


def _group_query_attention(values: list[str], given: Given) -> list[str]:
    # Megatron-LM's --num-query-groups defaults to 1 and only counts with this switch
    return [] if "--num-query-groups" in given else ["--num-query-groups", "1"]


def _no_position_embedding(values: list[str], given: Given) -> list[str]:
    if "--position-embedding-type" in given or "--use-rotary-position-embeddings" in given:
        return []
    return ["--position-embedding-type", "rope"]


ATTENTION_VALUES = ("flash", "fused", "unfused", "local", "auto")
"""Megatron-LM's ``AttnBackend`` names (``choices=list(AttnBackend)`` in its source)."""

VALUE_MAPS: dict[str, Handling] = {
    "--attention-backend": mapped(
        "Megatron-LM's fused / unfused are transformer-engine's kernels (te where it runs, else "
        "SDPA, the same attention), local is unfused PyTorch attention (sdpa); flash and auto "
        "are our own spellings too (flash-attn; auto picks te, flash-attn, then SDPA)",
        _attention_backend,
    ),
}
"""Flags of ours whose Megatron-LM values are spelled differently: rewritten before parsing."""

VALUE_REASONS: dict[str, str] = {
    "--tokenizer-type": "BERT word pieces and the multimodal and SFT tokenizers are not part of "
    f"this pretraining trainer; it reads {', '.join(TOKENIZER_TYPES)}",
    "--position-embedding-type": "learned absolute, rotary and YaRN positions are implemented here",
    "--lr-decay-style": "megatron-core's scheduler styles other than this are not wired here",
    "--normalization": "LayerNorm and RMSNorm are implemented here",
}
"""Why a Megatron-LM value of one of our flags, outside our choices, is refused."""

GROUP_REASONS: dict[str, str] = {
    "moe": "mixture-of-experts models are not supported here (dense GPT only)",
    "mla": "multi-latent attention is not supported here",
    "rl": "reinforcement-learning training is not part of this trainer",
    "inference": "inference serving and CUDA graphs are not part of this trainer",
    "vision": "vision models are not part of this trainer",
    "biencoder": "retrieval bi-encoders are not part of this trainer",
    "retro": "RETRO is not part of this trainer",
    "heterogeneous": "heterogeneous layer configurations are not supported here",
    "experimental": "hybrid Mamba models, YAML configs and precision-aware optimizers are not "
    "supported here",
    "one_logger": "NVIDIA one-logger telemetry is not part of this trainer",
    "inprocess_restart": "in-process restart (nvidia-resiliency-ext) is not part of this trainer; "
    "restart the job with --load",
    "ft_package": "the fault-tolerance package is not part of this trainer; restart with --load",
    "straggler_detector": "the straggler detector is not part of this trainer",
    "workload_inspector_server": "the workload inspector server is not part of this trainer",
    "config_logger": "the config logger is not part of this trainer",
    "rerun_machine": "the rerun state machine is not part of this trainer",
    "msc": "the multi-storage client is not part of this trainer",
    "kitchen_quantization": "kitchen quantization is not supported here",
    "sft": "supervised fine-tuning data is not supported here (pretraining only)",
    "autoresume": "ADLR autoresume is not part of this trainer; use --exit-signal-handler",
}

_FP8 = "fp8 / fp4 training is not supported here"
_TP_OVERLAP = "TP communication / GEMM overlap (userbuffers) is not supported here"
_FSDP = "FSDP is not supported here; use --use-distributed-optimizer"
_NONPERSISTENT = "non-persistent and local checkpoints are not supported here"
_LOGGING = "Megatron-LM's timers and console extras have no counterpart here"
_FUSION = (
    "element-wise kernel fusion follows the layer implementation here (transformer-engine's "
    "on CUDA, unfused otherwise)"
)
_LEGACY = "a deprecated Megatron-LM flag without effect there either"

HANDLING: dict[str, Handling] = {
    # ---- network size ----------------------------------------------------------------------
    "--encoder-num-layers": refused("encoder-decoder models are not supported here"),
    "--decoder-num-layers": refused("encoder-decoder models are not supported here"),
    "--group-query-attention": mapped(
        "grouped-query attention: --num-query-groups counts only with it (alone: one group, "
        "Megatron-LM's default)",
        _group_query_attention,
    ),
    "--softmax-type": same(
        "vanilla softmax attention", values=("vanilla",), otherwise="only vanilla softmax"
    ),
    "--window-size": refused("sliding-window attention is not supported here"),
    "--window-attn-skip-freq": refused("sliding-window attention is not supported here"),
    "--relative-attention-num-buckets": refused("T5 relative attention is not supported here"),
    "--relative-attention-max-distance": refused("T5 relative attention is not supported here"),
    "--use-rotary-position-embeddings": mapped(
        "Megatron-LM's older spelling", ("--position-embedding-type", "rope")
    ),
    "--rotary-percent": same(
        "rotary embeddings over the whole head dimension",
        values=("1.0", "1"),
        otherwise="partial rotary embeddings are not implemented here",
    ),
    "--rotary-interleaved": refused("interleaved rotary embeddings are not implemented here"),
    "--no-rope-freq": refused("NoPE layers are not implemented here"),
    "--no-position-embedding": mapped(
        "no learned position table: rotary positions unless --position-embedding-type says",
        _no_position_embedding,
    ),
    "--mrope-section": refused("multimodal RoPE is not supported here"),
    "--apply-residual-connection-post-layernorm": refused(
        "post-norm residuals are not implemented here (pre-norm GPT)"
    ),
    "--squared-relu": refused("squared-ReLU MLPs are not implemented here"),
    "--quick-geglu": refused("quick-GeGLU MLPs are not implemented here"),
    "--activation-func-clamp-value": refused("clamped activations are not implemented here"),
    "--glu-linear-offset": refused("GLU offsets are not implemented here"),
    "--onnx-safe": no_effect("ONNX export is not part of training"),
    "--bert-no-binary-head": refused("BERT is not part of this trainer"),
    "--multi-latent-attention": refused(GROUP_REASONS["mla"]),
    "--mtp-num-layers": refused("multi-token prediction is not supported here"),
    "--mtp-loss-scaling-factor": refused("multi-token prediction is not supported here"),
    # ---- regularization / optimizer ----------------------------------------------------------
    "--sgd-momentum": refused("only Adam(W) is wired here"),
    # ---- training ----------------------------------------------------------------------------
    "--batch-size": refused("removed from Megatron-LM; use --micro-batch-size"),
    "--decrease-batch-size-if-needed": refused(
        "the global batch is fixed by the flags here; set --global-batch-size"
    ),
    "--recompute-activations": mapped(
        "selective recomputation, as in Megatron-LM", ("--recompute-granularity", "selective")
    ),
    "--check-for-spiky-loss": refused("needs Megatron-LM's rerun state machine"),
    "--check-for-large-grads": refused("needs Megatron-LM's rerun state machine"),
    "--distribute-saved-activations": refused(
        "use --memo to move saved activations off the device"
    ),
    "--recompute-modules": refused(
        "per-module selective recomputation is not wired here; use --recompute-granularity"
    ),
    "--no-clone-scatter-output-in-embedding": refused("not wired here"),
    "--iterations-to-skip": refused("skipping listed iterations is not implemented here"),
    "--result-rejected-tracker-filename": refused("needs Megatron-LM's rerun state machine"),
    "--disable-gloo-process-groups": no_effect(
        "megatron-core's extra gloo groups are not created here"
    ),
    "--record-memory-history": refused(
        "use python -m tools.plan_memory to record a layer's allocations"
    ),
    "--memory-snapshot-path": refused(
        "use python -m tools.plan_memory to record a layer's allocations"
    ),
    "--tp-comm-overlap": refused(_TP_OVERLAP),
    "--tp-comm-overlap-cfg": refused(_TP_OVERLAP),
    "--disable-tp-comm-overlap-ag": refused(_TP_OVERLAP),
    "--disable-tp-comm-overlap-rs": refused(_TP_OVERLAP),
    "--tp-comm-overlap-rs-dgrad": refused(_TP_OVERLAP),
    "--disable-tp-comm-bulk-dgrad": refused(_TP_OVERLAP),
    "--disable-tp-comm-bulk-wgrad": refused(_TP_OVERLAP),
    "--tp-comm-bootstrap-backend": refused(_TP_OVERLAP),
    "--disable-tp-comm-split-ag": refused(_TP_OVERLAP),
    "--disable-tp-comm-split-rs": refused(_TP_OVERLAP),
    "--use-cpu-initialization": same(
        "every weight is drawn whole from a seeded generator and then sharded, so weights do "
        "not depend on the layout (what Megatron-LM's CPU initialisation is for)"
    ),
    "--deterministic-mode": refused("not implemented here"),
    "--check-weight-hash-across-dp-replicas-interval": refused("not implemented here"),
    "--calculate-per-token-loss": same(
        "the loss is the sum over labelled tokens divided by their count over the global batch"
    ),
    "--train-sync-interval": no_effect("the host waits for the device every step here"),
    "--checkpoint-activations": refused(
        "removed from Megatron-LM; use --recompute-activations or --recompute-granularity"
    ),
    "--use-fused-weighted-squared-relu": refused("squared-ReLU MLPs are not implemented here"),
    "--rope-type": same(
        "standard RoPE for this trainer's (non-MLA) attention",
        values=("rope",),
        otherwise="Megatron-LM's --rope-type yarn is for multi-latent attention only; use "
        "--position-embedding-type yarn",
    ),
    "--cross-entropy-fusion-impl": same(
        "megatron-core's native cross entropy",
        values=("native",),
        otherwise="transformer-engine's cross entropy is not wired here",
    ),
    "--use-flash-attn": mapped(
        "Megatron-LM's older spelling of --attention-backend flash (without CUDA: no effect)",
        _use_flash_attn,
    ),
    "--optimizer": same(
        "AdamW", values=("adam",), otherwise="only Adam(W) is wired here (megatron-core's)"
    ),
    "--optimizer-cpu-offload": refused("optimizer offloading is not wired here"),
    "--optimizer-offload-fraction": refused("optimizer offloading is not wired here"),
    "--use-torch-optimizer-for-cpu-offload": refused("optimizer offloading is not wired here"),
    "--overlap-cpu-optimizer-d2h-h2d": refused("optimizer offloading is not wired here"),
    "--dump-param-to-param-group-map": refused("not implemented here"),
    "--no-pin-cpu-grads": refused("optimizer offloading is not wired here"),
    "--no-pin-cpu-params": refused("optimizer offloading is not wired here"),
    "--dataloader-type": same(
        "one pass over the dataset in order, resumable by consumed samples",
        values=("single",),
        otherwise="only the single-pass data loader is implemented here",
    ),
    "--no-async-tensor-model-parallel-allreduce": no_effect(_LEGACY),
    "--use-mcore-models": same("the model is megatron-core's GPTModel"),
    "--use-legacy-models": refused("the legacy Megatron-LM model is not part of this trainer"),
    "--pipeline-model-parallel-comm-backend": same(
        "NCCL on CUDA (gloo on CPU)", values=("nccl",), otherwise="UCC is not wired here"
    ),
    "--high-priority-stream-groups": refused("not wired here"),
    "--use-te-activation-func": refused("transformer-engine's activations are not wired here"),
    # ---- initialization ----------------------------------------------------------------------
    "--data-parallel-random-init": refused("DP replicas start from the same weights here"),
    "--embedding-init-method-std": refused("not implemented here; --init-method-std covers it"),
    "--init-method-xavier-uniform": refused("Xavier initialisation is not implemented here"),
    # ---- learning rate -----------------------------------------------------------------------
    "--lr-warmup-init": same(
        "warm-up starts from 0", values=("0", "0.0"), otherwise="not implemented here"
    ),
    "--warmup": refused("removed from Megatron-LM; use --lr-warmup-fraction"),
    # ---- checkpointing -----------------------------------------------------------------------
    "--save-retain-interval": refused("not implemented here"),
    "--load-main-params-from-ckpt": refused("not implemented here"),
    "--no-strict-fsdp-dtensor-load": refused(_FSDP),
    "--non-persistent-save-interval": refused(_NONPERSISTENT),
    "--non-persistent-ckpt-type": refused(_NONPERSISTENT),
    "--non-persistent-global-ckpt-dir": refused(_NONPERSISTENT),
    "--non-persistent-local-ckpt-dir": refused(_NONPERSISTENT),
    "--non-persistent-local-ckpt-algo": refused(_NONPERSISTENT),
    "--ckpt-step": refused("resuming always takes the newest checkpoint of --load here"),
    "--no-initialization": refused("not implemented here"),
    "--use-checkpoint-args": refused("the flags of the command line are the run's settings here"),
    "--use-mp-args-from-checkpoint-args": refused(
        "the flags of the command line are the run's settings here"
    ),
    "--no-use-tokenizer-model-from-checkpoint-args": no_effect(
        "the tokenizer always comes from the flags here"
    ),
    "--exit-on-missing-checkpoint": refused("not implemented here"),
    "--use-dist-ckpt": no_effect(_LEGACY),
    "--use-persistent-ckpt-worker": refused("asynchronous saving is not implemented here"),
    "--auto-detect-ckpt-format": same("checkpoints are megatron-core distributed checkpoints"),
    "--dist-ckpt-format": no_effect(_LEGACY),
    "--ckpt-format": same(
        "megatron-core distributed checkpoints (torch_dist) are what this trainer writes",
        values=("torch_dist",),
        otherwise="this trainer writes torch_dist checkpoints only",
    ),
    "--ckpt-convert-format": refused("checkpoint conversion is not part of this trainer"),
    "--ckpt-convert-save": refused("checkpoint conversion is not part of this trainer"),
    "--ckpt-convert-update-legacy-dist-opt-format": refused(
        "checkpoint conversion is not part of this trainer"
    ),
    "--ckpt-fully-parallel-save": no_effect(_LEGACY),
    "--no-ckpt-fully-parallel-save": refused("not wired here"),
    "--async-save": refused("asynchronous saving is not implemented here"),
    "--ckpt-fully-parallel-load": refused("not wired here"),
    "--ckpt-assume-constant-structure": refused("not wired here"),
    "--dist-ckpt-strictness": refused("loading is always strict here"),
    "--dist-ckpt-save-pre-mcore-014": refused("not wired here"),
    "--dist-ckpt-optim-fully-reshardable": refused("not wired here"),
    "--distrib-optim-fully-reshardable-mem-efficient": refused("not wired here"),
    # ---- mixed precision ---------------------------------------------------------------------
    "--fp32-residual-connection": refused("not implemented here"),
    "--apply-query-key-layer-scaling": no_effect(
        "it only rescales fp16 scores inside Megatron-LM's own attention kernel, not used here"
    ),
    "--attention-softmax-in-fp32": same(
        "SDPA's fused kernels, flash-attn and transformer-engine compute the softmax in fp32"
    ),
    "--accumulate-allreduce-grads-in-fp32": same(
        "gradients are accumulated and reduced in fp32 here (see --grad-reduce-in-bf16)"
    ),
    "--fp16-lm-cross-entropy": refused("the loss is computed in fp32 here"),
    "--disable-bf16-reduced-precision-matmul": refused("not wired here"),
    "--reuse-grad-buf-for-mxfp8-param-ag": refused(_FP8),
    # ---- distributed -------------------------------------------------------------------------
    "--decoder-first-pipeline-num-layers": refused("uneven pipeline stages are not wired here"),
    "--decoder-last-pipeline-num-layers": refused("uneven pipeline stages are not wired here"),
    "--pipeline-model-parallel-layout": refused("custom pipeline layouts are not wired here"),
    "--model-parallel-size": refused("removed from Megatron-LM; use --tensor-model-parallel-size"),
    "--num-layers-per-virtual-pipeline-stage": refused(
        "the interleaved pipeline schedule is not wired here"
    ),
    "--num-virtual-stages-per-pipeline-rank": refused(
        "the interleaved pipeline schedule is not wired here"
    ),
    "--microbatch-group-size-per-virtual-pipeline-stage": refused(
        "the interleaved pipeline schedule is not wired here"
    ),
    "--no-overlap-p2p-communication": no_effect(
        "p2p overlap only exists in the interleaved schedule, not used here"
    ),
    "--overlap-p2p-communication-warmup-flush": refused(
        "the interleaved pipeline schedule is not wired here"
    ),
    "--distributed-backend": same(
        "the backend follows the device: NCCL on CUDA, gloo on CPU",
        values=("nccl", "gloo"),
    ),
    "--distributed-timeout-seconds-after-init": refused("not implemented here"),
    "--defer-embedding-wgrad-compute": refused("not wired here"),
    "--wgrad-deferral-limit": refused("not wired here"),
    "--no-align-grad-reduce": refused("not wired here"),
    "--ddp-num-buckets": refused("not wired here; megatron-core's default buckets are used"),
    "--ddp-pad-buckets-for-high-nccl-busbw": refused("not wired here"),
    "--ddp-reduce-scatter-with-fp32-accumulation": refused("not wired here"),
    "--ddp-average-in-collective": refused("not wired here"),
    "--overlap-param-gather-with-optimizer-step": refused(
        "needs the interleaved pipeline schedule, not wired here"
    ),
    "--no-align-param-gather": refused("not wired here"),
    "--no-scatter-gather-tensors-in-pipeline": refused("not wired here"),
    "--use-ring-exchange-p2p": refused("not wired here"),
    "--local-rank": same("the local rank is read from torchrun's LOCAL_RANK"),
    "--lazy-mpu-init": refused("not part of this trainer"),
    "--account-for-embedding-in-pipeline-split": refused(
        "uneven pipeline stages are not wired here"
    ),
    "--account-for-loss-in-pipeline-split": refused("uneven pipeline stages are not wired here"),
    "--use-nccl-ub": refused("NCCL user buffers are not wired here"),
    "--disable-symmetric-registration": no_effect("NCCL user buffers are not used here"),
    "--use-sharp": refused("SHARP is not wired here"),
    "--sharp-enabled-group": refused("SHARP is not wired here"),
    "--use-megatron-fsdp": refused(_FSDP),
    "--init-model-with-meta-device": refused(_FSDP),
    "--data-parallel-sharding-strategy": refused(_FSDP),
    "--no-gradient-reduce-div-fusion": refused(_FSDP),
    "--fsdp-double-buffer": refused(_FSDP),
    "--suggested-communication-unit-size": refused(_FSDP),
    "--keep-fp8-transpose-cache": refused(_FP8),
    "--enable-full-sharding-in-hsdp": refused(_FSDP),
    "--num-distributed-optimizer-instances": refused("not wired here"),
    "--use-torch-fsdp2": refused(_FSDP),
    "--torch-fsdp2-no-reshard-after-forward": refused(_FSDP),
    "--cp-comm-type": same(
        "context parallelism exchanges key / value blocks point to point (ring attention)",
        values=("p2p",),
        otherwise="only p2p context parallelism is wired here",
    ),
    "--hierarchical-context-parallel-sizes": refused(
        "hierarchical context parallelism is not wired here"
    ),
    "--nccl-communicator-config-path": refused("not wired here"),
    "--use-tp-pp-dp-mapping": refused("ranks are ordered TP-CP-DP-PP here, as megatron-core"),
    "--replication": refused("not implemented here"),
    "--replication-jump": refused("not implemented here"),
    "--replication-factor": refused("not implemented here"),
    # ---- validation --------------------------------------------------------------------------
    "--full-validation": refused("validation runs --eval-iters batches here"),
    "--multiple-validation-sets": refused("one validation split is used here"),
    "--test-mode": refused("not implemented here"),
    # ---- data --------------------------------------------------------------------------------
    "--encoder-seq-length": refused("encoder-decoder models are not supported here"),
    "--decoder-seq-length": refused("encoder-decoder models are not supported here"),
    "--retriever-seq-length": refused(GROUP_REASONS["biencoder"]),
    "--sample-rate": refused("not implemented here"),
    "--mask-prob": refused("masked-language-model data is not part of this trainer"),
    "--short-seq-prob": refused("masked-language-model data is not part of this trainer"),
    "--reset-position-ids": refused(
        "use --variable-seq-lengths for positions and attention per document"
    ),
    "--reset-attention-mask": refused(
        "use --variable-seq-lengths for positions and attention per document"
    ),
    "--eod-mask-loss": refused("not implemented here"),
    "--no-create-attention-mask-in-dataloader": same(
        "no [b, 1, s, s] mask is built: the core attentions mask causally by themselves"
    ),
    "--num-dataset-builder-threads": no_effect(
        "dataset indices are built by one thread per process here"
    ),
    "--object-storage-cache-path": refused("object storage is not wired here"),
    "--mid-level-dataset-surplus": refused("not wired here"),
    "--allow-ambiguous-pad-tokens": refused("not wired here"),
    # ---- tokenizer ---------------------------------------------------------------------------
    "--padded-vocab-size": refused(
        "the padded size is derived from --make-vocab-size-divisible-by"
    ),
    "--vocab-extra-ids": refused("not implemented here"),
    "--tokenizer-metadata": refused("not implemented here"),
    "--legacy-tokenizer": refused("not implemented here"),
    "--trust-remote-code": refused("nothing is downloaded or executed from a tokenizer here"),
    # ---- logging -----------------------------------------------------------------------------
    "--log-progress": no_effect(_LOGGING),
    "--timing-log-level": no_effect(_LOGGING),
    "--log-energy": no_effect(_LOGGING),
    "--no-barrier-with-level-1-timing": no_effect(_LOGGING),
    "--timing-log-option": no_effect(_LOGGING),
    "--tensorboard-log-interval": no_effect(
        "TensorBoard receives every logged step (--log-interval)"
    ),
    "--tensorboard-queue-size": no_effect(_LOGGING),
    "--log-timers-to-tensorboard": no_effect(_LOGGING),
    "--no-log-loss-scale-to-tensorboard": no_effect("the loss scale is not logged here"),
    "--log-validation-ppl-to-tensorboard": same("val_ppl is logged with every evaluation"),
    "--log-memory-to-tensorboard": same(
        "device memory is logged with every step (mem_allocated_bytes, mem_reserved_bytes)"
    ),
    "--log-world-size-to-tensorboard": no_effect(_LOGGING),
    "--logging-level": no_effect("the log level is INFO on rank 0 here"),
    # ---- transformer engine ------------------------------------------------------------------
    "--transformer-impl": same(
        "the layer implementation follows --attention-backend (te: transformer-engine's "
        "layers; sdpa / flash: megatron-core's local layers)",
        values=("local", "transformer_engine"),
    ),
    "--te-rng-tracker": refused("not wired here"),
    "--inference-rng-tracker": refused(GROUP_REASONS["inference"]),
    # ---- groups whose other flags are refused, with an exception ------------------------------
    "--no-one-logger": same("one-logger telemetry is never used here"),
    "--qk-layernorm": refused("query / key layer norms are not implemented here"),
    "--qk-l2-norm": refused("query / key norms are not implemented here"),
}
"""The Megatron-LM flags that are not ours, one by one (groups: :data:`GROUP_REASONS`)."""

for _name in (
    "--fp8-format",
    "--fp8-recipe",
    "--fp8-quantizer-factory",
    "--fp8-margin",
    "--fp8-interval",
    "--fp8-amax-history-len",
    "--fp8-amax-compute-algo",
    "--no-fp8-wgrad",
    "--fp8-param-gather",
    "--first-last-layers-bf16",
    "--num-layers-at-start-in-bf16",
    "--num-layers-at-end-in-bf16",
    "--fp4-format",
    "--fp4-recipe",
    "--fp4-quantizer-factory",
    "--fp4-param-gather",
):
    HANDLING[_name] = refused(_FP8)
for _name in (
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
):
    HANDLING[_name] = no_effect(_FUSION)
for _name in ("--muon-momentum", "--muon-use-nesterov", "--muon-scale-mode"):
    HANDLING[_name] = refused("the Muon optimizer is not wired here")
for _name in (
    "--muon-no-split-qkv",
    "--muon-fp32-matmul-prec",
    "--muon-num-ns-steps",
    "--muon-tp-mode",
    "--muon-extra-scale-factor",
):
    HANDLING[_name] = refused("the Muon optimizer is not wired here")
del _name

LATER_FLAGS: dict[str, MegatronFlag] = {
    "--step-batch-size-schedule": MegatronFlag(
        names=("--step-batch-size-schedule",), group="training", type="str"
    ),
    # generated from megatron-core's TransformerConfig fields (ArgumentGroupFactory, called in
    # Megatron-LM's _add_network_size_args) once megatron-core had them
    "--fine-grained-activation-offloading": MegatronFlag(
        names=("--fine-grained-activation-offloading",), group="network_size", action="store_true"
    ),
    "--offload-modules": MegatronFlag(
        names=("--offload-modules",), group="network_size", nargs="+", type="str", default=[]
    ),
    "--min-offloaded-tensor-size": MegatronFlag(
        names=("--min-offloaded-tensor-size",), group="network_size", type="int", default=1048576
    ),
    # YaRN for GPT models (--position-embedding-type yarn), with the MLA group's
    # --rotary-scaling-factor, --mscale and --mscale-all-dim
    "--yarn-original-max-position-embeddings": MegatronFlag(
        names=("--yarn-original-max-position-embeddings",), group="network_size", type="int"
    ),
    "--yarn-beta-fast": MegatronFlag(
        names=("--yarn-beta-fast",), group="network_size", type="float"
    ),
    "--yarn-beta-slow": MegatronFlag(
        names=("--yarn-beta-slow",), group="network_size", type="float"
    ),
    "--yarn-correction-range-round-to-int": MegatronFlag(
        names=("--yarn-correction-range-round-to-int",),
        group="network_size",
        action="store_true",
    ),
    "--no-yarn-correction-range-round-to-int": MegatronFlag(
        names=("--no-yarn-correction-range-round-to-int",),
        group="network_size",
        action="store_false",
    ),
}
"""Flags Megatron-LM added after the commit of the list that its example scripts already use."""


def handling_of(flag: MegatronFlag) -> Handling | None:
    """The handling of a Megatron-LM flag that is not ours (``None``: not in the table)."""
    if flag.name in HANDLING:
        return HANDLING[flag.name]
    if flag.group in GROUP_REASONS:
        return refused(GROUP_REASONS[flag.group])
    return None
