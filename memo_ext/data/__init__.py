"""Tokens for training: tokenizers, indexed datasets and whole documents packed into rows.

Modules:
    tokenizers: ``build_tokenizer`` (Byte, Null, local HuggingFace and GPT-2 BPE; nothing is
        downloaded).
    datasets: ``preprocess_jsonl`` (JSON Lines → ``.bin`` / ``.idx``, the engine of
        ``tools/preprocess_data.py``), ``build_gpt_datasets`` (``--data-path`` / ``--split`` /
        ``--mock-data``) and ``build_batch_iterator`` (the micro-batch order of every DP rank).
    documents: whole documents of a dataset (``--variable-seq-lengths``) and their global order.
    packing: documents into rows with per-document attention boundaries (``cu_seqlens``).
    batches: ``packed_step_batches``, one step's packed rows of this DP rank.
    demo_corpus: the standard-library corpus of ``make demo`` (``tools/demo_corpus.py``).
"""
