"""Datasets, blend / split parsing, the micro-batch order contract, and the demo corpus."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from memo_ext.data import demo_corpus
from memo_ext.data.datasets import build_gpt_datasets, parse_blend
from memo_ext.data.demo_corpus import build_demo_corpus, document_lengths, select_stdlib_files
from memo_ext.data.sampler import build_batch_iterator, micro_batch_indices
from memo_ext.data.tokenizers import ByteTokenizer
from tests.launch import run_job

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A 40-file demo corpus (about 400K byte tokens)."""
    out_dir = tmp_path_factory.mktemp("corpus")
    return build_demo_corpus(out_dir=out_dir, max_files=40, show_progress=False)


def _build(prefixes: list[str], *, cache_dir: str | None, num_samples=(300, 20, 20), **kwargs):
    options = dict(split="90,5,5", mock=False, seq_length=SEQ, seed=1234)
    options.update(kwargs)
    return build_gpt_datasets(
        data_path=prefixes,
        tokenizer=ByteTokenizer(),
        num_samples=num_samples,
        cache_dir=cache_dir,
        **options,
    )


def _stack(dataset, indices) -> torch.Tensor:
    return torch.stack([dataset[i]["tokens"] for i in indices])


# --- demo corpus ---------------------------------------------------------------------------


def test_demo_corpus_documents_are_the_stdlib_files(tmp_path):
    prefix = build_demo_corpus(out_dir=tmp_path, max_files=6, show_progress=False)
    assert prefix == str(tmp_path / "stdlib_text_document")
    files = select_stdlib_files(max_files=6)
    assert files == sorted(files) and len(files) == 6
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    # One document per non-empty file, in order, each followed by the eod id.
    expected = [len(t.encode("utf-8")) + 1 for t in texts if t]
    assert document_lengths(prefix).tolist() == expected


def test_demo_corpus_is_cached_and_rebuilt_on_mismatch(tmp_path, monkeypatch):
    prefix = build_demo_corpus(out_dir=tmp_path, max_files=3, show_progress=False)
    stamp = os.stat(prefix + ".bin").st_mtime_ns

    def fail(**kwargs):
        raise AssertionError("a cached corpus must not be tokenized again")

    monkeypatch.setattr(demo_corpus, "preprocess_jsonl", fail)
    assert build_demo_corpus(out_dir=tmp_path, max_files=3, show_progress=False) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp
    monkeypatch.undo()

    # A manifest from another Python version (or another file selection) forces a rebuild.
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "python": "0.0.0"}))
    build_demo_corpus(out_dir=tmp_path, max_files=3, show_progress=False)
    assert json.loads(manifest_path.read_text()) == manifest
    build_demo_corpus(out_dir=tmp_path, max_files=4, show_progress=False)
    assert json.loads(manifest_path.read_text())["files"] == 4
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["manifest.json", "stdlib_text_document.bin", "stdlib_text_document.idx"]
    )


# --- blend and split parsing ----------------------------------------------------------------


def test_parse_blend():
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_blend(["30", " a "]) == (["a"], [30.0])
    with pytest.raises(ValueError, match="non-negative"):
        parse_blend(["-1", "a", "2", "b"])
    with pytest.raises(ValueError, match="empty"):
        parse_blend([])
    with pytest.raises(ValueError, match="reads 0.5 as a dataset prefix: weights and prefixes"):
        parse_blend(["0.5", "a", "0.5"])  # a weight lost its prefix


@pytest.mark.parametrize("split", ["abc", "1,-1", "0,0,0", "1,2,3,4", ""])
def test_bad_split(corpus, split):
    with pytest.raises(ValueError, match="--split"):
        _build([corpus], cache_dir=None, split=split)


def test_missing_files_are_named_before_any_work(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.bin does not exist"):
        _build([corpus, str(tmp_path / "nope")], cache_dir=str(tmp_path))
    (tmp_path / "half.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"half\.idx does not exist"):
        _build(["1", corpus, "1", str(tmp_path / "half")], cache_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["half.bin"]


def test_flags_must_choose_mock_or_data(corpus):
    with pytest.raises(ValueError, match="exactly one"):
        _build([corpus], cache_dir=None, mock=True)
    with pytest.raises(ValueError, match="exactly one"):
        _build(None, cache_dir=None)


# --- datasets -------------------------------------------------------------------------------


def test_mock_datasets():
    train, valid, test = build_gpt_datasets(
        data_path=None,
        split="969,30,1",
        mock=True,
        seq_length=SEQ,
        seed=0,
        tokenizer=ByteTokenizer(),
        num_samples=(50, 5, 5),
    )
    for dataset in (train, valid, test):
        assert len(dataset) >= 50
        sample = dataset[3]
        assert sample["tokens"].shape == sample["labels"].shape == (SEQ,)
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert int(sample["tokens"].max()) <= ByteTokenizer().eod


def test_mock_loss_masks_do_not_depend_on_read_order():
    """Mock data holds every id; a pad id among them once made masks depend on which sample a
    process read first (megatron-core caches the first sample's mask and edits it in place)."""

    def masks(order):
        train, _, _ = build_gpt_datasets(
            data_path=None,
            split="1,1,1",
            mock=True,
            seq_length=SEQ,
            seed=0,
            tokenizer=ByteTokenizer(),
            num_samples=(64, 0, 0),
        )
        return {i: train[i]["loss_mask"].clone() for i in order}

    forward, backward = masks(range(64)), masks(reversed(range(64)))
    for i in range(64):
        assert torch.equal(forward[i], backward[i])
        assert bool(forward[i].all())


def test_real_datasets_hold_corpus_text(corpus, tmp_path):
    train, valid, test = _build([corpus], cache_dir=str(tmp_path))
    assert len(train) >= 300 and len(valid) >= 20 and len(test) >= 20
    raw = np.fromfile(corpus + ".bin", dtype=np.uint16)  # ByteTokenizer ids fit in uint16
    haystack = raw.tobytes()
    for index in (0, 7, len(train) - 1):
        sample = train[index]
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))
        # Samples may span documents, so look for a stretch inside one document.
        tokens = sample["tokens"].numpy()
        stretch = tokens[: np.argmax(tokens == 256)] if (tokens == 256).any() else tokens
        assert stretch.astype(np.uint16).tobytes() in haystack
    # Same seed and cache directory: the second build loads identical indices.
    again, _, _ = _build([corpus], cache_dir=str(tmp_path))
    assert torch.equal(_stack(train, range(20)), _stack(again, range(20)))


def test_split_with_zero_weight_is_none(corpus, tmp_path):
    train, valid, test = _build([corpus], cache_dir=str(tmp_path), split="98,2,0")
    assert train is not None and valid is not None and test is None


def test_weighted_blend(corpus, tmp_path):
    # The same corpus twice under two names: the blend draws from both in a 3:1 ratio.
    other = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        Path(other + suffix).write_bytes(Path(corpus + suffix).read_bytes())
    train, _, _ = _build(["3", corpus, "1", other], cache_dir=None, num_samples=(400, 8, 8))
    assert len(train) == 400
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [300, 100]


def test_blend_cache_without_process_group_is_a_clear_error(corpus, tmp_path):
    with pytest.raises(ValueError, match="torch.distributed"):
        _build(["1", corpus, "1", corpus], cache_dir=str(tmp_path))


# --- micro-batches --------------------------------------------------------------------------


def test_batches_shapes_dtypes_and_shift(corpus, tmp_path):
    train, _, _ = _build([corpus], cache_dir=str(tmp_path))
    batch = next(
        build_batch_iterator(train, micro_batch_size=3, data_parallel_rank=0, data_parallel_size=1)
    )
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key in ("tokens", "labels", "position_ids"):
        assert batch[key].shape == (3, SEQ) and batch[key].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert torch.equal(batch["tokens"], _stack(train, range(3)))


def _global_steps(dataset, *, dp: int, mbs: int, gbs: int, steps: int) -> list[torch.Tensor]:
    """The samples each optimizer step sees, over all DP ranks, sorted into a canonical order."""
    iterators = [
        build_batch_iterator(
            dataset, micro_batch_size=mbs, data_parallel_rank=r, data_parallel_size=dp
        )
        for r in range(dp)
    ]
    result = []
    for _ in range(steps):
        rows = [next(it)["tokens"] for _ in range(gbs // (mbs * dp)) for it in iterators]
        tokens = torch.cat(rows)
        order = sorted(range(len(tokens)), key=lambda i: tokens[i].tolist())
        result.append(tokens[order])
    return result


def test_global_batch_does_not_depend_on_dp_size(corpus, tmp_path):
    train, _, _ = _build([corpus], cache_dir=str(tmp_path))
    reference = _global_steps(train, dp=1, mbs=2, gbs=8, steps=3)
    for dp, mbs in ((2, 2), (4, 2), (2, 4), (8, 1)):
        steps = _global_steps(train, dp=dp, mbs=mbs, gbs=8, steps=3)
        assert all(torch.equal(a, b) for a, b in zip(steps, reference)), (dp, mbs)
    # ... and is the contiguous block [step * gbs, (step + 1) * gbs) of the global order.
    first = _stack(train, range(8))
    assert torch.equal(reference[0], first[sorted(range(8), key=lambda i: first[i].tolist())])


def test_ranks_get_disjoint_micro_batches():
    batches = [
        list(
            micro_batch_indices(
                num_samples=23, micro_batch_size=2, data_parallel_rank=r, data_parallel_size=3
            )
        )
        for r in range(3)
    ]
    assert batches[1][:2] == [[2, 3], [8, 9]]
    # Every rank stops at the last complete micro-step: 23 // 6 = 3 steps, samples 0..17.
    assert all(len(b) == 3 for b in batches)
    flat = sorted(i for rank in batches for batch in rank for i in batch)
    assert flat == list(range(18))


@pytest.mark.parametrize("dp, rank", [(1, 0), (2, 1), (3, 2)])
def test_consumed_samples_resume_continues_the_order(corpus, tmp_path, dp, rank):
    train, _, _ = _build([corpus], cache_dir=str(tmp_path))
    mbs = 2
    kwargs = dict(micro_batch_size=mbs, data_parallel_rank=rank, data_parallel_size=dp)
    full = build_batch_iterator(train, **kwargs)
    batches = [next(full)["tokens"] for _ in range(5)]
    resumed = build_batch_iterator(train, consumed_samples=2 * mbs * dp, **kwargs)
    for expected in batches[2:]:
        assert torch.equal(next(resumed)["tokens"], expected)


def test_iterator_argument_errors(corpus, tmp_path):
    with pytest.raises(ValueError, match="data_parallel_rank"):
        next(
            micro_batch_indices(
                num_samples=10, micro_batch_size=1, data_parallel_rank=2, data_parallel_size=2
            )
        )
    with pytest.raises(ValueError, match="consumed_samples"):
        next(
            micro_batch_indices(
                num_samples=10,
                micro_batch_size=1,
                data_parallel_rank=0,
                data_parallel_size=1,
                consumed_samples=11,
            )
        )


# --- under torch.distributed (gloo) ---------------------------------------------------------


def distributed_build_job(argv: list[str]) -> int:
    """One rank of a job of the tests' worker pool (rank, world and rendezvous in its
    environment): builds the datasets under gloo and saves its first batch to ``out``."""
    prefix, cache_dir, out = argv
    torch.distributed.init_process_group("gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        train, _, _ = _build([prefix], cache_dir=cache_dir)
        blended, _, _ = _build(["1", prefix, "2", prefix], cache_dir=cache_dir)
        batch = next(
            build_batch_iterator(
                train, micro_batch_size=2, data_parallel_rank=rank, data_parallel_size=world_size
            )
        )
        torch.save(
            {"batch": batch["tokens"], "blended": _stack(blended, range(6))}, f"{out}/rank{rank}.pt"
        )
    finally:
        torch.distributed.destroy_process_group()
    return 0


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(sys.platform != "linux", reason="gloo over localhost is set up for Linux here")
def test_builds_under_gloo_match_one_process(corpus, tmp_path):
    cache_dir = str(tmp_path / "cache")
    job = run_job(
        [corpus, cache_dir, str(tmp_path)],
        nproc=2,
        entry="tests.unit.test_data:distributed_build_job",
    )
    assert job.status == 0, job.describe()
    train, _, _ = _build([corpus], cache_dir=str(tmp_path / "single"))
    blended, _, _ = _build(["1", corpus, "2", corpus], cache_dir=None)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, result in enumerate(results):
        assert torch.equal(result["batch"], _stack(train, [2 * rank, 2 * rank + 1]))
        assert torch.equal(result["blended"], _stack(blended, range(6)))
