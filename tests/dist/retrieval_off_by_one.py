"""The trainer with a broken retrieval decoder: each prompt's answer labels rotated by one
token, so the model's prediction of answer token k is compared with answer token k + 1 (the
last with the first). ``main(argv)`` patches, trains, and undoes the patch."""

from __future__ import annotations

import numpy as np

from memo_ext.commands import pretrain_gpt_memo
from memo_ext.data.retrieval import RetrievalSample


def main(argv: list[str] | None = None) -> int:
    batch = RetrievalSample.batch

    def off_by_one(self: RetrievalSample) -> dict[str, np.ndarray]:
        rows = batch(self)
        answer = rows["labels"][0, -self.answer_length :].copy()
        rows["labels"][0, -self.answer_length :] = np.roll(answer, -1)
        return rows

    RetrievalSample.batch = off_by_one
    try:
        return pretrain_gpt_memo.main(argv)
    finally:
        RetrievalSample.batch = batch
