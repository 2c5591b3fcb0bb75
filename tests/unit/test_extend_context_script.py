"""``scripts/extend_context.sh``'s refusals: one sentence, before any work (no demo corpus, no
import, no output folder), for a model it does not extend and for retrieval lengths too short
for the prompt. Only a ``config.json`` is written: a refusal that needed the weights would come
too late. The run itself: ``tests/dist/test_extend_context_script.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.launch import ROOT

pytestmark = pytest.mark.launch

LLAMA = {"model_type": "llama", "max_position_embeddings": 64, "vocab_size": 257}
"""A byte-vocabulary Llama with a 64-token context, as the end-to-end test's."""
NEEDLE_PROMPT_TOKENS = 40 + 20 + 1 + 46 + 2 * 6 - 1
"""The byte tokenizer's shortest needle prompt, counted by hand: the intro (40 bytes), " The
magic number is" (20) and "." around the number, the question (46), the answer " 12345" (6)
stated and asked, less the one id the model does not read (the passkey prompt is shorter)."""


def _extend(tmp, config: dict, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """The script on a folder holding only ``config``: its completed process and seconds."""
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text(json.dumps(config))
    base = {k: v for k, v in os.environ.items() if k not in ("RETRIEVAL_LENGTHS", "SEQ_LENGTH")}
    base.update(
        PYTHON=sys.executable,
        HF_DIR=str(tmp / "hf"),
        OUT=str(tmp / "out"),
        DATA_DIR=str(tmp / "data"),
        **env,
    )
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "scripts/extend_context.sh"], cwd=ROOT, env=base, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    return done, time.monotonic() - start


def _refusal(tmp, done: subprocess.CompletedProcess) -> str:
    """The one sentence of a refusal, after checking that nothing was run or written."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert not (tmp / "out").exists() and not (tmp / "data").exists()
    (line,) = done.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize(
    "changes, what",
    [
        # Qwen2: query / key / value biases, exported as no Llama
        ({"model_type": "qwen2"}, "HF_DIR's model_type is qwen2"),
        ({"model_type": "gpt2"}, "HF_DIR's model_type is gpt2"),
        ({"attention_bias": True}, "HF_DIR's model has attention or MLP biases"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "HF_DIR's model has RoPE scaling of type yarn",
        ),
    ],
)
def test_a_model_it_does_not_extend_is_refused_saying_what_it_extends(tmp_path, changes, what):
    done, _ = _extend(tmp_path, {**LLAMA, **changes})
    line = _refusal(tmp_path, done)
    assert line.startswith(f"extend_context: error: {what}; this script extends Llama models")
    assert "without biases, with plain RoPE or Llama 3.1's scaling" in line


def test_a_retrieval_length_too_short_for_the_prompt_is_refused_before_any_work(tmp_path):
    """The original context given as a retrieval length: refused with the shortest length that
    fits, in the time it takes to build the tokenizer (the refusal used to come from the first
    evaluation, 85 s in, after the import)."""
    done, seconds = _extend(tmp_path, LLAMA, RETRIEVAL_LENGTHS="64,256")
    assert _refusal(tmp_path, done) == (
        "extend_context: error: RETRIEVAL_LENGTHS 64 is too short for the retrieval prompt, "
        f"which takes at least {NEEDLE_PROMPT_TOKENS} tokens with this tokenizer; give lengths "
        f"of {NEEDLE_PROMPT_TOKENS} or more"
    )
    # a Python start and megatron-core's import (about 6 s; more on a loaded machine)
    assert seconds < 60


def test_an_extended_context_too_short_for_the_prompt_is_refused(tmp_path):
    done, _ = _extend(tmp_path, LLAMA, FACTOR="1")
    assert _refusal(tmp_path, done).startswith(
        f"extend_context: error: SEQ_LENGTH 64 is too short for the retrieval prompt, which "
        f"takes at least {NEEDLE_PROMPT_TOKENS} tokens"
    )
