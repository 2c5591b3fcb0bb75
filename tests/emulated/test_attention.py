"""Core attention's CUDA paths on the emulated device: packed rows read no boundary from the
device, and attention dropout draws from megatron's tensor-parallel RNG stream."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.emulated.test_parallel import corpus  # noqa: F401 (the packed corpus fixture)
from tests.emulated.test_training import train_on
from tests.launch import cli


def packed_args(data: str, layers: int) -> list[str]:
    return cli(
        num_layers=layers, hidden_size=32, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2,
        micro_batch_size=1, global_batch_size=4, seq_length=128, train_iters=2, lr="1e-3",
        tokenizer_type="ByteTokenizer", variable_seq_lengths=True, data_path=data,
    )  # fmt: skip


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32-per-document", "bf16-varlen"])
def test_packed_rows_read_no_boundary_from_the_device(tmp_path, corpus, precision):  # noqa: F811
    """A device → host read is a synchronisation: the count per step must not grow with the
    layers (learned positions: megatron's unfused RoPE for packed rows reads lengths itself)."""
    from memo_ext.simulate.device import emulated_cuda

    reads = []
    for layers in (2, 4):
        with emulated_cuda() as cuda:
            train_on(cuda, tmp_path, *precision, base=packed_args(corpus, layers))
            reads.append(cuda.scalar_reads)
    assert reads[0] == reads[1], f"device reads with 2 and 4 layers: {reads}"


@pytest.fixture
def tp_rng(cuda):
    """megatron's parallel state and CUDA RNG tracker on the emulated device."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield tensor_parallel.get_cuda_rng_tracker()
    finally:
        parallel_state.destroy_model_parallel()


def flash_stand_in(tracker, calls: list[str]) -> types.ModuleType:
    """A ``flash_attn`` whose kernels note whether the CUDA generator holds megatron's
    tensor-parallel state when they draw their dropout."""
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME as NAME

    def check(name: str, q: torch.Tensor, dropout_p: float) -> torch.Tensor:
        forked = torch.equal(torch.cuda.get_rng_state(), tracker.get_states()[NAME])
        calls.append(f"{name} dropout {dropout_p} {'in' if forked else 'outside'} the TP stream")
        return torch.empty_like(q)

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = lambda q, k, v, dropout_p, **kw: check("dense", q, dropout_p)
    module.flash_attn_varlen_func = lambda q, *a, dropout_p, **kw: check("varlen", q, dropout_p)
    return module


def test_flash_attention_dropout_draws_from_the_tensor_parallel_stream(tp_rng, monkeypatch):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from memo_ext.mcore.attention import FlashAttention
    from memo_ext.mcore.packed import build_packed_seq_params

    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "flash_attn", flash_stand_in(tp_rng, calls))
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.1
    )
    attention = FlashAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    q = torch.randn(16, 2, 4, 8, device="cuda")
    attention(q, q, q, attention_mask=None)
    packed = build_packed_seq_params(
        cu_seqlens=torch.tensor([0, 5, 16]), cu_seqlens_padded=torch.tensor([0, 5, 16]),
        device="cuda",
    )  # fmt: skip
    t = torch.randn(16, 4, 8, device="cuda")
    attention(t, t, t, attention_mask=None, packed_seq_params=packed)
    assert calls == [
        "dense dropout 0.1 in the TP stream",
        "varlen dropout 0.1 in the TP stream",
    ]
