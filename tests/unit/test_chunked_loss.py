"""The chunked output layer and loss: the same losses and gradients, less memory at its peak."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memo_ext.mcore.gpt import ChunkedLossGPTModel
from memo_ext.mcore.specs import build_block_spec, build_layer_spec
from memo_ext.planner.capture import trace_module
from memo_ext.planner.problem import lower_bound, problem_from_trace
from memo_ext.shapes import ModelShape
from tests.models import cpu_config

# a vocabulary far wider than the model, as at long context: the logits make the peak
VOCAB, SEQ, BATCH = 4096, 24, 2


def build(loss_chunks: int, *, tied: bool = True) -> ChunkedLossGPTModel:
    config = cpu_config(ModelShape(num_layers=1, hidden_size=16, num_attention_heads=2))
    spec = build_layer_spec(config=config, attention_backend="sdpa")
    torch.manual_seed(0)
    return ChunkedLossGPTModel(
        loss_chunks=loss_chunks,
        config=config,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        transformer_layer_spec=build_block_spec(config=config, layer_spec=spec),
        share_embeddings_and_output_weights=tied,
    )


def run(model, tokens):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    losses = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("chunks", "tied"), [(3, True), (5, False), (SEQ, True)])
def test_same_losses_and_gradients(megatron_cpu, chunks, tied):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    loss_one, grads_one = run(build(1, tied=tied), tokens)
    loss_chunked, grads_chunked = run(build(chunks, tied=tied), tokens)
    assert loss_chunked.shape == (BATCH, SEQ)
    # per-token losses come from the same per-token arithmetic, except that a slice of one or
    # two rows makes the BLAS pick another matmul kernel (last-bit differences)
    torch.testing.assert_close(loss_chunked, loss_one, rtol=1e-6, atol=0)
    for name, grad in grads_one.items():
        # weight gradients are summed over chunks, and one-row slices take another BLAS
        # kernel: fp32 rounding only
        error = (grads_chunked[name] - grad).norm() / grad.norm()
        assert error <= 1e-5, (name, error.item())


def test_forward_peak_falls_with_chunks(megatron_cpu):
    """Only one slice's logits exist at a time: the forward's peak loses the full logits.

    (The backward recomputes one slice at a time too; in a model this small its peak is set by
    the embedding's weight gradients, so it is the forward that shows the difference here.)
    """

    def forward_peak(chunks: int) -> int:
        model = build(chunks)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            tokens = mode.from_tensor(torch.randint(0, VOCAB, (BATCH, SEQ)))
            labels = torch.roll(tokens, -1, dims=1)
            trace = trace_module(lambda recorder: model(tokens, positions, None, labels=labels))
        return lower_bound(problem_from_trace(trace)[1])

    one, four = forward_peak(1), forward_peak(4)
    logits_bytes = SEQ * BATCH * VOCAB * 4  # fp32 [s, b, V]
    assert one - four >= logits_bytes // 2, (one, four, logits_bytes)
