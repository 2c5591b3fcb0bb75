"""Megatron-LM's own example scripts, shrunk to a CPU-sized model, run with pretrain_gpt_memo.py.

The flag arrays follow Megatron-LM's ``examples/`` scripts (GPT-3 175B / 857M, Llama-3 8B on
H100 fp8 and on H200 bf16, Llama-3.2 1B, Mixtral 8x7B, DeepSeek-V2-Lite) flag for flag, with the
sizes shrunk (layers, widths, vocabulary, sequence, batch, steps, parallel sizes 1) and bf16 /
fp16 removed (CPU). Each command line is first given whole: it either trains or stops with one
message naming exactly the flags this trainer refuses; then, with only those flags dropped, it
trains.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.launch import run_job, run_pretrain

SIZES = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64"),
]


def gpt3(out: Path) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh (and its 857M sibling)."""
    return [
        *SIZES,
        *("--attention-backend", "auto"),
        *("--micro-batch-size", "1", "--global-batch-size", "4"),
        *("--rampup-batch-size", "2", "2", "8", "--train-iters", "4"),
        *("--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95"),
        *("--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5"),
        *("--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001"),
        *("--lr-decay-iters", "4"),
        *("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"),
        *("--mock-data", "--split", "949,50,1"),
        *("--log-interval", "1", "--save-interval", "10000", "--eval-interval", "2"),
        *("--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--eval-iters", "1"),
        *("--tensorboard-dir", str(out / "tb")),
    ]


def llama3(out: Path, *, fp8: bool) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh (fp8) and train_llama3_8b_h200_bf16.sh."""
    argv = [
        "--use-mcore-models",
        *SIZES,
        *("--ffn-hidden-size", "224", "--group-query-attention", "--num-query-groups", "2"),
        *("--kv-channels", "16", "--position-embedding-type", "rope"),
        *("--rotary-base", "1000000", "--rotary-percent", "1.0"),
        *("--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu"),
        *("--init-method-std", "0.0134", "--attention-backend", "fused"),
        *("--apply-layernorm-1p", "--untie-embeddings-and-output-weights"),
        "--disable-bias-linear",
        *("--micro-batch-size", "1", "--global-batch-size", "2"),
        *("--train-samples", "8", "--lr-decay-samples", "6", "--lr-warmup-samples", "2"),
        *("--lr", "0.00015", "--min-lr", "0.00001"),
        *("--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5"),
        *("--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1"),
        *("--adam-beta1", "0.9", "--adam-beta2", "0.95"),
        *("--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss"),
        *("--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235"),
    ]
    if fp8:
        argv += [
            *("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"),
            *("--fp8-amax-compute-algo", "max", "--fp8-param-gather"),
        ]
    argv += [
        *("--tensor-model-parallel-size", "1", "--context-parallel-size", "1"),
        *("--pipeline-model-parallel-size", "1", "--sequence-parallel"),
        *("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"),
        *("--data-cache-path", str(out / "cache"), "--tiktoken-pattern", "v2"),
        *("--split", "99,1,0", "--no-create-attention-mask-in-dataloader"),
        *("--no-mmap-bin-files", "--num-workers", "1"),
        *("--log-interval", "1", "--eval-iters", "1", "--eval-interval", "2"),
        *("--save-interval", "1000", "--log-throughput"),
        *("--profile", "--profile-step-start", "2", "--profile-step-end", "3"),
        *("--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60"),
        *("--save", str(out / "ckpt"), "--load", str(out / "ckpt")),
        *("--tensorboard-dir", str(out / "tb")),
    ]
    if not fp8:
        argv += ["--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard"]
    return argv


def _sentencepiece_model(path: Path) -> Path:
    """A small SentencePiece tokenizer.model trained here (the scripts' Llama2Tokenizer reads
    one; nothing is downloaded)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 20),
        model_writer=model,
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    path.write_bytes(model.getvalue())
    return path


def mixtral(out: Path) -> list[str]:
    """examples/mixtral/train_mixtral_8x7b_distributed.sh."""
    return [
        *("--use-mcore-models", "--disable-bias-linear"),
        *SIZES,
        *("--ffn-hidden-size", "224", "--init-method-std", "0.01"),
        *("--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
        *("--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu"),
        *("--untie-embeddings-and-output-weights", "--group-query-attention"),
        *("--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding"),
        *("--rotary-base", "1000000"),
        *("--num-experts", "2", "--moe-router-topk", "2"),
        *("--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"),
        *("--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"),
        *("--overlap-param-gather", "--overlap-grad-reduce"),
        *("--tokenizer-type", "Llama2Tokenizer"),
        *("--tokenizer-model", str(_sentencepiece_model(out / "tok.model"))),
        *("--mock-data", "--split", "99990,8,2"),
        *("--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4"),
        *("--train-iters", "3", "--lr-decay-iters", "320000", "--lr-decay-style", "cosine"),
        *("--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "1"),
        *("--clip-grad", "1.0"),
        *("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"),
        *("--expert-model-parallel-size", "2", "--use-distributed-optimizer"),
        "--sequence-parallel",
        *("--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000"),
        *("--eval-iters", "10", "--save", str(out / "ckpt"), "--load", str(out / "ckpt")),
        *("--tensorboard-dir", str(out / "tb"), "--no-load-optim", "--no-load-rng"),
    ]


SCRIPTS = {
    # Megatron-LM itself asserts here: a ramp-up needs --train-samples (as in its 857M script,
    # the 175B one's --train-iters would not start there either)
    "gpt3": (gpt3, {"--rampup-batch-size"}),
    "llama3_8b_h100_fp8": (
        lambda out: llama3(out, fp8=True),
        {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"},
    ),
    "llama3_8b_h200_bf16": (lambda out: llama3(out, fp8=False), set()),
    "mixtral_8x7b": (
        mixtral,
        {
            # --moe-router-topk 2 and --moe-router-load-balancing-type aux_loss are Megatron-LM's
            # defaults: they ask for nothing
            "--num-experts",
            "--moe-aux-loss-coeff",
            "--moe-grouped-gemm",
            "--moe-token-dispatcher-type",
            "--expert-model-parallel-size",
        },
    ),
}
"""Script → (its shrunk flags, the flags refused here)."""


def _refused(stderr: str, argv: list[str]) -> set[str]:
    """The flags the error names: the lines of the Megatron-LM refusal message, or else the
    first flag of the command line that the one-sentence error names."""
    if "cannot run here" in stderr:
        lines = stderr.split("cannot run here")[1].splitlines()[1:]
        return {line.split(":")[0].split()[0] for line in lines if line.startswith("  --")}
    (sentence,) = [line for line in stderr.splitlines() if "error:" in line]
    named = [token.rstrip(",:;") for token in sentence.split() if token.startswith("--")]
    return {next(flag for flag in named if flag in argv)}


def _drop(argv: list[str], refused: set[str]) -> list[str]:
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in refused
        if not skipping:
            out.append(token)
    return out


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_megatron_example_trains_after_dropping_only_refused_flags(script, tmp_path):
    build, expected = SCRIPTS[script]
    argv = build(tmp_path)
    if expected:
        job = run_job(argv)
        assert job.status == 2, job.describe()
        assert "Traceback" not in job.stderr and "usage:" not in job.stderr
        assert _refused(job.stderr, argv) == expected, job.stderr[-3000:]
        argv = _drop(argv, expected)
    records = run_pretrain(argv, nproc=1, workdir=tmp_path, name=script)
    assert records, "no step was logged"
    assert all(r["loss"] > 0 for r in records)
