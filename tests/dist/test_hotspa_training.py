"""--hotspa through the trainer: every bucket / layout mix trains exactly like one process.

The corpus has long-tailed document lengths (a Pareto draw), preprocessed as users do it
(``tools/preprocess_data.py --tokenizer-type ByteTokenizer --append-eod``). The reference is one
process with ``--variable-seq-lengths`` and no HotSPa: the loss is the mean over every real token
of the global batch, so regrouping the documents into buckets, rows and layouts cannot change
it, and the gradient norm checks the gradients that the switches carry back to home.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from memo_ext.commands import preprocess_data
from tests.launch import assert_same_curves, cli, reference_run, run_pretrain

pytestmark = pytest.mark.dist

MODEL = cli(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    swiglu=True,
    ffn_hidden_size=128,  # 4h: the byte counts below are counted by hand for it
    normalization="RMSNorm",
    position_embedding_type="rope",
    micro_batch_size=1,
    lr="2e-3",
    tokenizer_type="ByteTokenizer",
    variable_seq_lengths=True,
    seed=3,
)
BUCKETS = ["--hotspa", "--hotspa-buckets", "32,64,128"]
PROBE = "tests.dist.hotspa_probe"
"""The trainer with test probes: a constant loss scale, storage checks (see the module)."""


def preprocess(tmp_path, texts: list[str], name: str) -> str:
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = tmp_path / name
    argv = cli(
        input=str(corpus),
        output_prefix=str(prefix),
        tokenizer_type="ByteTokenizer",
        append_eod=True,
        no_progress=True,
    )
    assert preprocess_data.main(argv) == 0  # the tool's command line, in this process
    return f"{prefix}_text_document"


def pareto_texts(n: int, *, seed: int) -> list[str]:
    """Documents whose lengths follow a Pareto tail: mostly short, a few up to 300 bytes."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(300, (6 * (1 + rng.pareto(1.2, size=n))).astype(int))
    letters = np.array(list("abcdefgh ij"))
    return ["".join(rng.choice(letters, size=k)) for k in lengths]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return preprocess(tmp_path_factory.mktemp("hotspa"), pareto_texts(96, seed=0), "pareto")


def train_args(data: str, *, iters: int = 3, gbs: int = 8) -> list[str]:
    return MODEL + cli(
        data_path=data, seq_length=128, global_batch_size=str(gbs), train_iters=str(iters)
    )


@pytest.fixture(scope="module")
def reference(corpus, reference_runs):
    return reference_run(train_args(corpus), nproc=1, cache_dir=reference_runs)


def test_auto_strategies_on_four_processes_match_one_process(corpus, reference, tmp_path):
    curves = run_pretrain(
        train_args(corpus) + BUCKETS + ["--hotspa-strategies", "auto"],
        nproc=4,
        workdir=tmp_path,
        name="auto",
    )
    assert_same_curves(reference, curves, rtol=1e-4)
    # auto runs either the three buckets or, when switching is predicted not to pay, one
    # bucket at --seq-length in one layout; never predicted slower than that one layout
    plan = {r["hotspa_plan"] for r in curves}
    buckets = 3 if plan == {"switch"} else 1
    assert plan in ({"switch"}, {"single-layout"})
    rows = [r["hotspa_bucket_rows"] for r in curves]
    assert all(len(r) == buckets for r in rows) and sum(map(sum, rows)) > 0
    assert all(r["hotspa_predicted_gain"] >= 1.0 for r in curves)


@pytest.mark.parametrize(
    "strategies, nproc",
    [
        ("dp4;dp2tp2;tp2pp2", 4),  # DP -> TP -> TP × PP home: weights and gradients switched
        ("dp4;dp2cp2;cp2tp2", 4),  # CP enters, with TP at home
        ("cp2tp2;dp4;dp2pp2", 4),  # the short bucket in the most model-parallel layout
        ("dp2;tp2;pp2", 2),
    ],
)
def test_switching_layouts_match_one_process(corpus, reference, tmp_path, strategies, nproc):
    curves = run_pretrain(
        train_args(corpus) + BUCKETS + ["--hotspa-strategies", strategies],
        nproc=nproc,
        workdir=tmp_path,
        name="mix",
        module=PROBE,  # which also fails the run if a working copy outlives its step
    )
    assert_same_curves(reference, curves, rtol=1e-4)
    moved = sum(r["hotspa_weight_switch_bytes"] + r["hotspa_grad_switch_bytes"] for r in curves)
    assert moved > 0, "these layouts differ in TP or PP: something must move"


def test_packed_documents_and_switching_in_bf16_match_one_process(corpus, reference_runs, tmp_path):
    # the GPU runs' precision; the distributed optimizer's bucketed reduction on the packed rows
    # (HotSPa reduces each layout's gradients itself, with a plain all-reduce). bf16 rounds
    # partial sums in another order under TP / PP: 2**-9 per element, well under 1e-3 here
    bf16 = train_args(corpus) + ["--bf16"]
    reference = reference_run(bf16, nproc=1, cache_dir=reference_runs)
    gpu = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "5000"]
    packed = run_pretrain(bf16 + gpu, nproc=2, workdir=tmp_path, name="packed")
    assert_same_curves(reference, packed, rtol=1e-3)
    hotspa = BUCKETS + ["--hotspa-strategies", "dp2;tp2;pp2"]
    curves = run_pretrain(bf16 + hotspa, nproc=2, workdir=tmp_path, name="switch")
    assert_same_curves(reference, curves, rtol=1e-3)


def test_dynamic_cp_moves_nothing(corpus, reference, tmp_path):
    curves = run_pretrain(
        train_args(corpus)
        + BUCKETS
        + ["--hotspa-mode", "dynamic-cp", "--hotspa-strategies", "dp4;dp2cp2;cp4"],
        nproc=4,
        workdir=tmp_path,
        name="dyncp",
    )
    assert_same_curves(reference, curves, rtol=1e-4)
    for record in curves:
        assert record["hotspa_weight_switch_bytes"] == record["hotspa_grad_switch_bytes"] == 0
        assert record["hotspa_switch_bytes_reused"] == 0


def sharded_elements(*, hidden: int, heads: int, groups: int, ffn: int, layers: int, vocab: int):
    """Elements of the tensor-parallel parameters of the MODEL above (swiglu, biases, GQA)."""
    head_dim = hidden // heads
    qkv = (heads + 2 * groups) * head_dim
    per_layer = (
        qkv * hidden
        + qkv  # linear_qkv weight and bias (column-parallel)
        + hidden * hidden  # linear_proj weight (row-parallel; its bias is replicated)
        + 2 * ffn * hidden
        + 2 * ffn  # linear_fc1 weight and bias, gate and up halves
        + hidden * ffn  # linear_fc2 weight (row-parallel; its bias is replicated)
    )
    return layers * per_layer + vocab * hidden  # + the tied vocab-parallel embedding


def test_switch_moves_the_hand_counted_bytes(corpus, tmp_path):
    """Home DP2, short bucket TP2. Weights home -> TP2: each rank keeps its half, nothing moves.
    Gradients TP2 -> home: each rank holds its complete half and receives the other one, so
    the job moves every TP-sharded element once (fp32); replicated ones are reused in place."""
    curves = run_pretrain(
        train_args(corpus)
        + ["--hotspa", "--hotspa-buckets", "64,128", "--hotspa-strategies", "tp2;dp2"],
        nproc=2,
        workdir=tmp_path,
        name="bytes",
    )
    vocab = 384  # 257 byte tokens padded to a multiple of lcm(128, TP 2)
    expected = 4 * sharded_elements(hidden=32, heads=4, groups=2, ffn=128, layers=2, vocab=vocab)
    switched = [r for r in curves if r["hotspa_bucket_rows"][0] > 0]
    assert switched, "no step had a document in the short bucket"
    for record in switched:
        assert record["hotspa_weight_switch_bytes"] == 0
        assert record["hotspa_grad_switch_bytes"] == expected


def test_loss_scale_reaches_every_layout(corpus, tmp_path):
    """--fp16's loss scale, stood in for by a constant 1024 in fp32 (fp16 needs CUDA): each
    layout's schedule must scale its own losses, else the gradients of the buckets outside home
    come back 1024 times too small. One step (its 12 documents fill all three buckets),
    compared before any update."""
    args = train_args(corpus, iters=1, gbs=12)
    plain = run_pretrain(args, nproc=1, workdir=tmp_path, name="plain")
    args = ["--probe-loss-scale", "1024", *args]
    scaled = run_pretrain(args, nproc=1, workdir=tmp_path, name="one", module=PROBE)
    # the scale took effect: the fp32 optimizer does not unscale the gradients it clips
    assert scaled[0]["grad_norm"] == pytest.approx(1024 * plain[0]["grad_norm"], rel=1e-6)
    curves = run_pretrain(
        args + BUCKETS + ["--hotspa-strategies", "dp2;tp2;pp2"],
        nproc=2,
        workdir=tmp_path,
        name="hot",
        module=PROBE,
    )
    assert all(curves[0]["hotspa_bucket_rows"]), "every layout must run a bucket"
    assert_same_curves(scaled, curves, rtol=1e-4)


def test_working_copies_live_only_while_their_buckets_run(corpus, tmp_path):
    """Home PP2; DP2 (the whole model on each process) and TP2 (half of every sharded tensor)
    have models of their own. After every step they hold no storage (the probe fails the run
    otherwise), and the step's peak on rank 0 is the largest copy among the layouts that ran:
    fp32 weights and an fp32 gradient buffer, 8 bytes per element, one copy at a time."""
    curves = run_pretrain(
        train_args(corpus) + BUCKETS + ["--hotspa-strategies", "dp2;tp2;pp2"],
        nproc=2,
        workdir=tmp_path,
        name="copies",
        module=PROBE,
    )
    sharded = sharded_elements(hidden=32, heads=4, groups=2, ffn=128, layers=2, vocab=384)
    replicated = 2 * 4 * 32 + 32  # per layer: two norms, linear_proj / fc2 biases; final norm
    copy_bytes = [8 * (sharded + replicated), 8 * (sharded // 2 + replicated)]  # DP2, TP2
    for record in curves:
        assert record["probe_nonhome_held_bytes"] == 0
        ran = [copy_bytes[b] for b in (0, 1) if record["hotspa_bucket_rows"][b]]
        assert record["hotspa_working_copy_bytes"] == max(ran, default=0)
    both = [r for r in curves if all(r["hotspa_bucket_rows"][:2])]
    assert both, "no step ran both non-home layouts: the peak would not show one at a time"


def test_single_document_bucket_and_empty_bucket(tmp_path):
    """Four documents, every step all of them: the long bucket holds exactly one document and
    the middle bucket none, on every step."""
    # with the end-of-document token: 10, 15, 21 and 127 tokens; the long one leaves no room
    texts = ["x" * 9, "yy" * 7, "z" * 20, "w" * 126]
    data = preprocess(tmp_path, texts, "four")
    args = train_args(data, iters=3, gbs=4)
    reference = run_pretrain(args, nproc=1, workdir=tmp_path, name="ref")
    curves = run_pretrain(
        args + BUCKETS + ["--hotspa-strategies", "dp4;tp2pp2;cp2tp2"],
        nproc=4,
        workdir=tmp_path,
        name="hot",
    )
    assert_same_curves(reference, curves, rtol=1e-4)
    for record in curves:
        assert record["hotspa_bucket_documents"] == [3, 0, 1]
        assert record["hotspa_bucket_rows"] == [2, 0, 1]


def test_resume_from_a_checkpoint_continues_exactly(corpus, tmp_path):
    """The home model and optimizer are the checkpoint; bucket layouts are rebuilt on load."""
    args = train_args(corpus, iters=4) + BUCKETS + ["--hotspa-strategies", "dp2;tp2;pp2"]
    whole = run_pretrain(args, nproc=2, workdir=tmp_path, name="whole")
    save = tmp_path / "ckpt"
    save.mkdir()
    run_pretrain(
        args + ["--save", str(save), "--exit-interval", "2"],
        nproc=2,
        workdir=tmp_path,
        name="first",
    )
    tail = run_pretrain(args + ["--load", str(save)], nproc=2, workdir=tmp_path, name="tail")
    assert [r["iteration"] for r in tail] == [3, 4]
    assert_same_curves(whole[2:], tail, rtol=1e-6)


def test_a_layouts_own_recomputation_matches_one_process(corpus, reference, tmp_path):
    """Full recomputation at home (PP 2) and for one DP 2 bucket, none for the other: the same
    layout with two recomputations is two models, each switched in and out, and recomputation
    changes no number."""
    full = cli(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    curves = run_pretrain(
        train_args(corpus) + full + BUCKETS + ["--hotspa-strategies", "dp2:none;dp2;pp2"],
        nproc=2,
        workdir=tmp_path,
        name="recompute",
        module=PROBE,
    )
    assert_same_curves(reference, curves, rtol=1e-4)
    assert sum(r["hotspa_weight_switch_bytes"] for r in curves) > 0
    assert curves[-1]["probe_recompute"] == {"dp1pp2": "full", "dp2:none": None, "dp2": "full"}
