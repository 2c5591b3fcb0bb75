"""A small real-text corpus made on first use from the running Python's standard library.

Every machine that runs this project has the standard library's ``*.py`` sources, so they make a
corpus that needs no download and no committed data: varied text (code, docstrings, comments)
with a long-tailed document-length distribution, one document per file. The files are taken in
sorted order, tokenized with ``ByteTokenizer`` with an end-of-document id after each file, and
written as a megatron-core indexed dataset:

    from memo_ext.data.demo_corpus import build_demo_corpus
    prefix = build_demo_corpus(out_dir=Path("data/demo"))  # → "data/demo/stdlib_text_document"
    # then: --data-path data/demo/stdlib_text_document --tokenizer-type ByteTokenizer

The result is cached: a manifest (Python version, file selection, file count) next to the data
decides whether a later call can return the existing prefix at once.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sysconfig
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tqdm import tqdm

from memo_ext.config import TokenizerSpec
from memo_ext.data.preprocess import document_prefix, preprocess_jsonl

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "memo-demo-corpus/1"
_NAME = "stdlib"
# Directories of the standard library that are not plain library source: test suites (huge,
# repetitive, data-like), third-party packages and the IDE.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}


def _is_skipped_dir(name: str) -> bool:
    return name in _SKIPPED_DIRS or name.startswith("test")


def select_stdlib_files(
    *, max_files: int | None = None, max_file_bytes: int = 200_000
) -> list[Path]:
    """The standard-library sources that make up the corpus, in a fixed (sorted) order.

    Args:
        max_files: Keep only the first ``max_files`` files (for quick tests); ``None`` keeps all.
        max_file_bytes: Skip files larger than this (a few generated tables).

    Returns:
        Absolute paths, sorted by their path relative to the standard library.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so that os.walk never descends into site-packages or test suites.
        dirnames[:] = [name for name in dirnames if not _is_skipped_dir(name)]
        here = Path(dirpath).relative_to(root)
        relative_paths += [here / name for name in filenames if name.endswith(".py")]
    files = []
    for relative in sorted(relative_paths):
        path = root / relative
        if path.is_file() and path.stat().st_size <= max_file_bytes:
            files.append(path)
        if max_files is not None and len(files) == max_files:
            break
    return files


def _expected_manifest(*, files: list[Path], max_files: int | None, max_file_bytes: int) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "python": platform.python_version(),
        "max_files": max_files,
        "max_file_bytes": max_file_bytes,
        "files": len(files),
        "source_bytes": sum(path.stat().st_size for path in files),
    }


def _is_cached(out_dir: Path, manifest: dict) -> bool:
    prefix = document_prefix(str(out_dir / _NAME), "text")
    manifest_path = out_dir / "manifest.json"
    if not all(os.path.isfile(p) for p in (f"{prefix}.bin", f"{prefix}.idx", manifest_path)):
        return False
    try:
        return json.loads(manifest_path.read_text()) == manifest
    except json.JSONDecodeError:
        return False


def _write_jsonl(*, files: list[Path], path: Path, show_progress: bool) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    with open(path, "w", encoding="utf-8") as handle:
        for file in tqdm(files, desc="collecting stdlib sources", disable=not show_progress):
            # A few sources are not UTF-8; replacement characters keep them usable as text.
            text = file.read_bytes().decode("utf-8", errors="replace")
            record = {"text": text, "path": str(file.relative_to(root))}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def build_demo_corpus(
    *,
    out_dir: Path,
    max_files: int | None = None,
    max_file_bytes: int = 200_000,
    show_progress: bool = True,
) -> str:
    """Build (or reuse) the standard-library demo corpus and return its data prefix.

    Not safe to call from several processes at once on the same ``out_dir``: under
    ``torch.distributed`` call it on one rank, then barrier, then on the others (a cache hit).

    Args:
        out_dir: Directory for the dataset and its manifest (created if missing).
        max_files: Use only the first ``max_files`` sources (quick tests); ``None`` uses all.
        max_file_bytes: Skip sources larger than this.
        show_progress: Show tqdm progress bars while building.

    Returns:
        The prefix for ``--data-path``: ``{out_dir}/stdlib_text_document``.
    """
    out_dir = Path(out_dir)
    files = select_stdlib_files(max_files=max_files, max_file_bytes=max_file_bytes)
    if not files:
        raise FileNotFoundError(
            f"No standard-library sources found under {sysconfig.get_paths()['stdlib']}; "
            f"the demo corpus needs a Python installation with its library sources."
        )
    manifest = _expected_manifest(files=files, max_files=max_files, max_file_bytes=max_file_bytes)
    prefix = document_prefix(str(out_dir / _NAME), "text")
    if _is_cached(out_dir, manifest):
        logger.info("demo corpus: reusing %s", prefix)
        return prefix
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").unlink(missing_ok=True)
    jsonl_path = out_dir / f"{_NAME}.jsonl"
    _write_jsonl(files=files, path=jsonl_path, show_progress=show_progress)
    summary = preprocess_jsonl(
        input_path=jsonl_path,
        output_prefix=str(out_dir / _NAME),
        append_eod=True,
        show_progress=show_progress,
        tokenizer=TokenizerSpec(tokenizer_type="ByteTokenizer"),
    )
    jsonl_path.unlink()
    # The manifest is written last: its presence marks a complete build.
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info(
        "demo corpus: %d documents, %d tokens in %.1f s → %s",
        summary.documents,
        summary.tokens,
        summary.seconds,
        prefix,
    )
    return prefix


def document_lengths(prefix: str) -> np.ndarray:
    """Tokens per document of an indexed dataset, read from its ``.idx`` file.

    Args:
        prefix: Dataset prefix (without ``.bin`` / ``.idx``).

    Returns:
        int64 array with one entry per document (the sum of its sequences' lengths).
    """
    if not os.path.isfile(f"{prefix}.idx"):
        raise FileNotFoundError(f"Index file {prefix}.idx does not exist; check the prefix.")
    dataset = IndexedDataset(prefix)
    ends = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    document_indices = np.asarray(dataset.document_indices, dtype=np.int64)
    return ends[document_indices[1:]] - ends[document_indices[:-1]]
