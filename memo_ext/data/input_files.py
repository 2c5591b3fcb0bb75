"""The files a run's flags name, checked before any process group, model or dataset exists:
the datasets' ``.bin`` / ``.idx`` pairs against ``--split``, the tokenizer's files against
``--vocab-size``, the estimator's calibration file. ``RunConfig.check`` reads no file; this does.
"""

from __future__ import annotations

from memo_ext.config import RunConfig
from memo_ext.data.datasets import check_indexed_dataset, check_split_documents, parse_blend
from memo_ext.data.tokenizers import tokenizer_for
from memo_ext.errors import UsageError
from memo_ext.hardware import read_calibration


def check_inputs(run: RunConfig) -> None:
    """Read what the flags name: a missing or malformed file fails here, in one sentence.

    Raises:
        UsageError: naming the file and what is wrong with it.
    """
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
        for prefix in prefixes:
            documents = check_indexed_dataset(prefix)
            if not data.variable_seq_lengths:  # whole documents take no --split
                check_split_documents(prefix, data.split, documents=documents)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    if run.preflight.calibration is not None:
        read_calibration(run.preflight.calibration)
