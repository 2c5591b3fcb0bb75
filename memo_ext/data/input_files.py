"""The files a run's flags name, checked before any process group, model or dataset exists:
the --data-args-path / --per-split-data-args-path lists (read into the run here), the datasets'
``.bin`` / ``.idx`` pairs against ``--split``, the tokenizer's files against
``--vocab-size``, the estimator's calibration file. ``RunConfig.check`` reads no file; this does,
from the sections that name them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence

from memo_ext.config import DEFAULT_SPLIT, DataConfig, check_regular_file
from memo_ext.errors import UsageError
from memo_ext.hardware import read_calibration

logger = logging.getLogger(__name__)


def check_inputs(
    data: DataConfig, *, evaluation: bool, calibration: str | None = None
) -> DataConfig:
    """Read what the flags name: a missing or malformed file fails here, in one sentence.

    Args:
        data: the run's data section.
        evaluation: whether the run evaluates (a corpus must then keep validation documents).
        calibration: the estimator's calibration file (``--calibration``), if any.

    Returns:
        ``data`` with the argument files read into it and an unset ``--split`` fitted to the
        corpus (``fit_split``).

    Raises:
        UsageError: naming the file and what is wrong with it.
    """
    data = _check_data(data, evaluation=evaluation)
    if calibration is not None:
        read_calibration(calibration)
    return data


def _check_data(data: DataConfig, *, evaluation: bool) -> DataConfig:
    """The data files of ``check_inputs``: argument files, tokenizer files, datasets."""
    data = read_data_args(data)
    for flag, blend in (
        ("--data-path", data.data_path),
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
        ("--test-data-path", data.test_data_path),
    ):
        check_dataset_prefixes(blend, flag=flag)
    # megatron-core's readers, imported here: --help, a wrong flag and a wrong path import none
    from memo_ext.data.datasets import (
        SPLIT_PARTS,
        check_indexed_dataset,
        check_split_documents,
        fit_split,
        parse_blend,
    )
    from memo_ext.data.tokenizers import tokenizer_for

    if data.tokenizer_type not in ("ByteTokenizer", "NullTokenizer"):  # read from files
        tokenizer = tokenizer_for(data)
        if data.vocab_size is not None and data.vocab_size != tokenizer.vocab_size:
            raise UsageError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but --vocab-size says "
                f"{data.vocab_size}; drop --vocab-size"
            )
    if data.per_split:
        _check_per_split(data, evaluation=evaluation)
        return data
    try:
        prefixes = parse_blend(data.data_path)[0] if data.data_path else []
        documents = {prefix: check_indexed_dataset(prefix) for prefix in prefixes}
        split = data.split_or_default
        if data.split is None and documents and not data.variable_seq_lengths:
            split = fit_split(DEFAULT_SPLIT, list(documents.values()), keep_validation=evaluation)
            if split != DEFAULT_SPLIT:
                dropped = [
                    name
                    for name, before, after in zip(
                        SPLIT_PARTS, DEFAULT_SPLIT.split(","), split.split(",")
                    )
                    if before != after
                ]
                logger.info(
                    "--split %s: the default %s gives the %s part no document of the %d in the "
                    "smallest dataset; pass --split to choose",
                    split,
                    DEFAULT_SPLIT,
                    " and ".join(dropped),
                    min(documents.values()),
                )
        if not data.variable_seq_lengths:  # whole documents take no --split
            for prefix, count in documents.items():
                check_split_documents(prefix, split, documents=count)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    return dataclasses.replace(data, split=split)


DATASET_SUFFIXES = (".bin", ".idx")
"""The files of one dataset prefix: its tokens and its index."""


def check_dataset_prefixes(blend: Sequence[str], *, flag: str) -> None:
    """Each dataset prefix of ``blend`` (Megatron-LM's syntax: prefixes, or weights and prefixes)
    names its ``.bin`` / ``.idx`` pair: checked before megatron-core is imported (tens of
    seconds on a loaded machine), which reads the pairs afterwards (``check_indexed_dataset``).

    Raises:
        UsageError: a dataset's file given where its prefix belongs, or a missing file.
    """
    for item in (text.strip() for text in blend):  # as megatron-core reads them
        if _is_number(item) and not os.path.isfile(item + ".bin"):
            continue  # a weight
        stem, suffix = os.path.splitext(item)
        if suffix in DATASET_SUFFIXES and not os.path.isfile(item + ".bin"):
            raise UsageError(
                f"{flag} takes dataset prefixes, not files: give {stem} (drop {suffix}), which "
                f"names {stem}.bin and {stem}.idx"
            )
        for suffix in DATASET_SUFFIXES:
            if not os.path.isfile(item + suffix):
                raise UsageError(
                    f"Dataset file {item}{suffix} does not exist; create it with "
                    f"memo-preprocess-data or fix {flag}"
                )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_data_args(data: DataConfig) -> DataConfig:
    """``data`` with --data-args-path read into --data-path and --per-split-data-args-path into
    the three per-split paths (Megatron-LM's file formats); both file flags are then cleared.

    Raises:
        UsageError: naming the file and what is wrong with it.
    """
    if data.data_args_path is not None:
        text = _read_text(data.data_args_path, flag="--data-args-path")
        if not text.split():
            raise UsageError(f"--data-args-path {data.data_args_path} lists no dataset prefix")
        data = dataclasses.replace(data, data_path=tuple(text.split()), data_args_path=None)
    if data.per_split_data_args_path is not None:
        blends = _read_per_split(data.per_split_data_args_path)
        data = dataclasses.replace(
            data,
            train_data_path=blends["train"],
            valid_data_path=blends["valid"],
            test_data_path=blends["test"],
            per_split_data_args_path=None,
        )
    return data


def _read_text(path: str, *, flag: str) -> str:
    check_regular_file(path, flag=flag)  # a FIFO would block the read
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(
            f"{flag} {path} cannot be read ({err}); give an existing text file"
        ) from None
    if any(ch in text for ch in map(chr, range(32)) if ch not in "\t\n\r\f\v"):
        raise UsageError(f"{flag} {path} holds control characters: give a text file")
    return text


def _read_per_split(path: str) -> dict[str, tuple[str, ...]]:
    """The train / valid / test blends of a per-split JSON file; a string value is split on white
    space, as Megatron-LM does; a missing or null key is an empty blend."""
    flag = "--per-split-data-args-path"
    try:
        loaded = json.loads(_read_text(path, flag=flag))
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag} {path} is not valid JSON ({err})") from None
    if not isinstance(loaded, dict) or not set(loaded) <= {"train", "valid", "test"}:
        raise UsageError(
            f'{flag} {path} must hold one JSON object with keys "train", "valid" and "test"'
        )
    blends = {}
    for name in ("train", "valid", "test"):
        value = loaded.get(name) or []
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise UsageError(f'{flag} {path}: "{name}" must be a list of weights and prefixes')
        blends[name] = tuple(str(v) for v in value)
    if not blends["train"]:
        raise UsageError(f'{flag} {path} names no "train" dataset prefix')
    return blends


def _check_per_split(data: DataConfig, *, evaluation: bool) -> None:
    """Every prefix of every per-split blend: readable, with at least one document (each blend is
    used whole, so no --split check applies)."""
    from memo_ext.data.datasets import check_indexed_dataset, parse_blend

    if evaluation and not data.valid_data_path:
        raise UsageError(
            "--eval-interval evaluates on validation data, which per-split paths take from "
            '--valid-data-path (or the "valid" list); give it, or drop --eval-interval'
        )
    for flag, blend in (
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
        ("--test-data-path", data.test_data_path),
    ):
        if not blend:
            continue
        try:
            for prefix in parse_blend(blend, flag=flag)[0]:
                if check_indexed_dataset(prefix) < 1:
                    raise ValueError(f"{prefix} ({flag}) holds no document")
        except (ValueError, FileNotFoundError) as err:
            raise UsageError(str(err)) from None
