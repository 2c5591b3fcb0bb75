"""The files a run's flags name, checked before any process group, model or dataset exists:
the datasets' ``.bin`` / ``.idx`` pairs against ``--split``, the tokenizer's files against
``--vocab-size``, the estimator's calibration file. ``RunConfig.check`` reads no file; this does.
"""

from __future__ import annotations

import dataclasses
import logging

from memo_ext.config import DEFAULT_SPLIT, RunConfig
from memo_ext.errors import UsageError
from memo_ext.hardware import read_calibration


logger = logging.getLogger(__name__)


def check_inputs(run: RunConfig) -> RunConfig:
    """Read what the flags name: a missing or malformed file fails here, in one sentence.
    Returns ``run`` with an unset ``--split`` fitted to the corpus (``fit_split``).

    Raises:
        UsageError: naming the file and what is wrong with it.
    """
    # megatron-core's readers, imported here: --help and a wrong flag import no megatron-core
    from memo_ext.data.datasets import (
        SPLIT_PARTS,
        check_indexed_dataset,
        check_split_documents,
        fit_split,
        parse_blend,
    )
    from memo_ext.data.tokenizers import tokenizer_for

    data = run.data
    if data.tokenizer_type in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        tokenizer = tokenizer_for(data)
        if data.vocab_size is not None and data.vocab_size != tokenizer.vocab_size:
            raise UsageError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but --vocab-size says "
                f"{data.vocab_size}; drop --vocab-size"
            )
    try:
        prefixes = parse_blend(data.data_path)[0] if data.data_path else []
        documents = {prefix: check_indexed_dataset(prefix) for prefix in prefixes}
        split = data.split_or_default
        if data.split is None and documents and not data.variable_seq_lengths:
            split = fit_split(
                DEFAULT_SPLIT, list(documents.values()), keep_validation=run.evaluation.enabled
            )
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
    if run.preflight.calibration is not None:
        read_calibration(run.preflight.calibration)
    return dataclasses.replace(run, data=dataclasses.replace(data, split=split))
