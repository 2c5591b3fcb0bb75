"""Every Megatron-LM flag is known: ours, accepted, mapped, or refused by name in one message."""

from __future__ import annotations

import json

import pytest

from memo_ext.arguments import build_parser, parse_args
from memo_ext.config import TOKENIZER_TYPES
from memo_ext.errors import UsageError
from memo_ext.megatron_lm.flag_table import DATA_FILE, megatron_flags, megatron_source
from memo_ext.megatron_lm.handling import HANDLING, LATER_FLAGS, handling_of
from memo_ext.megatron_lm.translate import split_flags, translate
from tests.launch import SMALL_GPT
from tools.megatron_flags import DOCS, extract_flags, render_table

OURS = build_parser()._option_string_actions
EVERY_FLAG = sorted({f.name: f for f in megatron_flags().values()} | LATER_FLAGS)
EVERY_SPELLING = sorted(set(megatron_flags()) | set(LATER_FLAGS))


def test_the_list_is_megatron_lms_at_a_named_commit():
    source = megatron_source()
    assert source["repository"] == "NVIDIA/Megatron-LM"
    assert len(source["commit"]) == 40
    # flags every GPT launch script uses, and the spellings argparse aliases
    for name in ("--num-layers", "--use-mcore-models", "--override-opt-param-scheduler"):
        assert name in megatron_flags()
    assert len(EVERY_FLAG) > 500


def test_every_flag_is_handled():
    """One test over the whole list, every unhandled flag reported together."""
    unhandled = [
        name
        for name in EVERY_FLAG
        if name not in OURS and handling_of(megatron_flags().get(name) or LATER_FLAGS[name]) is None
    ]
    assert not unhandled, f"{len(unhandled)} Megatron-LM flags not handled: {unhandled}"


def test_the_table_names_only_megatron_flags_that_are_not_ours():
    stale = [n for n in HANDLING if n not in megatron_flags() and n not in LATER_FLAGS]
    assert not stale, f"not Megatron-LM flags: {stale}"
    shadowed = [n for n in HANDLING if n in OURS]
    assert not shadowed, f"implemented here, so the table entry is never used: {shadowed}"


def test_docs_table_is_generated_from_the_data():
    assert DOCS.read_text() == render_table(), "run: python -m tools.megatron_flags docs --update"


def test_extraction_reads_every_shape_of_add_argument():
    source = """
def _add_network_size_args(parser):
    group = parser.add_argument_group(title='network size')
    group.add_argument('--num-layers', type=int, default=None, help='x')
    group.add_argument('--swiglu', action='store_true')
    group.add_argument('--a', '--a-alias', nargs='+', type=int, default=[1, 2])
    group.add_argument('--backend', type=str, choices=list(Backend), default=Backend.auto)
    return parser
"""
    flags = {tuple(f["names"]): f for f in extract_flags(source)}
    assert flags[("--num-layers",)] == {
        "names": ["--num-layers"],
        "group": "network_size",
        "type": "int",
        "default": None,
    }
    assert flags[("--swiglu",)]["action"] == "store_true"
    assert flags[("--a", "--a-alias")]["nargs"] == "+"
    assert flags[("--a", "--a-alias")]["default"] == [1, 2]
    assert flags[("--backend",)]["choices"] == {"expression": "list(Backend)"}


def test_data_file_is_one_flag_per_line():
    lines = DATA_FILE.read_text().splitlines()
    data = json.loads(DATA_FILE.read_text())
    assert len(lines) == len(data["flags"]) + 5


def test_split_flags_keeps_values_with_their_flag():
    leading, groups = split_flags(["x", "--a", "1", "-2", "--b=3", "--c", "-h"])
    assert leading == ["x"]
    assert groups == [("--a", ["1", "-2"]), ("--b", ["3"]), ("--c", []), ("-h", [])]


def _sample_values(flag) -> list[str]:
    """A value Megatron-LM would accept for the flag."""
    if flag.is_switch:
        return []
    if isinstance(flag.choices, tuple):
        return [str(flag.choices[0])]
    if flag.type == "int":
        return ["2"]
    if flag.type == "float":
        return ["0.5"]
    return ["x"]


def _alone(name: str) -> str | None:
    """Why ``name`` with a sample value, added to a small GPT's flags, is mishandled, or None:
    it must parse, or be refused by a UsageError that names it (ours may be refused for their
    value); argparse's SystemExit or any other exception is a defect."""
    flag = megatron_flags().get(name) or LATER_FLAGS[name]
    try:
        parse_args([*SMALL_GPT, name, *_sample_values(flag)], world_size=1)
    except UsageError as err:
        if name not in OURS and flag.name not in OURS and name not in str(err):
            return f"{name}: not named in {err}"
    except (Exception, SystemExit) as err:  # noqa: BLE001 (every failure is reported)
        return f"{name}: {type(err).__name__}: {err}"
    return None


def test_every_flag_alone_is_accepted_or_refused_by_name(tmp_path, monkeypatch):
    """Every spelling in one test (in process), every failure reported together."""
    monkeypatch.chdir(tmp_path)  # output flags given "x" write nothing into the repository
    failures = [why for why in map(_alone, EVERY_SPELLING) if why is not None]
    assert len(EVERY_SPELLING) > 500
    assert not failures, f"{len(failures)} of {len(EVERY_SPELLING)} flags:\n" + "\n".join(failures)


def test_refused_flags_are_named_together_with_their_reasons():
    argv = [
        *SMALL_GPT,
        *("--num-experts", "8", "--moe-router-topk", "4"),
        *("--fp8-format", "hybrid", "--ckpt-format", "zarr"),
        *("--tokenizer-type", "BertWordPieceCase", "--tokenizer-model", "/x.model"),
    ]
    with pytest.raises(UsageError) as err:
        parse_args(argv, world_size=1)
    message = str(err.value)
    assert message.startswith("5 Megatron-LM flags cannot run here; drop them:")
    lines = message.splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "--num-experts",
        "--moe-router-topk",
        "--fp8-format",
        "--ckpt-format zarr",
        "--tokenizer-type BertWordPieceCase",
    ]
    assert "mixture-of-experts" in lines[0] and "torch_dist" in lines[3]


@pytest.mark.parametrize("tokenizer_type", ["BertWordPieceLowerCase", "SFTTokenizer"])
def test_a_refused_tokenizer_type_is_one_line_that_names_the_supported_ones(tokenizer_type):
    """--tokenizer-model is ours (several tokenizers read it): only the type is refused."""
    argv = [*SMALL_GPT, "--tokenizer-type", tokenizer_type, "--tokenizer-model", "/x/tok.model"]
    with pytest.raises(UsageError) as err:
        parse_args(argv, world_size=1)
    head, line = str(err.value).splitlines()
    assert head == "1 Megatron-LM flag cannot run here; drop it:"
    assert line.startswith(f"  --tokenizer-type {tokenizer_type}: ")
    assert ", ".join(TOKENIZER_TYPES) in line


def test_other_spellings_of_our_flags_are_ours(tmp_path):
    argv = [*SMALL_GPT, "--save", str(tmp_path), "--persistent-save-interval", "3"]
    run = parse_args(argv, world_size=1)
    assert run.checkpoint.save_interval == 3
    run = parse_args([*SMALL_GPT, "--override-opt-param-scheduler"], world_size=1)
    assert run.checkpoint.override_opt_param_scheduler


def test_megatron_default_values_ask_for_nothing():
    run = parse_args(
        [*SMALL_GPT, "--expert-model-parallel-size", "1", "--cp-comm-type", "p2p"], world_size=1
    )
    assert run.layout.world_size == 1


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        (["--recompute-activations"], lambda r: r.recompute.granularity == "selective"),
        (["--attention-backend", "local"], lambda r: r.model.attention_backend == "sdpa"),
        (["--use-rotary-position-embeddings"], lambda r: r.shape.position_embedding_type == "rope"),
        (["--no-position-embedding"], lambda r: r.shape.position_embedding_type == "rope"),
        (["--group-query-attention"], lambda r: r.shape.num_query_groups == 1),
        (
            ["--group-query-attention", "--num-query-groups", "2"],
            lambda r: r.shape.num_query_groups == 2,
        ),
    ],
)
def test_mapped_flags_reach_our_settings(extra, check):
    assert check(parse_args([*SMALL_GPT, *extra], world_size=1))


def test_query_groups_without_the_gqa_switch_are_refused():
    # Megatron-LM builds full multi-head attention from "--num-query-groups 2" alone
    # (arguments.py: num_query_groups reaches the config only with --group-query-attention);
    # reading it as GQA here would train another model from the same script
    with pytest.raises(UsageError) as err:
        parse_args([*SMALL_GPT, "--num-query-groups", "2"], world_size=1)
    message = str(err.value)
    assert message.startswith("--num-query-groups 2 needs --group-query-attention")
    assert "drop --num-query-groups for full multi-head attention" in message


def test_the_gqa_ambiguity_is_reported_with_the_refused_flags():
    with pytest.raises(UsageError) as err:
        parse_args([*SMALL_GPT, "--num-query-groups", "2", "--num-experts", "4"], world_size=1)
    first, *rest = str(err.value).splitlines()
    assert first.startswith("--num-query-groups 2 needs --group-query-attention")
    assert rest[0] == "1 Megatron-LM flag cannot run here; drop it:"
    assert rest[1].startswith("  --num-experts: ")


def test_transformer_engine_attention_falls_back_to_sdpa_without_it():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("the fallback is for machines without CUDA")
    translation = translate(["--attention-backend", "fused"], ours=OURS)
    assert translation.argv == ["--attention-backend", "sdpa"]
    assert "transformer-engine" in translation.notices[0]


def test_no_effect_and_mapped_flags_are_logged(caplog):
    caplog.set_level("INFO")
    parse_args([*SMALL_GPT, "--log-timers-to-tensorboard", "--recompute-activations"], world_size=1)
    text = caplog.text
    assert "--log-timers-to-tensorboard has no effect here" in text
    assert "--recompute-activations → --recompute-granularity selective" in text


def test_flash_attention_of_a_gpu_script_has_no_effect_without_cuda(monkeypatch, caplog):
    """A GPU launch script smoke-tested on CPU: --use-flash-attn is noticed in one line and the
    run goes on, as the other CUDA-only switches; on CUDA without flash_attn it stays refused."""
    from memo_ext.megatron_lm import handling

    monkeypatch.setattr(handling, "on_gpu", lambda: False)
    caplog.set_level("INFO")
    run = parse_args([*SMALL_GPT, "--use-flash-attn"], world_size=1)
    plain = parse_args(SMALL_GPT, world_size=1)
    assert run.model.attention_backend == plain.model.attention_backend
    (notice,) = [r.getMessage() for r in caplog.records if "--use-flash-attn" in r.getMessage()]
    assert notice == (
        "Megatron-LM flag --use-flash-attn has no effect on this machine: flash attention needs "
        "CUDA; the run goes on without it"
    )

    def no_flash_attn(backend: str) -> str:
        raise ValueError(backend)

    monkeypatch.setattr(handling, "on_gpu", lambda: True)
    monkeypatch.setattr(handling, "resolve_attention_backend", no_flash_attn)
    with pytest.raises(UsageError, match="--use-flash-attn: flash attention needs CUDA and the"):
        parse_args([*SMALL_GPT, "--use-flash-attn"], world_size=1)


def test_same_flags_refuse_values_that_are_not_ours():
    for argv, shown in (
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5"),
        (["--optimizer", "sgd"], "--optimizer sgd"),
        (["--transformer-impl", "inference_optimized"], "--transformer-impl inference_optimized"),
    ):
        with pytest.raises(UsageError, match=shown):
            parse_args([*SMALL_GPT, *argv], world_size=1)
    parse_args([*SMALL_GPT, "--rotary-percent", "1.0", "--optimizer", "adam"], world_size=1)


def test_parser_errors_are_one_line_without_usage(capsys):
    """The entry point's own main, in process (tests/dist runs it under torchrun too)."""
    from pretrain_gpt_memo import main

    assert main([*SMALL_GPT, "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err
    assert "unrecognized flag --no-such-flag (see --help)" in err  # nothing close to suggest
