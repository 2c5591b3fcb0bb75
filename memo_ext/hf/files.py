"""The files of a Hugging Face model folder, each checked before a tensor is read: config.json,
the shard index, every safetensors header, and the tensor names against the model config.json
describes (none missing, none left over: a leftover tensor is a model the config does not
describe, such as a layer more than ``num_hidden_layers``).

Every problem is one sentence naming the file; none reaches the converter as a parser's
traceback or, worse, as a model silently built from part of its weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from memo_ext.errors import UsageError
from memo_ext.files import read_json
from memo_ext.hf.weights import HFModel, links_for

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"

IGNORED = re.compile(r"(.*\.)?(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")
"""Buffers some uploads hold that are no weights (RoPE's inverse frequencies, GPT-2's causal
mask): recomputed by any model, never read."""

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def read_config(hf_dir: Path) -> dict:
    """``hf_dir``'s config.json, a JSON object.

    Raises:
        UsageError: no such folder or file, or a file that is not a JSON object.
    """
    path = hf_dir / CONFIG
    if not path.is_file():
        raise UsageError(f"--hf-dir {hf_dir} holds no {CONFIG}; give a Hugging Face model folder")
    return read_json(path)


def tensor_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file that holds it, from the shard index when there is
    one, else from the files' headers; every file's header is read (and so checked) here.

    Raises:
        UsageError: no safetensors file, a damaged index, a shard it names missing, or a file
            that is not a whole safetensors file.
    """
    index = hf_dir / INDEX
    if index.is_file():
        files = _indexed_files(index)
        held = {}
        for file in sorted(set(files.values())):
            held.update(dict.fromkeys(header_names(file), file))
        absent = [name for name, file in files.items() if held.get(name) != file]
        if absent:
            raise UsageError(
                f"{index} places {len(absent)} tensor(s) in files that do not hold them, e.g. "
                f"{absent[0]} in {files[absent[0]].name}"
            )
        return files
    paths = sorted(hf_dir.glob("*.safetensors"))
    if not paths:
        raise UsageError(
            f"--hf-dir {hf_dir} holds no *.safetensors file (PyTorch .bin weights are not read: "
            "save the model with safe_serialization=True)"
        )
    found: dict[str, Path] = {}
    for file in paths:
        for name in header_names(file):
            if name in found:
                raise UsageError(
                    f"{hf_dir} holds {name} twice, in {found[name].name} and {file.name}, and no "
                    f"{INDEX} to say which to read"
                )
            found[name] = file
    return found


def _indexed_files(index: Path) -> dict[str, Path]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"{index} has no weight_map object naming the tensors' files")
    bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or "/" in v]
    if bad:
        name, value = bad[0]
        raise UsageError(f"{index} maps {name} to {value!r}, not the name of a file in the folder")
    missing = sorted({v for v in weight_map.values() if not (index.parent / v).is_file()})
    if missing:
        raise UsageError(
            f"{index} names {len(missing)} shard(s) the folder lacks, e.g. {missing[0]}: "
            "the download is incomplete"
        )
    return {name: index.parent / file for name, file in weight_map.items()}


def header_names(file: Path) -> list[str]:
    """The tensor names ``file``'s safetensors header holds, after checking that the header is
    whole and that the file holds every byte it announces.

    Raises:
        UsageError: a file cut short or not in the safetensors format.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise UsageError(
            f"{file} is not a whole safetensors file ({err}): a download cut short? Fetch it again"
        ) from None


def check_names(model: HFModel, files: dict[str, Path], hf_dir: Path) -> None:
    """Every tensor of ``model`` is in the files, and every tensor of the files is in
    the model (a tied model's own ``lm_head.weight`` aside: :func:`check_tied_head` looks at it).

    Raises:
        UsageError: a missing tensor, or tensors the model config.json describes has no place
            for (layers beyond ``num_hidden_layers`` named as such).
    """
    links = links_for(model, names=set(files))
    wanted = {name for link in links for name in link.sources}
    missing = sorted(wanted - set(files))
    if missing:
        raise UsageError(
            f"{hf_dir} lacks {len(missing)} tensor(s) a {model.family} model has, e.g. "
            f"{missing[0]}; is {CONFIG} the one of these weights?"
        )
    extra = sorted(
        name
        for name in set(files) - wanted
        if not IGNORED.fullmatch(name) and not (model.tied and name == "lm_head.weight")
    )
    if not extra:
        return
    layers = sorted({int(m.group(1)) for name in extra if (m := _LAYER.search(name))})
    if layers and layers[0] >= model.shape.num_layers:
        raise UsageError(
            f"{hf_dir}'s weights hold {layers[-1] + 1} layers, {CONFIG} says "
            f"{model.shape.num_layers}: fix num_hidden_layers (importing would drop layers "
            f"{', '.join(map(str, layers))})"
        )
    raise UsageError(
        f"{hf_dir} holds {len(extra)} tensor(s) a {model.family} model of this {CONFIG} has no "
        f"place for, e.g. {extra[0]}: is {CONFIG} the one of these weights?"
    )


def check_tied_head(model: HFModel, files: dict[str, Path], read) -> None:
    """A model whose config ties the output layer to the embedding may still hold its own
    ``lm_head.weight``; it is dropped only when it equals the embedding (``read``: name → tensor).

    Raises:
        UsageError: the two differ, so the files hold an untied model.
    """
    if not model.tied or "lm_head.weight" not in files:
        return
    embedding = next(link.sources[0] for link in links_for(model, names=set(files)))
    if not torch.equal(read("lm_head.weight"), read(embedding)):
        raise UsageError(
            f"{CONFIG} ties the output layer to the embedding (tie_word_embeddings), but "
            f"{files['lm_head.weight'].name} holds an lm_head.weight of its own that differs "
            f"from {embedding}: set tie_word_embeddings to false to import both"
        )
