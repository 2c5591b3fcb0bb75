"""A Hugging Face import under other layouts: the checkpoint the converter writes in one process
at TP 1 / PP 1 is resharded on load by megatron-core.

Under TP 2 + SP (logits gathered over the vocabulary shards) and under PP 2 (logits of the last
stage) the model's logits equal ``transformers'`` own; TP 2 + SP and PP 2 runs that train from
the import (--finetune) log the losses of one process that does.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from memo_ext.hf.checkpoint import FLAGS_FILE, import_hf, load_model  # noqa: E402
from memo_ext.parallel import ParallelLayout  # noqa: E402
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
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module", params=["qwen2", "gpt2", "llama31"])
def imported(request, tmp_path_factory):
    """(HF model, checkpoint folder). Qwen2 (query / key / value biases, tied embeddings, GQA),
    GPT-2 (learned positions, LayerNorm, biases everywhere) and Llama 3.1 (untied output layer,
    no biases, GQA, Llama 3.1's RoPE scaling): every kind of tensor TP and PP split."""
    folder = tmp_path_factory.mktemp("hf_import")
    layers = {"n_layer": 4} if request.param == "gpt2" else {"num_hidden_layers": 4}
    reference = make_hf_model(request.param, folder / "hf", **layers)  # PP 2 splits it in two
    # the test process has no megatron world; the import makes and ends its own, on a free port
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    import_hf(hf_dir=folder / "hf", out=folder / "ckpt", progress=False)
    return reference, folder / "ckpt"


@contextlib.contextmanager
def rank_of_the_import(ckpt: Path, *, layout: ParallelLayout, flags: list[str]):
    """This rank's part of the import in ``ckpt`` under ``layout`` (``flags``: its spelling on
    the command line), in eval mode; the gloo world and megatron's parallel state end with the
    block."""
    from megatron.core import parallel_state

    from memo_ext.mcore.compat import cpu_compat
    from memo_ext.training.initialize import init_distributed, init_model_parallel

    init_distributed()
    try:
        with cpu_compat():
            init_model_parallel(layout=layout, seed=0)
            _, model = load_model(
                ckpt,
                flags=[*(ckpt / FLAGS_FILE).read_text().split(), *flags],
                vocab_size=VOCAB,
                world_size=layout.world_size,
            )
            yield model.eval()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def tp_logits_job(argv: list[str]) -> int:
    """One rank of a TP 2 + SP job of the worker pool: load the import in ``argv[0]`` and write
    the logits of the tokens in ``argv[1]``, gathered over the vocabulary shards, to ``argv[2]``
    (rank 0)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ckpt, tokens_file, out = map(Path, argv)
    with rank_of_the_import(ckpt, layout=ParallelLayout(tp=2, sp=True), flags=TP2_SP) as model:
        tokens = torch.load(tokens_file)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():
            shard = model(tokens, positions, None)  # [b, s, padded vocab / TP]
            logits = gather_from_tensor_model_parallel_region(shard)
        if dist.get_rank() == 0:
            torch.save(logits, out)
    return 0


def pp_logits_job(argv: list[str]) -> int:
    """One rank of a PP 2 job of the worker pool: load the import in ``argv[0]``; the first
    stage (embedding, layers 1-2) runs the tokens in ``argv[1]`` and sends its output to the
    last (layers 3-4, final norm, output layer), which writes the logits to ``argv[2]``.

    The stages are chained by hand, one send: megatron's pipeline schedules add micro-batching
    and buffers, not arithmetic, and the PP 2 training test runs them.
    """
    from megatron.core import parallel_state

    ckpt, tokens_file, out = map(Path, argv)
    with rank_of_the_import(ckpt, layout=ParallelLayout(pp=2), flags=PP2) as model:
        tokens = torch.load(tokens_file)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        # [s, b, h]: what the first stage's last layer hands on (no final norm there)
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size)
        with torch.no_grad():
            if parallel_state.is_pipeline_first_stage():
                hidden = model(tokens, positions, None)
                dist.send(hidden, dst=parallel_state.get_pipeline_model_parallel_next_rank())
            else:
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
                torch.save(model(tokens, positions, None), out)  # [b, s, padded vocab]
    return 0


def logits_of_the_job(job: str, *, ckpt: Path, tokens: torch.Tensor, workdir: Path):
    """The logits [b, s, vocab] that ``job`` (a function of this module, on 2 ranks) writes for
    ``tokens`` [b, s], without the vocabulary's padding."""
    torch.save(tokens, workdir / "tokens.pt")
    argv = [str(ckpt), str(workdir / "tokens.pt"), str(workdir / "logits.pt")]
    result = run_job(argv, nproc=2, entry=f"tests.dist.test_convert_hf_layouts:{job}")
    assert result.status == 0, result.describe()
    return torch.load(workdir / "logits.pt")[..., :VOCAB]


def transformers_logits(reference, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        expected = reference(tokens).logits  # [b, s, vocab]
    assert expected.abs().max() > 1
    return expected


def test_tp2_sp_logits_equal_transformers(imported, tmp_path):
    reference, ckpt = imported
    # SP splits the sequence over the 2 TP ranks: an even length
    tokens = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(9))
    ours = logits_of_the_job("tp_logits_job", ckpt=ckpt, tokens=tokens, workdir=tmp_path)
    # fp32 on both sides, sums in another order (fused GEMMs split over 2 ranks and reduced,
    # SDPA). Over 4 layers to logits of up to ~8, fp32 alone is ~2e-5 off: transformers' own
    # logits differ by 1.9e-5 (Llama 3.1) and 2.1e-5 (Qwen2) from its float64 run, and ours
    # under TP 2 from ours under PP 2 by 2e-5; seen here: up to 1.9e-5 (Llama 3.1). 3e-5 plus
    # 1e-5 of the logit; a missing RoPE scaling moves these logits by 0.37
    torch.testing.assert_close(ours, transformers_logits(reference, tokens), rtol=1e-5, atol=3e-5)


def test_pp2_logits_equal_transformers(imported, tmp_path):
    reference, ckpt = imported
    # PP splits no tensor: an odd length, and 3 sequences
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(10))
    ours = logits_of_the_job("pp_logits_job", ckpt=ckpt, tokens=tokens, workdir=tmp_path)
    # fp32 on both sides, sums in another order (fused QKV / gate-up GEMMs, SDPA), as under TP
    # but with no sum split over ranks: up to 6.4e-6 seen here. 1e-5 plus 1e-5 of the logit
    torch.testing.assert_close(ours, transformers_logits(reference, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [TP2_SP, PP2], ids=["tp2-sp", "pp2"])
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


def test_a_fine_tuned_import_exports_with_the_source_config(tmp_path):
    # docs/hf.md's recipe: import, train from it into a --save of its own, export that save
    # with no flag retyped; the export keeps the token ids no trainer flag holds
    from safetensors.torch import load_file

    from memo_ext.commands.convert_hf import main

    ids = dict(bos_token_id=116, eos_token_id=117, pad_token_id=118)  # not LlamaConfig's
    reference = make_hf_model("llama2", tmp_path / "hf", **ids)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "ckpt", progress=False)
    tuned = tmp_path / "tuned"
    flags = (tmp_path / "ckpt" / FLAGS_FILE).read_text().split()
    args = [*flags, "--load", str(tmp_path / "ckpt"), "--finetune", "--save", str(tuned), *RUN]
    run_pretrain(args, nproc=1, workdir=tmp_path, name="tuned")
    argv = ["export", "--load", str(tuned), "--out", str(tmp_path / "out"), "--family", "llama"]
    assert main(argv) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {key: config.get(key) for key in ids} == ids
    assert config["vocab_size"] == VOCAB
    # the trained weights, not the import's
    exported = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(exported[name], reference.state_dict()[name])
