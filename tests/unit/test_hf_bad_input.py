"""Damaged or inconsistent Hugging Face folders at the converter's door: each is one sentence
naming the file, before any model is built, and none imports part of its weights in silence."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from memo_ext.commands.convert_hf import main  # noqa: E402
from memo_ext.errors import UsageError  # noqa: E402
from memo_ext.hf.checkpoint import export_hf, import_hf  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_hf_model("llama2", root / "llama")
    make_hf_model("llama2", root / "sharded", shard=True)
    return root


def copy(made, name, tmp_path):
    shutil.copytree(made / name, tmp_path / "hf")
    return tmp_path / "hf"


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def import_fails(folder, tmp_path, match):
    with pytest.raises(UsageError, match=match):
        import_hf(hf_dir=folder, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def cut(path, keep: int):
    """Keep the first ``keep`` bytes of ``path`` (all but the last ``-keep`` when negative)."""
    path.write_bytes(path.read_bytes()[:keep])


def test_a_layer_more_in_the_weights_than_the_config_says_is_refused(made, tmp_path):
    hf = copy(made, "llama", tmp_path)
    edit_config(hf, num_hidden_layers=2)  # the files hold 3
    import_fails(hf, tmp_path, r"hold 3 layers, config.json says 2: .*drop layers 2")


def test_a_tied_config_with_a_different_head_in_the_files_is_refused(made, tmp_path):
    hf = copy(made, "llama", tmp_path)
    edit_config(hf, tie_word_embeddings=True)
    import_fails(hf, tmp_path, "lm_head.weight of its own that differs")


def test_a_tied_config_whose_files_repeat_the_embedding_imports(made, tmp_path, megatron_cpu):
    hf = copy(made, "llama", tmp_path)
    edit_config(hf, tie_word_embeddings=True)
    weights = load_file(hf / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(hf / "model.safetensors"))
    flags = import_hf(hf_dir=hf, out=tmp_path / "out", progress=False)
    assert "--untie-embeddings-and-output-weights" not in flags


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_attention_heads": ...}, "lacks num_attention_heads, which a llama model needs"),
        ({"hidden_size": "48"}, "hidden_size is '48'; it must be a whole number"),
        ({"num_hidden_layers": 0}, "num_hidden_layers is 0"),
        ({"num_key_value_heads": 4}, "not a multiple of its num_key_value_heads 4"),
        ({"rms_norm_eps": -1}, "rms_norm_eps is -1; it must be a positive number"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings is 'no'; it must be true or false"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling gives no factor"),
        ({"rope_scaling": [8.0]}, "rope_scaling is \\[8.0\\]; it must be an object"),
        ({"intermediate_size": ...}, "lacks intermediate_size"),
    ],
)
def test_a_config_field_missing_or_of_the_wrong_kind_is_named(made, tmp_path, changes, match):
    hf = copy(made, "llama", tmp_path)
    edit_config(hf, **changes)
    import_fails(hf, tmp_path, match)


def test_a_config_json_cut_short_or_not_an_object_is_named(made, tmp_path):
    hf = copy(made, "llama", tmp_path)
    cut(hf / "config.json", 100)
    import_fails(hf, tmp_path, r"config.json is cut short")
    (hf / "config.json").write_text("[1, 2]")
    import_fails(hf, tmp_path, r"config.json holds a list, not an object")


@pytest.mark.parametrize("keep", [5, -100])  # the header cut, the data cut
def test_a_safetensors_file_cut_short_is_named(made, tmp_path, keep):
    hf = copy(made, "llama", tmp_path)
    cut(hf / "model.safetensors", keep)
    import_fails(hf, tmp_path, r"model.safetensors is not a whole safetensors file")


def test_a_damaged_shard_index_is_named(made, tmp_path):
    hf = copy(made, "sharded", tmp_path)
    index = hf / "model.safetensors.index.json"
    text = index.read_text()
    index.write_text(text[:200])
    import_fails(hf, tmp_path, "index.json is cut short")
    index.write_text(json.dumps({"weight_map": [1]}))
    import_fails(hf, tmp_path, "has no weight_map object")
    doc = json.loads(text)
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = "model-00009-of-00011.safetensors"  # a shard without it
    index.write_text(json.dumps(doc))
    import_fails(hf, tmp_path, f"in files that do not hold them, e.g. {name}")
    index.write_text(text)
    (hf / "model-00003-of-00011.safetensors").unlink()
    import_fails(hf, tmp_path, "names 1 shard\\(s\\) the folder lacks, e.g. model-00003")


def test_export_into_another_models_folder_is_refused_and_leaves_it_intact(
    made, tmp_path, megatron_cpu
):
    import_hf(hf_dir=made / "llama", out=tmp_path / "ckpt", progress=False)
    other = copy(made, "sharded", tmp_path)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(UsageError, match="already holds config.json, generation_config.json"):
        export_hf(load=tmp_path / "ckpt", out=other, family="llama", progress=False)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    argv = ["export", "--load", str(tmp_path / "ckpt"), "--out", str(other), "--family", "llama"]
    assert main(argv) == 2
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(other)  # still loads, as it was


def test_the_checked_model_still_imports_whole(made, tmp_path, megatron_cpu):
    # the checks pass a sound folder: every weight arrives (the logits are compared with
    # transformers' in test_convert_hf)
    flags = import_hf(hf_dir=made / "sharded", out=tmp_path / "out", progress=False)
    assert flags[flags.index("--num-layers") + 1] == "3"
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "0\n"


def test_an_fp16_export_of_weights_fp16_cannot_hold_is_refused(made, tmp_path, megatron_cpu):
    hf = copy(made, "llama", tmp_path)
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e6  # fp16's largest is 65504
    save_file(weights, str(hf / "model.safetensors"))
    import_hf(hf_dir=hf, out=tmp_path / "ckpt", progress=False)
    with pytest.raises(UsageError, match="down_proj.weight holds values up to 1e\\+06, which "
                       "float16 cannot represent"):  # fmt: skip
        export_hf(load=tmp_path / "ckpt", out=tmp_path / "o", family="llama", dtype="float16",
                  progress=False)  # fmt: skip
    export_hf(load=tmp_path / "ckpt", out=tmp_path / "b", family="llama", dtype="bfloat16",
              progress=False)  # fmt: skip


def test_the_converter_prints_no_notice_about_its_own_flags(made, tmp_path, caplog):
    # its trainer flags hold --group-query-attention, a Megatron-LM flag the trainer notes
    # when a user types it
    with caplog.at_level("INFO"):
        import_hf(hf_dir=made / "llama", out=tmp_path / "ckpt", progress=False)
        export_hf(load=tmp_path / "ckpt", out=tmp_path / "hf", family="llama", progress=False)
    assert "Megatron-LM flag" not in caplog.text
    assert "saved checkpoint" in caplog.text  # the log was captured
