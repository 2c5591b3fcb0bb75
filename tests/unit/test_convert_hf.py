"""Hugging Face import / export (``tools.convert_hf``) against ``transformers``' own models.

Tiny models are made here with random weights (nothing is downloaded), imported, and our model's
logits compared with ``transformers``' forward on the same tokens; the export is loaded back with
``AutoModelForCausalLM`` and compared the same way, and import → export must give back every
tensor bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from memo_ext.commands.convert_hf import main  # noqa: E402
from memo_ext.errors import UsageError  # noqa: E402
from memo_ext.hf.checkpoint import (  # noqa: E402
    FLAGS_FILE,
    export_hf,
    import_hf,
    load_model,
    single_process,
)
from tests.hf_models import CONFIGS, FAMILY, VOCAB, make_hf_model  # noqa: E402

# fp32 on both sides; the sums run in another order (fused QKV / fc1 GEMMs, SDPA vs eager
# softmax), so the logits agree to rounding, not bit for bit
ATOL = 1e-5


def our_logits(ckpt, tokens: torch.Tensor) -> torch.Tensor:
    flags = (ckpt / FLAGS_FILE).read_text().split()
    run, model = load_model(ckpt, flags=flags, vocab_size=VOCAB)
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)  # [b, s, padded vocab]
    assert torch.all(logits[..., VOCAB:] == 0)  # zero padding rows
    return logits[..., :VOCAB]


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_export_matches_transformers(name, tmp_path, tokens, megatron_cpu):
    reference = make_hf_model(name, tmp_path / "hf", shard=name == "llama2")
    if name == "llama2":  # the sharded layout: an index and several files
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ckpt = tmp_path / "ckpt"
    import_hf(hf_dir=tmp_path / "hf", out=ckpt, progress=False)
    ours = our_logits(ckpt, tokens)
    expected = hf_logits(reference, tokens)
    assert expected.abs().max() > 1  # logits of order one: the tolerance is meaningful
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)

    export_hf(load=ckpt, out=tmp_path / "out", family=FAMILY[name], progress=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported) is type(reference)
    torch.testing.assert_close(hf_logits(exported, tokens), ours, rtol=0, atol=ATOL)

    source = {
        k: v
        for f in sorted((tmp_path / "hf").glob("*.safetensors"))
        for k, v in load_file(f).items()
    }
    back = load_file(tmp_path / "out" / "model.safetensors")
    if reference.config.tie_word_embeddings:
        source.pop("lm_head.weight", None)
    assert sorted(back) == sorted(source)
    for key, value in source.items():
        assert torch.equal(back[key], value), key


def test_cli_prints_and_writes_the_trainer_flags(tmp_path, capsys, megatron_cpu):
    make_hf_model("llama31", tmp_path / "hf")
    assert main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 0
    flags = (tmp_path / "c" / FLAGS_FILE).read_text().split()
    printed = capsys.readouterr().out
    assert " ".join(flags) in printed
    expected = (
        "--num-layers 3 --hidden-size 48 --ffn-hidden-size 40 --num-attention-heads 6 "
        "--group-query-attention --num-query-groups 2 --normalization RMSNorm --norm-epsilon 1e-05 "
        "--swiglu --disable-bias-linear --position-embedding-type rope --rotary-base 500000 "
        "--use-rope-scaling --rope-scaling-factor 8.0"
    )
    assert " ".join(flags).startswith(expected)
    assert "--untie-embeddings-and-output-weights" in flags
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"


def test_missing_tensor_is_named(tmp_path):
    make_hf_model("mistral", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_hidden_layers"] = 4  # more layers than the weights hold
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="model.layers.3"):
        import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "c", progress=False)


def test_export_refuses_a_family_of_another_architecture(tmp_path, megatron_cpu):
    make_hf_model("qwen2", tmp_path / "hf")
    import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "c", progress=False)
    with pytest.raises(UsageError, match="query / key / value"):
        export_hf(load=tmp_path / "c", out=tmp_path / "o", family="llama", progress=False)


def test_single_process_leaves_an_existing_world_alone(megatron_cpu):
    from megatron.core import parallel_state

    with single_process():
        pass
    assert parallel_state.model_parallel_is_initialized()


def test_gpt2_files_without_the_transformer_prefix(tmp_path, tokens, megatron_cpu):
    # OpenAI's original upload names its tensors h.0.…, wte.weight: the same model
    from safetensors.torch import save_file

    reference = make_hf_model("gpt2", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in weights.items()}
    assert "wte.weight" in bare
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(bare, str(tmp_path / "hf" / "model.safetensors"))
    import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "c", progress=False)
    torch.testing.assert_close(
        our_logits(tmp_path / "c", tokens), hf_logits(reference, tokens), rtol=0, atol=ATOL
    )


def test_export_of_a_checkpoint_the_import_did_not_write(tmp_path, tokens, megatron_cpu):
    # a run trained from scratch (or fine-tuned with --save elsewhere) has no flags file: the
    # model's trainer flags and vocabulary come on the command line
    reference = make_hf_model("llama2", tmp_path / "hf")
    flags = import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "c", progress=False)
    (tmp_path / "c" / FLAGS_FILE).unlink()
    (tmp_path / "c" / "hf_config.json").unlink()
    with pytest.raises(UsageError, match="trainer flags"):
        export_hf(load=tmp_path / "c", out=tmp_path / "o", family="llama", progress=False)
    argv = ["export", "--load", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    assert main([*argv, "--family", "llama", "--vocab-size", str(VOCAB), *flags]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    torch.testing.assert_close(
        hf_logits(exported, tokens), hf_logits(reference, tokens), rtol=0, atol=ATOL
    )


def test_import_refuses_a_folder_that_holds_something(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "latest_checkpointed_iteration.txt").write_text("100\n")
    with pytest.raises(UsageError, match="already holds latest_checkpointed_iteration.txt"):
        import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "c", progress=False)


def test_a_qkv_bias_checkpoint_is_refused_by_a_model_without_one(tmp_path, megatron_cpu):
    # the biases' keys would otherwise be left unread: a model without them is another model
    make_hf_model("qwen2", tmp_path / "hf")
    import_hf(hf_dir=tmp_path / "hf", out=tmp_path / "ckpt", progress=False)
    flags = (tmp_path / "ckpt" / FLAGS_FILE).read_text().split()
    assert "--add-qkv-bias" in flags
    without = [flag for flag in flags if flag != "--add-qkv-bias"]
    with pytest.raises(
        UsageError, match=r"holds another model: qkv_bias True there, False here \(give --add-qkv"
    ):
        load_model(tmp_path / "ckpt", flags=without, vocab_size=VOCAB)


def test_help_ends_with_its_examples(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Examples::" not in out
    lines = out.rstrip().splitlines()
    assert "examples:" in lines
    assert lines[-1].strip().startswith("python -m tools.convert_hf export --load ckpt/llama31")
