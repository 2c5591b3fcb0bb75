"""Allocation traces of real megatron-core code at any scale, on CPU, with no real memory.

Code runs under ``FakeTensorMode`` (tensors carry shapes and dtypes but no data) and under
``AllocationRecorder``, a dispatch mode that sees every op's outputs: an output whose storage
is new is an allocation, and a weakref finalizer on that storage reports its release. Storages
that existed before recording (parameters, inputs) are never part of the trace. Process groups
come from torch's fake backend, so a single process sees the shapes of any TP / SP / CP layout.

Example (a 7B layer at 1M tokens, TP 8 + SP, forward and backward in about a second)::

    trace = trace_transformer_layer(
        config=gpt_config("gpt-7b", tensor_model_parallel_size=8, sequence_parallel=True),
        seq_length=1 << 20, micro_batch_size=1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import build_module
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from memo_ext.mcore.specs import build_layer_spec
from memo_ext.mcore.tracing import (
    fake_process_groups,
    global_parallel_state,
    tracing_environment,
)
from memo_ext.planner.errors import PlannerInputError
from memo_ext.planner.trace import Alloc, Event, Free, Trace
from memo_ext.shapes import embedding_rows

logger = logging.getLogger(__name__)


class AllocationRecorder(TorchDispatchMode):
    """Records the storages created and released by the ops that run under it.

    ``tag`` (phase, layer) is attached to each allocation; callers change it as the program
    moves between passes (``TagMarker`` does so from inside backward).
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.live: dict[int, str] = {}
        self.tag: tuple[str | None, int | None] = (None, None)
        self.recording = True
        self._ids = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.recording:
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _is_tensor(t)}
        for tensor in tree_leaves(out):
            if _is_tensor(tensor):
                self._maybe_record(tensor, inputs, func)
        return out

    def _maybe_record(self, tensor: torch.Tensor, inputs: set[int], func) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in inputs or key in self.live or storage.nbytes() == 0:
            return  # a view, an in-place result, or an empty tensor
        tensor_id = f"t{next(self._ids)}"
        self.live[key] = tensor_id
        phase, layer = self.tag
        name = str(func.overloadpacket.__name__)
        self.events.append(Alloc(tensor_id, int(storage.nbytes()), name, phase, layer))
        weakref.finalize(storage, self._release, key, tensor_id)

    def _release(self, key: int, tensor_id: str) -> None:
        if self.live.get(key) == tensor_id:
            del self.live[key]
            if self.recording:
                self.events.append(Free(tensor_id))

    def stop(self) -> None:
        """Stops recording; storages still alive count as never freed."""
        self.recording = False

    def forget(self, storages: set[int]) -> None:
        """Drops the events of these live storages (memory that is not the device's)."""
        ids = {self.live.pop(key) for key in storages if key in self.live}
        self.events = [event for event in self.events if event.id not in ids]


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


class TagMarker(torch.autograd.Function):
    """Identity whose backward switches the recorder's tag (marks pass boundaries in backward)."""

    @staticmethod
    def forward(ctx, x, recorder: AllocationRecorder, tag: tuple):
        ctx.recorder, ctx.tag = recorder, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.recorder.tag = ctx.tag
        return grad, None, None


def trace_module(
    fn: Callable[[AllocationRecorder], object],
    *,
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
    meta: dict | None = None,
) -> Trace:
    """Traces the allocations of ``fn(recorder)`` (run it under a ``FakeTensorMode``).

    Args:
        fn: the program to trace; it receives the recorder to set tags. Create its inputs
            before calling (they are then pre-existing), or inside it (then they are traced).
        context: optional factory of a context manager wrapped around ``fn`` (for example
            saved-tensor hooks of an offloading policy), so its effect shows in the trace.
        meta: description stored in the trace.
    """
    recorder = AllocationRecorder()
    with context() if context is not None else contextlib.nullcontext(), recorder:
        fn(recorder)
    recorder.stop()
    return Trace(events=recorder.events, meta=dict(meta or {}))


def _default_layer_spec(config):
    return build_layer_spec(config=config, attention_backend="sdpa")


def _embedding_forward(tokens, word, position, *, tp: int, sequence_parallel: bool):
    # [b, s] ids -> [s, b, h]; the vocab-parallel lookup is all-reduced in place, then under SP
    # reduce-scattered to this rank's [s/tp, b, h] shard.
    x = F.embedding(tokens, word).transpose(0, 1) + position[: tokens.shape[1]].unsqueeze(1)
    if sequence_parallel:
        return x[: x.shape[0] // tp].clone()
    return x.contiguous()


def _loss_forward(x, norm_weight, output_weight, labels, *, tp: int, sequence_parallel: bool):
    # Final norm on [s(/tp), b, h]; under SP the output layer all-gathers to [s, b, h]; logits
    # [s, b, v/tp] go to float32 for the vocab-parallel cross entropy, as in megatron.
    x = F.layer_norm(x, x.shape[-1:], norm_weight)
    if sequence_parallel:
        x = x.repeat(tp, 1, 1)
    logits = F.linear(x, output_weight).float()
    target = logits.gather(-1, labels.transpose(0, 1).unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - target).mean()


def _megatron_loss_forward(
    x, norm_weight, output_weight, labels, *, tp: int, sequence_parallel, chunks: int = 1
):
    def chunk_loss(part, part_labels):
        if sequence_parallel:
            part = tensor_parallel.gather_from_sequence_parallel_region(part)
        logits = F.linear(part, output_weight)  # [s, b, vocab / tp], bf16
        return tensor_parallel.vocab_parallel_cross_entropy(logits, part_labels).sum()

    labels = labels.transpose(0, 1)
    if chunks == 1:
        return chunk_loss(F.layer_norm(x, x.shape[-1:], norm_weight), labels)
    x = F.layer_norm(x, x.shape[-1:], norm_weight)
    # the trainer's --loss-chunks (memo_ext.mcore.gpt): the output layer and the loss over
    # slices of the local rows, each recomputed in backward; the labels' shape is what counts
    local, ranks = x.size(0), tp if sequence_parallel else 1
    bounds = [local * i // chunks for i in range(chunks + 1)]
    return sum(
        checkpoint(chunk_loss, x[a:b], labels[: (b - a) * ranks], use_reentrant=False)
        for a, b in zip(bounds[:-1], bounds[1:])
        if b > a
    )


def trace_transformer_layer(
    *,
    config,
    seq_length: int,
    micro_batch_size: int,
    num_layers: int = 1,
    vocab_size: int | None = None,
    layer_spec=None,
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
    host_storages: Callable[[torch.nn.Module], set[int]] | None = None,
    meta: dict | None = None,
    recompute_layers: bool = False,
    megatron_loss: bool = False,
    loss_chunks: int = 1,
) -> Trace:
    """Traces one iteration: embedding, ``num_layers`` layers forward, loss, and backward.

    The layer is a megatron-core ``TransformerLayer`` built from ``layer_spec`` (default: the
    project's local spec with SDPA attention) with this rank's TP / SP / CP shapes; it is run
    ``num_layers`` times (layers are identical). Allocs carry ``phase`` (``embedding``, ``fwd``,
    ``loss``, ``bwd``, ``embedding_bwd``) and ``layer``. Weight gradients are released right
    after accumulation (as megatron's DDP does once they reach its grad buffer); parameters and
    their grad buffers are pre-existing memory and not in the trace. With ``vocab_size=None``
    only the layers are traced (the layer input is then pre-existing).

    Args:
        config: megatron ``TransformerConfig`` (``num_layers`` there is ignored).
        seq_length: tokens per sequence (the global length, before CP / SP sharding).
        micro_batch_size: sequences per micro-batch.
        num_layers: how many layer passes to run.
        vocab_size: include the embedding and loss ends with this vocabulary.
        layer_spec: megatron ``ModuleSpec`` of the layer, for example a MEMO layer's
            (``memo_ext.memo.policy.memo_trace_spec``). One layer object runs every pass.
        context: optional context-manager factory wrapped around the traced program.
        host_storages: called with the layer once the program has run; the storages it names
            (``untyped_storage()._cdata``) are host memory, such as MEMO's pinned buffers, and
            are left out of the trace.
        meta: further description stored in the trace.
        recompute_layers: Megatron's full recomputation (``--recompute-granularity full
            --recompute-method uniform --recompute-num-layers 1``): each layer pass runs
            under megatron-core's ``tensor_parallel.checkpoint``, which keeps its input and runs
            it again in backward. Selective recomputation is the config's
            ``recompute_granularity``.
        megatron_loss: the loss end as the trainer runs it: final norm, the SP gather, the
            output layer and megatron-core's ``vocab_parallel_cross_entropy`` (bf16 logits, its
            fp32 softmax saved for backward). Default: a plain fp32 log-sum-exp loss.
        loss_chunks: with ``megatron_loss``, the trainer's ``--loss-chunks``: the output layer
            and loss over that many sequence slices, each recomputed in backward.
    """
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    sp = bool(config.sequence_parallel)
    if seq_length % (cp * (tp if sp else 1)):
        raise PlannerInputError(f"--seq-length {seq_length} must divide by CP x (TP under SP)")
    if cp > 1:
        # The rank's s / cp tokens on a CP-free layer: ring attention's footprint (each rank
        # keeps its own q, k, v, output and log-sum-exp). Our CPU CP path's causal bias object
        # cannot be faked, and its all-gathered K / V is not what the GPU path holds.
        config = dataclasses.replace(config, context_parallel_size=1)
    spec = layer_spec if layer_spec is not None else _default_layer_spec(config)
    dtype = config.params_dtype
    s_local, h = seq_length // cp, config.hidden_size
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    state = global_parallel_state(tp) if megatron_loss else contextlib.nullcontext()
    with fake_process_groups(tp=tp, cp=1) as groups, state, tracing_environment(), fake:
        layer = build_module(spec, config, layer_number=1, pg_collection=groups)
        for param in layer.parameters():
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        ends = _build_ends(vocab_size, tp=tp, h=h, s=s_local, dtype=dtype)
        tokens = torch.zeros(micro_batch_size, s_local, dtype=torch.long)
        x0 = torch.empty(s_local // (tp if sp else 1), micro_batch_size, h, dtype=dtype)
        x0.requires_grad_(ends is None)

        def run(recorder: AllocationRecorder) -> None:
            x = x0
            if ends is not None:
                recorder.tag = ("embedding", None)
                x = _embedding_forward(
                    tokens, ends["word"], ends["position"], tp=tp, sequence_parallel=sp
                )
            for k in range(num_layers):
                back_tag = ("embedding_bwd", None) if k == 0 else ("bwd", k - 1)
                x = TagMarker.apply(x, recorder, back_tag)
                recorder.tag = ("fwd", k)
                if recompute_layers:
                    x = tensor_parallel.checkpoint(_layer_output(layer), False, x)
                else:
                    x, _ = layer(x, attention_mask=None)
                x = TagMarker.apply(x, recorder, ("bwd", k))
            if ends is not None:
                recorder.tag = ("loss", None)
                if megatron_loss:
                    loss = _megatron_loss_forward(
                        x,
                        ends["norm"],
                        ends["output"],
                        tokens,
                        tp=tp,
                        sequence_parallel=sp,
                        chunks=loss_chunks,
                    )
                else:
                    loss = _loss_forward(
                        x, ends["norm"], ends["output"], tokens, tp=tp, sequence_parallel=sp
                    )
                recorder.tag = ("loss_bwd", None)
                loss.backward()
            else:
                recorder.tag = ("bwd", num_layers - 1)
                x.backward(torch.ones_like(x))
            if host_storages is not None:
                recorder.forget(host_storages(layer))

        trace_meta = {
            "model": {
                "hidden_size": h,
                "num_attention_heads": config.num_attention_heads,
                "ffn_hidden_size": config.ffn_hidden_size,
                "num_layers": num_layers,
                "vocab_size": vocab_size,
            },
            "seq_length": seq_length,
            "micro_batch_size": micro_batch_size,
            "tensor_model_parallel_size": tp,
            "sequence_parallel": sp,
            "context_parallel_size": cp,
            "dtype": str(dtype).replace("torch.", ""),
            **(meta or {}),
        }
        return trace_module(run, context=context, meta=trace_meta)


def _layer_output(layer):
    def forward(x):
        return layer(x, attention_mask=None)[0]

    return forward


def _build_ends(vocab_size: int | None, *, tp: int, h: int, s: int, dtype) -> dict | None:
    if vocab_size is None:
        return None
    # the trainer's padding (lcm of 128 and TP), split across TP ranks
    padded = embedding_rows(vocab_size, tp_sizes=(tp,))
    return {
        "word": torch.nn.Parameter(torch.empty(padded // tp, h, dtype=dtype)),
        "position": torch.nn.Parameter(torch.empty(s, h, dtype=dtype)),
        "norm": torch.nn.Parameter(torch.empty(h, dtype=dtype)),
        "output": torch.nn.Parameter(torch.empty(padded // tp, h, dtype=dtype)),
    }


@contextlib.contextmanager
def no_op_context() -> Iterator[None]:
    """A context factory that does nothing (the default of ``trace_module``)."""
    yield
