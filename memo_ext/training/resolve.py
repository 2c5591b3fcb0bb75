"""A parsed run resolved against its tokenizer and data: the frozen config the trainer runs.

:func:`resolve_run` settles what the flags leave open, once, before any process group exists
(every rank reaches the same result from the same flags and data):

- the vocabulary: the tokenizer's size, and the embedding table padded to a multiple of
  lcm(``--make-vocab-size-divisible-by``, every TP degree the run uses) rather than Megatron-LM's
  divisible-by × TP: padded logits enter the softmax, so the table must not change with TP; a
  run that loads a Megatron-LM checkpoint adopts that checkpoint's padded rows instead
  (``memo_ext.training.checkpoint.padded_vocab_to_load``);
- each feature's own open choices (``Extension.resolve``): HotSPa's layouts and home layout,
  MEMO's ``--memo-chunk-tokens auto``, for the one device the run plans for
  (``memo_ext.features.preflight.planning_target``).

It returns a new :class:`~memo_ext.config.RunConfig` (``dataclasses.replace``).
"""

from __future__ import annotations

import dataclasses

from memo_ext.config import RunConfig
from memo_ext.data.documents import document_source
from memo_ext.extension import Extension, PlanningTarget, ResolveContext
from memo_ext.features.extensions import extensions_for
from memo_ext.features.preflight import planning_target
from memo_ext.shapes import embedding_rows
from memo_ext.training.checkpoint import padded_vocab_to_load


def resolve_run(
    run: RunConfig,
    *,
    tokenizer,
    extensions: list[Extension] | None = None,
    target: PlanningTarget | None = None,
) -> RunConfig:
    """``run`` with its vocabulary and every feature's choices settled (see the module
    docstring); ``extensions`` default to the run's own, ``target`` to its planning target."""
    shape = dataclasses.replace(
        run.shape,
        vocab_size=tokenizer.vocab_size,
        untie_embeddings_and_output_weights=run.model.untie_embeddings_and_output_weights,
    )
    run = dataclasses.replace(run, shape=shape)
    parsed = run
    context = ResolveContext(
        tokenizer=tokenizer,
        target=target or planning_target(run),
        documents=lambda: document_source(
            parsed.data, parsed.train, vocab_size=tokenizer.vocab_size
        ),
    )
    extensions = extensions_for(run) if extensions is None else extensions
    for extension in extensions:
        run = extension.resolve(run, context)
    tp_sizes = [run.layout.tp] + [tp for e in extensions for tp in e.model_tp_sizes(run)]
    padded = embedding_rows(
        tokenizer.vocab_size, divisible_by=run.model.make_vocab_size_divisible_by, tp_sizes=tp_sizes
    )
    padded = padded_vocab_to_load(
        run.checkpoint, vocab_size=tokenizer.vocab_size, tp_sizes=tp_sizes, padded=padded
    )
    return dataclasses.replace(run, model=dataclasses.replace(run.model, padded_vocab_size=padded))
