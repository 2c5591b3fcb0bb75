"""Packing variable-length documents into rows: layout invariants, and exactness through a real
megatron-core ``GPTModel`` (each packed document gets the losses and gradients it gets alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memo_ext.config import TokenizerSpec
from memo_ext.data.packing import first_fit_decreasing, pack_documents
from memo_ext.mcore.packed import build_packed_seq_params
from tests.models import LLAMA_TINY, build_gpt, cpu_config

VOCAB = 97


def random_documents(rng: np.random.Generator, lengths: list[int]) -> list[np.ndarray]:
    return [rng.integers(1, VOCAB, size=n, dtype=np.int64) for n in lengths]


# ---------------------------------------------------------------------------------------------
# layout invariants
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_every_token_once_and_rows_consistent(seed):
    rng = np.random.default_rng(seed)
    row_tokens = int(rng.integers(5, 40))
    lengths = rng.integers(1, row_tokens + 1, size=int(rng.integers(1, 30))).tolist()
    docs = random_documents(rng, lengths)
    rows = pack_documents(docs, row_tokens=row_tokens)
    seen = sorted(i for row in rows for i in row.document_ids)
    assert seen == list(range(len(docs)))
    for row in rows:
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert getattr(row, key).shape == (row_tokens,)
        cu, padded = row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
        assert row.cu_seqlens.dtype == torch.int32 and row.cu_seqlens_padded.dtype == torch.int32
        assert cu[0] == 0 and cu[-1] <= row_tokens and padded[-1] == row_tokens
        assert padded[:-1] == cu[:-1] and len(cu) == len(row.document_ids) + 1
        for k, doc_id in enumerate(row.document_ids):
            doc, start, end = docs[doc_id], cu[k], cu[k + 1]
            assert end - start == len(doc)
            assert row.tokens[start:end].tolist() == doc.tolist()
            assert row.position_ids[start:end].tolist() == list(range(len(doc)))
            # labels are the next token of the same document; the last token has none
            assert row.labels[start : end - 1].tolist() == doc[1:].tolist()
            assert row.loss_mask[start:end].tolist() == [1.0] * (len(doc) - 1) + [0.0]
        assert not row.loss_mask[cu[-1] :].any()  # padding
    real = sum(row.loss_mask.sum().item() for row in rows)
    assert real == sum(n - 1 for n in lengths)


def test_first_fit_decreasing_by_hand():
    # longest first: 6 → row 0 (room 2), 5 → row 1 (room 3), 4 → row 2 (room 4),
    # 3 → row 1 (room 0), 2 → row 0 (room 0), 1 → row 2
    assert first_fit_decreasing([2, 6, 3, 5, 1, 4], row_tokens=8) == [[1, 0], [3, 2], [5, 4]]
    assert first_fit_decreasing([], row_tokens=8) == []


def test_single_document_and_empty_input():
    doc = np.arange(1, 8)
    (row,) = pack_documents([doc], row_tokens=7)  # fills the row exactly: no padding
    assert row.cu_seqlens.tolist() == [0, 7] and row.cu_seqlens_padded.tolist() == [0, 7]
    (row,) = pack_documents([doc], row_tokens=10)
    assert row.cu_seqlens.tolist() == [0, 7] and row.cu_seqlens_padded.tolist() == [0, 10]
    assert row.loss_mask.sum() == 6
    assert pack_documents([], row_tokens=10) == []


@pytest.mark.parametrize("length", [0, 11])
def test_rejects_documents_that_do_not_fit(length):
    with pytest.raises(ValueError, match="cut documents at the row length"):
        pack_documents([np.ones(3, dtype=np.int64), np.ones(length, dtype=np.int64)], row_tokens=10)


def test_packed_params_take_the_longest_padded_segment():
    (row,) = pack_documents([np.arange(1, 6), np.arange(1, 4)], row_tokens=12)
    params = build_packed_seq_params(
        cu_seqlens=row.cu_seqlens, cu_seqlens_padded=row.cu_seqlens_padded, device="cpu"
    )
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 5, 8]
    assert params.cu_seqlens_q_padded.tolist() == [0, 5, 12]
    assert params.max_seqlen_q == params.max_seqlen_kv == 7  # 3 real + 4 padding


# ---------------------------------------------------------------------------------------------
# exactness through megatron-core's GPTModel
# ---------------------------------------------------------------------------------------------


def build_model(position_embedding_type: str, *, max_positions: int):
    return build_gpt(
        cpu_config(LLAMA_TINY),
        vocab_size=VOCAB,
        max_positions=max_positions,
        position_embedding_type=position_embedding_type,
    )


def losses_and_grads(model, run):
    model.zero_grad(set_to_none=True)
    losses = run(model)
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def alone(model, doc: np.ndarray) -> torch.Tensor:
    """Per-token losses ``[len - 1]`` of one document run unpacked, batch 1."""
    if len(doc) < 2:  # a one-token document has no label
        return torch.zeros(0)
    tokens = torch.from_numpy(doc).unsqueeze(0)
    positions = torch.arange(len(doc)).unsqueeze(0)
    losses = model(tokens[:, :-1], positions[:, :-1], None, labels=tokens[:, 1:])
    return losses[0]


def packed(model, row) -> torch.Tensor:
    """Per-token losses ``[row_tokens]`` of a packed row (``thd``, micro-batch size 1)."""
    params = build_packed_seq_params(
        cu_seqlens=row.cu_seqlens, cu_seqlens_padded=row.cu_seqlens_padded, device="cpu"
    )
    losses = model(
        row.tokens.unsqueeze(0),
        row.position_ids.unsqueeze(0),
        None,
        labels=row.labels.unsqueeze(0),
        packed_seq_params=params,
    )
    return losses[0]


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
@pytest.mark.parametrize(
    ("lengths", "row_tokens"),
    [([9, 2, 13, 5], 32), ([7], 7), ([1, 6], 9), ([12, 12], 12)],
    ids=["four-docs-padded", "one-doc-full-row", "one-token-doc", "two-full-rows"],
)
def test_packed_documents_match_running_alone(
    megatron_cpu, position_embedding_type, lengths, row_tokens
):
    model = build_model(position_embedding_type, max_positions=row_tokens)
    docs = random_documents(np.random.default_rng(len(lengths)), lengths)
    rows = pack_documents(docs, row_tokens=row_tokens)

    def run_packed(m):
        per_row = [packed(m, row) for row in rows]
        total = sum((losses * row.loss_mask).sum() for losses, row in zip(per_row, rows))
        total.backward()
        return torch.stack(per_row)

    def run_alone(m):
        per_doc = [alone(m, doc) for doc in docs]
        sum(losses.sum() for losses in per_doc).backward()
        return torch.cat(per_doc)

    packed_losses, packed_grads = losses_and_grads(model, run_packed)
    alone_losses, alone_grads = losses_and_grads(model, run_alone)
    # the same documents' labelled tokens, in the order of run_alone
    where = {}
    for r, row in enumerate(rows):
        for k, doc_id in enumerate(row.document_ids):
            start = int(row.cu_seqlens[k])
            where[doc_id] = packed_losses[r, start : start + len(docs[doc_id]) - 1]
    gathered = torch.cat([where[i] for i in range(len(docs))])
    assert gathered.shape == alone_losses.shape
    # the same per-token arithmetic on differently shaped matrices (a row of several documents
    # vs one document): the BLAS may block the products differently, so fp32 last bits differ
    torch.testing.assert_close(gathered, alone_losses, rtol=1e-5, atol=1e-5)
    for name, grad in alone_grads.items():
        # gradients sum the same per-token terms in another order (fp32 rounding); the unused
        # position-table rows of padding get gradient only from masked (zero-weight) tokens
        error = (packed_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error <= 1e-5, (name, error.item())


def test_rope_needs_padding_inside_a_segment(megatron_cpu):
    """Pins megatron-core's RoPE contract that ``build_packed_seq_params`` follows: the segments
    must cover the whole row, so boundaries without the padded form fail on a padded row."""
    model = build_model("rope", max_positions=16)
    (row,) = pack_documents(random_documents(np.random.default_rng(0), [6, 7]), row_tokens=16)
    params = build_packed_seq_params(
        cu_seqlens=row.cu_seqlens, cu_seqlens_padded=row.cu_seqlens_padded, device="cpu"
    )
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = None
    with pytest.raises(RuntimeError, match="split"):
        model(
            row.tokens.unsqueeze(0),
            row.position_ids.unsqueeze(0),
            None,
            labels=row.labels.unsqueeze(0),
            packed_seq_params=params,
        )


# ---------------------------------------------------------------------------------------------
# documents and per-rank micro-batches
# ---------------------------------------------------------------------------------------------


def test_mock_documents_are_long_tailed_and_deterministic():
    from memo_ext.data.documents import MockDocuments

    docs = MockDocuments(num_documents=2000, seq_length=512, vocab_size=VOCAB, seed=4)
    lengths = docs.lengths
    assert lengths.min() >= 2 and lengths.max() == 512
    assert np.median(lengths) < 512 / 4 < lengths.mean() * 2  # most are short
    assert (lengths == 512).mean() < 0.05  # a tail reaches the cut
    again = MockDocuments(num_documents=2000, seq_length=512, vocab_size=VOCAB, seed=4)
    assert np.array_equal(again.document(17), docs.document(17))
    assert len(docs.document(17)) == lengths[17] and docs.document(17).max() < VOCAB


def test_global_batches_resume_and_cross_epochs():
    from itertools import islice

    from memo_ext.data.documents import MockDocuments, global_batches

    docs = MockDocuments(num_documents=7, seq_length=30, vocab_size=VOCAB, seed=1)

    def batches(consumed, count):
        it = global_batches(
            docs, global_batch_size=3, seq_length=10, seed=9, consumed_documents=consumed
        )
        return [[d.tolist() for d in batch] for batch in islice(it, count)]

    full = batches(0, 6)  # 18 documents: two whole epochs of 7 and part of a third
    assert all(len(d) <= 10 for batch in full for d in batch)
    flat = [d for batch in full for d in batch]
    cut = sorted(docs.document(i)[:10].tolist() for i in range(7))
    assert sorted(flat[:7]) == cut and sorted(flat[7:14]) == cut  # each epoch once
    assert flat[:7] != flat[7:14]  # reshuffled per epoch
    assert batches(9, 3) == [flat[9:12], flat[12:15], flat[15:18]]  # resume mid-epoch


def test_indexed_documents_read_back_the_corpus(tmp_path):
    import json

    from memo_ext.data.documents import IndexedDocuments
    from memo_ext.data.preprocess import preprocess_jsonl

    texts = ["a", "hello world", "x" * 300, "long tail"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    summary = preprocess_jsonl(
        input_path=corpus,
        output_prefix=str(tmp_path / "c"),
        append_eod=True,
        show_progress=False,
        tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
    )
    docs = IndexedDocuments(summary.prefixes["text"])
    assert len(docs) == len(texts)
    for i, text in enumerate(texts):
        assert docs.document(i).tolist() == list(text.encode()) + [256]  # 256: end of document
    with pytest.raises(FileNotFoundError, match="preprocess_data"):
        IndexedDocuments(str(tmp_path / "missing"))


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_ranks_share_one_packing(dp_size):
    from itertools import islice

    from memo_ext.data.batches import packed_step_batches
    from memo_ext.data.documents import MockDocuments

    docs = MockDocuments(num_documents=50, seq_length=64, vocab_size=VOCAB, seed=2)
    steps = [
        list(
            islice(
                packed_step_batches(
                    docs, global_batch_size=9, seq_length=64, seed=0, dp_rank=r, dp_size=dp_size
                ),
                2,
            )
        )
        for r in range(dp_size)
    ]
    reference = list(
        islice(
            packed_step_batches(
                docs, global_batch_size=9, seq_length=64, seed=0, dp_rank=0, dp_size=1
            ),
            2,
        )
    )
    for step in range(2):
        counts = {len(steps[r][step]) for r in range(dp_size)}
        assert len(counts) == 1  # every rank runs as many micro-batches
        real = [mb for r in range(dp_size) for mb in steps[r][step] if mb["loss_mask"].any()]
        assert sorted(mb["tokens"].tolist() for mb in real) == sorted(
            mb["tokens"].tolist() for mb in reference[step]
        )
        for mb in real:
            assert mb["tokens"].shape == (1, 64) and mb["cu_seqlens"].dtype == torch.int32
