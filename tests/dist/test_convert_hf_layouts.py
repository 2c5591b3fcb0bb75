"""A Hugging Face import under other layouts: the checkpoint the converter writes in one process
at TP 1 / PP 1 is resharded on load by megatron-core.

Under TP 2 + SP the model's logits (gathered over the vocabulary shards) equal ``transformers'``
own; TP 2 + SP and PP 2 runs that train from the import (--finetune) log the losses of one
process that does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from memo_ext.hf.checkpoint import FLAGS_FILE, import_hf, load_model  # noqa: E402
from tests.hf_models import VOCAB, make_hf_model  # noqa: E402
from tests.launch import assert_same_curves, cli, run_job, run_pretrain  # noqa: E402
from tests.workers import free_port  # noqa: E402

pytestmark = pytest.mark.dist

RUN = cli(
    tokenizer_type="NullTokenizer",
    vocab_size=VOCAB,
    mock_data=True,
    seq_length=24,
    micro_batch_size=2,
    global_batch_size=4,
    lr="1e-3",
    train_iters=3,
    seed=7,
)
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def imported(request, tmp_path_factory):
    """(HF model, checkpoint folder). Qwen2 (query / key / value biases, tied embeddings, GQA)
    and GPT-2 (learned positions, LayerNorm, biases everywhere): every kind of tensor TP and PP
    split."""
    folder = tmp_path_factory.mktemp("hf_import")
    layers = {"n_layer": 4} if request.param == "gpt2" else {"num_hidden_layers": 4}
    reference = make_hf_model(request.param, folder / "hf", **layers)  # PP 2 splits it in two
    # the test process has no megatron world; the import makes and ends its own, on a free port
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    import_hf(hf_dir=folder / "hf", out=folder / "ckpt", progress=False)
    return reference, folder / "ckpt"


def tp_logits_job(argv: list[str]) -> int:
    """One rank of a TP 2 + SP job of the worker pool: load the import in ``argv[0]`` and write
    the logits of the tokens in ``argv[1]``, gathered over the vocabulary shards, to ``argv[2]``
    (rank 0)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from memo_ext.mcore.compat import cpu_compat
    from memo_ext.parallel import ParallelLayout
    from memo_ext.training.initialize import init_distributed, init_model_parallel

    ckpt, tokens_file, out = map(Path, argv)
    init_distributed()
    flags = [*(ckpt / FLAGS_FILE).read_text().split(), *TP2_SP]
    try:
        with cpu_compat():
            init_model_parallel(layout=ParallelLayout(tp=2, sp=True), seed=0)
            _, model = load_model(ckpt, flags=flags, vocab_size=VOCAB, world_size=2)
            model.eval()
            tokens = torch.load(tokens_file)
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            with torch.no_grad():
                shard = model(tokens, positions, None)  # [b, s, padded vocab / TP]
                logits = gather_from_tensor_model_parallel_region(shard)
            if dist.get_rank() == 0:
                torch.save(logits, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


def test_tp2_sp_logits_equal_transformers(imported, tmp_path):
    reference, ckpt = imported
    # SP splits the sequence over the 2 TP ranks: an even length
    tokens = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(9))
    torch.save(tokens, tmp_path / "tokens.pt")
    argv = [str(ckpt), str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt")]
    job = run_job(argv, nproc=2, entry="tests.dist.test_convert_hf_layouts:tp_logits_job")
    assert job.status == 0, job.describe()
    ours = torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    with torch.no_grad():
        expected = reference(tokens).logits
    assert expected.abs().max() > 1
    # fp32 on both sides, sums in another order (fused GEMMs split over 2 ranks and reduced,
    # SDPA); over 4 layers to logits of up to ~8 the rounding reaches 1.5e-5 (2e-6 of the
    # logit): 1e-5 absolute plus 1e-5 of the logit
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "layout", [TP2_SP, ["--pipeline-model-parallel-size", "2"]], ids=["tp2-sp", "pp2"]
)
def test_training_from_the_import_under_another_layout(imported, tmp_path, layout):
    _, ckpt = imported
    args = [*(ckpt / FLAGS_FILE).read_text().split(), "--load", str(ckpt), "--finetune", *RUN]
    one = run_pretrain(args, nproc=1, workdir=tmp_path, name="one")
    two = run_pretrain(args + layout, nproc=2, workdir=tmp_path, name="two")
    assert len(one) == 3 and one[0]["loss"] > 1
    # the first step runs on the imported weights as they are: equal to fp32 summation order
    assert_same_curves(one[:1], two[:1], rtol=1e-5)
    # later steps start from updated weights: the first step's rounding differences (the
    # layouts sum in another order) grow through the update of weights of order 0.3
    assert_same_curves(one, two, rtol=1e-4)
