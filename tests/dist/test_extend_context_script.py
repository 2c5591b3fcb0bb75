"""``scripts/extend_context.sh`` end to end, CPU-sized: a tiny random Llama (context 64, the
byte tokenizer's 257 ids) is imported, trained 2 steps at 4 × its context (256 tokens) with
Llama 3.1 RoPE scaling and MEMO under ``python -m memo_ext.launch``, its loss by position drawn,
and exported; the export must load in ``transformers`` and give our trained model's logits."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from memo_ext.hf.checkpoint import FLAGS_FILE, load_model  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402
from tests.launch import ROOT, free_port  # noqa: E402

pytestmark = [pytest.mark.launch, pytest.mark.slow]

VOCAB = 257  # ByteTokenizer: 256 bytes + end of document, the demo corpus's ids
ORIGINAL_TOKENS = 64
FACTOR = 4
# fp32 on both sides; fused QKV / fc1 GEMMs and SDPA vs eager softmax sum in another order:
# measured up to 1.04e-5 (a few fp32 ulps of the largest logits), depending on the weights
ATOL = 2e-5


def _extend(tmp, *, train_iters: int = 2, retrieval_lengths: str | None = "128,256", **model):
    """The script on a tiny random Llama made in ``tmp`` (``model``: its config's changes): its
    completed process and the source model. ``retrieval_lengths`` None: the script's default."""
    source = make_hf_model(
        "llama2", tmp / "hf", vocab_size=VOCAB, max_position_embeddings=ORIGINAL_TOKENS, **model
    )
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RETRIEVAL_LENGTHS", "SEQ_LENGTH")},
        "PYTHON": os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python")),
        "HF_DIR": str(tmp / "hf"),
        "OUT": str(tmp / "out"),
        "DATA_DIR": str(tmp / "data"),
        "FACTOR": str(FACTOR),
        "NPROC": "1",
        "TRAIN_ITERS": str(train_iters),
        "EVAL_INTERVAL": str(train_iters),
        "EVAL_ITERS": "1",
        "RETRIEVAL_SAMPLES": "1",
        "MASTER_PORT": str(free_port()),
    }
    if retrieval_lengths is not None:
        env["RETRIEVAL_LENGTHS"] = retrieval_lengths
    if not os.path.exists(env["PYTHON"]):
        env["PYTHON"] = "python3"
    done = subprocess.run(
        ["bash", "scripts/extend_context.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    return done, source


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script's OUT folder and the source HF model, after a 2-step run."""
    tmp = tmp_path_factory.mktemp("extend_context")
    done, source = _extend(tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "context 64 → 256 tokens" in done.stdout
    return tmp / "out", source


def test_loss_by_position_reaches_past_the_original_context(run):
    out, _ = run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [r for r in records if "val_loss_by_position" in r]
    assert evaluated["iteration"] == 2
    # buckets double from 64 up to the 256-token sequence: two of three lie past position 63
    assert list(evaluated["val_loss_by_position"]) == ["0-63", "64-127", "128-255"]
    png = out / "position_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_retrieval_is_scored_before_and_after_and_drawn_side_by_side(run):
    out, _ = run
    before = json.loads((out / "retrieval_before" / "retrieval.json").read_text())
    after = json.loads((out / "retrieval_after" / "retrieval.json").read_text())
    for grid, iteration in ((before, 0), (after, 2)):
        assert grid["iteration"] == iteration
        assert grid["lengths"] == [128, 256] and set(grid["tasks"]) == {"passkey", "needle"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [r for r in records if "val_passkey_acc" in r]
    assert set(evaluated["val_passkey_acc_by_cell"]) == {
        f"{n}@{d}" for n in (128, 256) for d in ("0", "0.25", "0.5", "0.75", "1")
    }
    assert (out / "retrieval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_carries_the_scaling_and_gives_our_logits(run, megatron_cpu):
    out, source = run
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["factor"] == FACTOR
    assert config["max_position_embeddings"] == FACTOR * ORIGINAL_TOKENS

    shape = (2, FACTOR * ORIGINAL_TOKENS)
    tokens = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(3))
    ours = _our_logits(out / "ckpt", tokens)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert ours.abs().max() > 1  # logits of order one: the tolerance is meaningful
    torch.testing.assert_close(_hf_logits(exported, tokens), ours, rtol=0, atol=ATOL)

    # the check can fail: the trained weights are not the source's, and the same weights
    # without the scaling (head dim 8, base 10⁴: one wavelength, 6283, lies in the blended
    # band) rotate long positions otherwise
    assert not torch.allclose(_hf_logits(source, tokens), ours, rtol=0, atol=1e-3)
    unscaled = {k: v for k, v in config.items() if k != "rope_scaling"}
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**unscaled)).eval()
    plain.load_state_dict(exported.state_dict())
    assert not torch.allclose(_hf_logits(plain, tokens), ours, rtol=0, atol=1e-3)


def _our_logits(ckpt, tokens: torch.Tensor) -> torch.Tensor:
    flags = (ckpt / FLAGS_FILE).read_text().split()
    _, model = load_model(ckpt, flags=flags, vocab_size=VOCAB)
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)  # [b, s, padded vocab]
    return logits[..., :VOCAB]


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def test_a_two_layer_model_extends_with_its_defaults(tmp_path):
    """MEMO keeps one fewer layer than the model has: a two-layer model still offloads one. The
    byte tokenizer writes a retrieval prompt in 118 tokens (tests/unit/test_retrieval.py counts
    them): the original 64-token context holds none, so retrieval is scored at 256 alone."""
    done, _ = _extend(tmp_path, train_iters=1, retrieval_lengths=None, num_hidden_layers=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "extend_context: retrieval at 256 tokens only: a prompt takes at least 118 tokens with "
        "this tokenizer, more than the original context (64)"
    ) in done.stdout
    for grid in ("retrieval_before", "retrieval_after"):
        result = json.loads((tmp_path / "out" / grid / "retrieval.json").read_text())
        assert result["lengths"] == [256]
