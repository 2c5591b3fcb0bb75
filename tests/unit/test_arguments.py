"""Flag parsing: Megatron names map onto TransformerConfig, bad input fails in one sentence."""

from __future__ import annotations

import pytest

from memo_ext.arguments import parse_args
from memo_ext.errors import UsageError
from memo_ext.features.megatron import run_transformer_config
from tests.launch import SMALL_GPT, cli

BASE = SMALL_GPT


HOT = ["--hotspa", "--variable-seq-lengths", "--micro-batch-size", "1"]


def parse(*extra: str, world_size: int = 1):
    return parse_args([*BASE, *extra], world_size=world_size)


def test_megatron_flags_reach_transformer_config():
    run = parse(
        *cli(
            group_query_attention=True,
            num_query_groups=2,
            ffn_hidden_size=100,
            swiglu=True,
            normalization="RMSNorm",
            disable_bias_linear=True,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            context_parallel_size=2,
            global_batch_size=8,
        ),
        world_size=8,
    )
    t = run_transformer_config(run)
    assert (t.num_layers, t.hidden_size, t.ffn_hidden_size) == (4, 64, 100)
    assert (t.num_attention_heads, t.num_query_groups) == (8, 2)
    assert t.gated_linear_unit and not t.add_bias_linear and t.normalization == "RMSNorm"
    assert (t.tensor_model_parallel_size, t.context_parallel_size) == (2, 2)
    assert t.sequence_parallel and t.calculate_per_token_loss
    assert run.layout.dp == 2 and run.num_microbatches == 2


def test_defaults_follow_megatron():
    run = parse(world_size=2)
    assert run_transformer_config(run).ffn_hidden_size == 4 * 64
    assert run_transformer_config(run).num_query_groups == 8
    assert run.model.max_position_embeddings == 128
    assert run.train.lr_decay_style == "linear"  # one default, Megatron-LM's
    assert run.train.global_batch_size == 2 * 2  # mbs × DP
    assert run.num_microbatches == 1


def test_sequence_parallel_is_dropped_without_tp():
    assert not run_transformer_config(parse("--sequence-parallel")).sequence_parallel


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        (["--tensor-model-parallel-size", "3"], 4, "world size 4 is not divisible"),
        (
            ["--tensor-model-parallel-size", "2", "--group-query-attention"],
            2,
            "query groups (1)",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            1,
            "not divisible by --num-query-groups 3",
        ),
        (
            ["--context-parallel-size", "3", "--seq-length", "124"],
            3,
            "sequence length (124) not divisible by 2 × CP (6)",
        ),
        (["--pipeline-model-parallel-size", "3"], 3, "layers (4) not divisible by PP (3)"),
        (["--global-batch-size", "5"], 2, "not divisible by --micro-batch-size × DP"),
        (["--bf16", "--fp16"], 1, "exclusive"),
        (["--recompute-granularity", "full"], 1, "needs --recompute-method"),
        (["--recompute-method", "block"], 1, "need --recompute-granularity full"),
        (["--hidden-dropout", "1.5"], 1, "--hidden-dropout must be in [0, 1)"),
        (["--lr-warmup-iters", "11"], 1, "--lr-warmup-iters 11"),
        (["--max-position-embeddings", "64"], 1, "shorter than --seq-length 128"),
        (["--vocab-size", "300"], 1, "ByteTokenizer has 257 tokens"),
        (["--tokenizer-type", "NullTokenizer"], 1, "needs --vocab-size"),
        (["--variable-seq-lengths"], 1, "does not support --micro-batch-size > 1"),
        (["--hotspa"], 1, "add --variable-seq-lengths"),
        (["--hotspa-buckets", "64,128"], 1, "need --hotspa"),
        (HOT + ["--tensor-model-parallel-size", "2"], 2, "drop --tensor-model-parallel-size"),
        (HOT + ["--hotspa-buckets", "64,100"], 2, "must equal --seq-length (128)"),
        (HOT + ["--hotspa-buckets", "64,32,128"], 2, "strictly ascending"),
        (HOT + ["--hidden-dropout", "0.1"], 2, "share the home layout's dropout random streams"),
        (HOT + ["--attention-dropout", "0.1"], 2, "draw the same masks"),
        (
            HOT + ["--hotspa-buckets", "64,128", "--hotspa-strategies", "dp2"],
            2,
            "gives 1 layouts for 2 buckets",
        ),
        (HOT + ["--hotspa-strategies", "dp4"], 2, "uses 4 processes but the job has 2"),
        (HOT + ["--hotspa-strategies", "tp3"], 3, "attention heads (8) not divisible by TP (3)"),
        (HOT + ["--hotspa-strategies", "dp2x"], 2, "not a product of dp<N>"),
        (
            HOT
            + cli(
                hotspa_buckets="64,128", hotspa_strategies="dp4;cp2tp2", hotspa_mode="dynamic-cp"
            ),
            4,
            "other TP / PP than home",
        ),
        (
            cli(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                seq_length=127,
                max_position_embeddings=128,
            ),
            2,
            "tokens per CP rank (127) not divisible by TP (sequence parallel) (2)",
        ),
    ],
)
def test_invalid_combinations_fail_with_one_sentence(extra, world_size, message):
    with pytest.raises(UsageError) as err:
        parse(*extra, world_size=world_size)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_hotspa_flags_reach_the_run_config():
    run = parse(
        *HOT,
        "--hotspa-buckets",
        "32,64,128",
        "--hotspa-strategies",
        "dp4;dp2tp2;cp2tp2",
        world_size=4,
    )
    hot = run.hotspa
    assert hot.enabled and hot.buckets == (32, 64, 128) and hot.mode == "switch"
    assert [layout.name for layout in hot.strategies] == ["dp4", "dp2tp2", "dp1tp2cp2"]
    assert hot.home.tp == 2 and hot.home.cp == 2
    assert parse(*HOT, world_size=2).hotspa.strategies is None  # auto: chosen at start


def test_data_source_is_required_and_exclusive(tmp_path):
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(UsageError, match="exactly one of --data-path"):
        parse_args(argv, world_size=1)
    with pytest.raises(UsageError, match="exactly one of --data-path"):
        parse_args([*BASE, "--data-path", str(tmp_path / "x")], world_size=1)


def test_missing_dataset_file_is_named(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    prefix.with_suffix(".bin").write_bytes(b"")
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(UsageError, match=r"corpus_text_document\.idx does not exist"):
        parse_args([*argv, "--data-path", "0.5", str(prefix), "0.5", str(prefix)], world_size=1)


def test_the_gpu_configuration_parses_on_every_machine():
    run = parse(
        "--bf16",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "4096",
    )
    assert run.train.bf16 and run.train.use_distributed_optimizer
    assert run.distributed.overlap_param_gather and run.distributed.ddp_bucket_size == 4096
    with pytest.raises(UsageError, match="--ddp-bucket-size must be positive"):
        parse("--ddp-bucket-size", "0")
    with pytest.raises(UsageError, match="exclusive"):
        parse("--bf16", "--fp16")


def test_entry_point_exits_2_with_the_message(capsys):
    from pretrain_gpt_memo import main

    assert main([*BASE, "--group-query-attention", "--num-query-groups", "3"]) == 2
    assert "not divisible by --num-query-groups 3" in capsys.readouterr().err


def test_hotspa_accepts_fp16_and_refuses_dropout():
    # every layout's losses are scaled (tests/dist/test_hotspa_training.py checks the gradients);
    # --fp16 needs CUDA, which TrainConfig refuses first on this machine: check the rule alone
    import dataclasses

    run = parse(*HOT, world_size=2)
    fp16 = dataclasses.replace(run, train=dataclasses.replace(run.train, fp16=True))
    fp16.hotspa.check_with(**_hotspa_sections(fp16))
    dropout = dataclasses.replace(fp16, model=dataclasses.replace(run.model, hidden_dropout=0.1))
    with pytest.raises(UsageError, match="--hidden-dropout 0"):
        dropout.hotspa.check_with(**_hotspa_sections(dropout))


def _hotspa_sections(run) -> dict:
    """What ``HotSPaConfig.check_with`` reads of ``run``."""
    return dict(
        data=run.data,
        model=run.model,
        recompute=run.recompute,
        shape=run.shape,
        layout=run.layout,
        world_size=run.world_size,
    )
