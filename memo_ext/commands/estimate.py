"""Memory, step time and MFU of GPT training at any scale, and the longest sequence that fits.

Answers "what is the longest sequence this model trains at on my machines, with which settings,
and how fast?" on a laptop: per-layer bytes and FLOPs are measured on fake tensors
(``memo_ext.estimate``) and scaled to the layout. Examples::

    python -m tools.estimate --model gpt-7b --gpus 8 --gpu a800-80g --host-memory-gb 2048 \\
        --method memo --seq-length 1048576 --tensor-model-parallel-size 8 --sequence-parallel
    python -m tools.estimate --model gpt-7b --gpus 8 --gpu a800-80g --host-memory-gb 2048 \\
        --method full --find-max-seq-length --json

Model, layout, MEMO and device flags are the trainer's and the presets' own fields (unset:
the preset's value, or searched for the layout). ``--calibration FILE`` takes the efficiencies
and host link a machine was measured to reach (``python -m tools.compare_methods --calibrate``).
With ``--json`` the last line printed is one JSON object. Bad input exits with status 2 and one
sentence.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
# megatron-core warns at import about optional kernels this tool does not run
warnings.filterwarnings("ignore")

from memo_ext.arguments import parse_tool_args  # noqa: E402
from memo_ext.config import DataConfig, MemoConfig, ModelConfig, TrainConfig  # noqa: E402
from memo_ext.errors import UsageError  # noqa: E402
from memo_ext.estimate.calibration import apply_calibration  # noqa: E402
from memo_ext.estimate.cost_model import Batch, Efficiency, Estimate  # noqa: E402
from memo_ext.estimate.search import (  # noqa: E402
    DEFAULT_GRANULARITY,
    SearchSpace,
    best_at_length,
    find_max_seq_length,
)
from memo_ext.estimate.stage import MemoryMethod  # noqa: E402
from memo_ext.features.registry import (  # noqa: E402
    COMPARED,
    compared_method,
    memory_method,
    method_names,
)
from memo_ext.features.spelling import parse_spelling  # noqa: E402
from memo_ext.flags import (  # noqa: E402
    SpellCheckedParser,
    add_flags,
    cli_fields,
    finite_float,
    overrides_from_flags,
)
from memo_ext.hardware import (  # noqa: E402
    DEVICES,
    GIB,
    DeviceSpec,
    device_spec,
    read_calibration,
)
from memo_ext.parallel import ParallelLayout  # noqa: E402
from memo_ext.plugins import add_flag, with_plugins  # noqa: E402
from memo_ext.shapes import MODELS, ModelShape, model_shape  # noqa: E402

# the flag sections of this tool: (namespace, dataclass, only these fields)
MODEL_FIELDS = tuple(f.name for f in cli_fields(ModelShape)) + ("vocab_size",)
SECTIONS = (
    ("shape", ModelShape, MODEL_FIELDS),
    ("layout", ParallelLayout, None),
    ("train", TrainConfig, ("micro_batch_size", "use_distributed_optimizer")),
    ("batch", Batch, ("num_microbatches",)),
    ("memo", MemoConfig, ("alpha", "keep_last_layers", "chunk_tokens")),
    ("device", DeviceSpec, None),
    ("efficiency", Efficiency, None),
    ("model", ModelConfig, ("loss_chunks",)),
)


PROG = "memo-estimate"
"""The installed command: its usage line and error prefix."""


class _Parser(SpellCheckedParser):
    def error(self, message: str) -> None:  # one sentence, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument(
        "--model",
        default="gpt-7b",
        help=f"Preset, its sizes changed by the model flags below: {', '.join(MODELS)} "
        "(default: %(default)s).",
    )
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the job (default: %(default)s).")
    p.add_argument(
        "--gpu",
        default="a800-80g",
        help=f"Device preset: {', '.join(DEVICES)} (default: %(default)s).",
    )
    p.add_argument(
        "--host-memory-gb",
        type=finite_float,
        default=2048,
        help="Host memory per node, GiB (default: %(default)s).",
    )
    p.add_argument(
        "--method",
        default="memo",
        help=_method_help(),
    )
    what = p.add_mutually_exclusive_group()
    add_flags(what, DataConfig, section="data", overrides=True, only=("seq_length",))
    what.add_argument("--find-max-seq-length", action="store_true", help="Search the longest.")
    p.add_argument(
        "--granularity", type=int, default=DEFAULT_GRANULARITY, help="Search step / (2·CP), tokens."
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="Print one JSON object alone on stdout (the table goes to stderr).",
    )
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="A memo-calibration/1 file (python -m tools.compare_methods --calibrate): its "
        "measured matmul / attention efficiencies and host-link bandwidth replace the "
        "assumed ones (flags given explicitly still win).",
    )
    titles = {
        "shape": "model (default: the preset's)",
        "layout": "parallelism (unset: searched)",
        "device": "device (default: the preset's)",
        "efficiency": "efficiency",
    }
    groups = {}
    for section, cls, only in SECTIONS:
        title = titles.get(section, "batch and MEMO (unset: the defaults, or searched)")
        group = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
        add_flags(group, cls, section=section, overrides=True, only=only)
    add_flag(p)
    return p


def _given(args: argparse.Namespace) -> dict[str, dict]:
    """Per section, the flags given on the command line."""
    return {
        section: overrides_from_flags(cls, args, section=section, only=only)
        for section, cls, only in SECTIONS
    }


def _inputs(args: argparse.Namespace):
    """(model, device, batch, search space, efficiency) from the flags."""
    given = _given(args)
    model = model_shape(args.model, **given["shape"])
    model.check()
    # Megatron's methods are priced through the caching-allocator replay unless told otherwise
    efficiency = Efficiency(caching_allocator=True, **given["model"])
    device = device_spec(args.gpu)
    if args.calibration is not None:  # measured figures; flags given explicitly still win
        calibration = read_calibration(args.calibration)
        device, efficiency = apply_calibration(calibration, device=device, efficiency=efficiency)
    device = dataclasses.replace(device, **given["device"])
    efficiency = dataclasses.replace(efficiency, **given["efficiency"])
    efficiency.check()
    train = given["train"]
    batch = dataclasses.replace(
        Batch(**given["batch"]),
        micro_batch_size=train.get("micro_batch_size", 1),
        distributed_optimizer=train.get("use_distributed_optimizer", True),
    )
    layout, memo = given["layout"], MemoConfig(enabled=True, **given["memo"])
    memo.check()
    _, fixed = method_of(args.method)
    for field, value in given["memo"].items():
        if field in fixed:
            raise UsageError(f"--method {args.method} and --memo-{field.replace('_', '-')} both "
                             f"give {field}; give it once")  # fmt: skip
        fixed[field] = value
    space = SearchSpace(
        tp=layout.get("tp"),
        cp=layout.get("cp"),
        pp=layout.get("pp", 1),
        sp=layout.get("sp"),
        fixed=tuple(sorted(fixed.items())),
    )
    _check_positive(args, batch, space)
    return model, device, batch, space, efficiency


def _method_help() -> str:
    names = ", ".join(method_names())
    takers = [m for m in COMPARED if m.settings_help and m.estimator is not None]
    settings = "".join(
        f" {m.name} takes " + "; ".join(f"{k}: {v}" for k, v in m.settings_help.items()) + "."
        for m in takers
        if m.name in method_names()
    )
    return f"Memory method, NAME[:KEY=VALUE,...]: {names} (default: %(default)s).{settings}"


def method_of(text: str) -> tuple[MemoryMethod, dict]:
    """The memory method ``--method`` names and the settings its spelling fixes
    (``memo:alpha=0.5,rule=NAME``, read by the method as ``memo-compare --methods`` reads it).

    Raises:
        UsageError: for an unknown method, a layout, or a setting it does not take.
    """
    spelling = parse_spelling(text, flag="--method")
    if spelling.layout is not None:
        raise UsageError(f"--method {text}: no @LAYOUT here; the layout flags fix it, or search")
    method = memory_method(spelling.name)
    if not spelling.settings:
        return method, {}
    compared = compared_method(spelling.name)
    if compared is None or compared.estimator is not method or not compared.settings_help:
        raise UsageError(f"--method {text}: {spelling.name} takes no settings")
    settings = compared.parse_settings(spelling.settings, text=text, flag="--method")
    return method, compared.fixed_settings(dict(settings))


def _check_positive(args: argparse.Namespace, batch: Batch, space: SearchSpace) -> None:
    values = {
        "--gpus": args.gpus,
        "--granularity": args.granularity,
        "--host-memory-gb": args.host_memory_gb,
        "--micro-batch-size": batch.micro_batch_size,
        "--num-microbatches": batch.num_microbatches,
        "--pipeline-model-parallel-size": space.pp,
    }
    for flag, value in values.items():
        if value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    model_parallel = space.pp * (space.tp or 1) * (space.cp or 1)
    if args.gpus % model_parallel:
        raise UsageError(
            f"--gpus {args.gpus} must be a multiple of TP × CP × PP = {model_parallel}"
        )


def format_estimate(est: Estimate) -> str:
    gib = GIB
    lay = est.layout
    memo = ""
    if est.alpha is not None:  # MEMO's settings, as it priced them
        chunk = f", chunks of {est.memo_chunk_tokens:,} tokens" if est.memo_chunk_tokens else ""
        layers = memo_layers(keep=est.keep_last_layers or 0, skeletons=est.memo_device_skeletons)
        memo = f" (α = {est.alpha:.3f}, {layers}{chunk})"
    device_fit = "fits" if est.fits_device else "does NOT fit"
    host_fit = "fits" if est.fits_host else "does NOT fit"
    rows = [
        (
            "model / GPU",
            f"{est.model} on {lay['tp'] * lay['cp'] * lay['pp'] * lay['dp']} × {est.gpu}",
        ),
        ("method", est.method + memo),
        ("sequence length", f"{est.seq_length:,} tokens"),
        (
            "layout",
            f"TP {lay['tp']}{' + SP' if lay['sp'] else ''}, CP {lay['cp']}, PP {lay['pp']}, DP "
            f"{lay['dp']}, micro-batch {lay['micro_batch_size']} × {lay['num_microbatches']}",
        ),
        ("model states", f"{est.model_state_bytes / gib:.2f} GiB"),
        ("stored activations", f"{est.activation_bytes / gib:.2f} GiB"),
        ("transient at peak", f"{est.transient_bytes / gib:.2f} GiB"),
        (
            "device peak",
            f"{est.device_peak_bytes / gib:.2f} GiB of {est.device_usable_bytes / gib:.2f} usable "
            f"({device_fit})" + (" allocated" if est.reserved_bytes is not None else ""),
        ),
        *(
            [
                (
                    "caching allocator",
                    f"{est.reserved_bytes / gib:.2f} GiB reserved, "
                    f"{est.fragmentation_bytes / gib:.2f} GiB of it fragmentation, "
                    f"{est.allocator_retries} empty-cache retries per step "
                    f"({est.allocator_retry_s:.3f} s)",
                )
            ]
            if est.reserved_bytes is not None
            else []
        ),
        *(
            [
                (
                    "host memory",
                    f"{est.host_bytes / gib:.2f} GiB of {est.host_budget_bytes / gib:.2f} per GPU "
                    f"({host_fit}); copies at {est.host_copy_gbps:g} GB/s per GPU (its share of "
                    "the host link while the node's GPUs copy)",
                )
            ]
            if est.host_bytes or est.alpha is not None  # a method that keeps activations there
            else []
        ),
        (
            "step time",
            f"{est.step_time_s:.2f} s (compute {est.compute_s:.2f}, exposed comm "
            f"{est.exposed_comm_s:.2f}, exposed host copies {est.exposed_host_copy_s:.2f})",
        ),
        ("throughput", f"{est.tokens_per_s:,.0f} tokens/s"),
        ("MFU", f"{100 * est.mfu:.1f}%"),
    ]
    lines = [f"{k:<20} {v}" for k, v in rows]
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def memo_layers(*, keep: int, skeletons: int) -> str:
    """Which layers MEMO leaves on the device, in one phrase: the last ``keep`` it does not
    offload (--memo-keep-last-layers), and the ``skeletons`` before them that it offloads in name
    only, their whole storages kept for want of host memory (chunked MEMO)."""
    kept = f"the last {keep} layers not offloaded" if keep else ""
    if skeletons:
        where = f"the {skeletons} before them" if keep else f"the last {skeletons} layers"
        held = f"{where} kept whole on the device for want of host memory"
        kept = f"{kept}, {held}" if keep else held
    return kept or "every layer offloaded"


def headline(est: Estimate) -> str:
    """The longest length found, with what a step of it costs."""
    return (
        f"longest sequence that fits: {est.seq_length:,} tokens, at a predicted "
        f"{est.step_time_s:.2f} s per step ({est.tokens_per_s:,.0f} tokens/s, MFU "
        f"{100 * est.mfu:.1f}%)"
    )


def json_record(est: Estimate, *, searched: bool) -> dict:
    record = est.to_json()
    record.update(record.pop("layout"))
    if searched:
        record["max_seq_length"] = est.seq_length
    return record


@with_plugins(PROG)
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    try:
        args = parse_tool_args(build_parser(), argv)
        seq_length = getattr(args, "data.seq_length")
        model, device, batch, space, efficiency = _inputs(args)
        common = dict(
            model=model,
            device=device,
            gpus=args.gpus,
            method=method_of(args.method)[0],
            host_memory_bytes=int(args.host_memory_gb * GIB),
            space=space,
            batch=batch,
            efficiency=efficiency,
        )
        if seq_length is not None:
            est = best_at_length(seq_length=seq_length, **common)
        else:
            est = find_max_seq_length(granularity=args.granularity, progress=True, **common)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    searched = seq_length is None
    # with --json, stdout holds the JSON alone (for jq and the like); the table goes to stderr
    text = sys.stderr if args.json else sys.stdout
    if est is None:
        print(
            f"no layout of {args.gpus} × {device.name} fits {model.name} with --method "
            f"{args.method} even at {2 * args.granularity} tokens",
            file=text,
        )
        if args.json:
            print(json.dumps({"method": args.method, "max_seq_length": None, "fits": False}))
        return 0
    if searched:
        print(headline(est), file=text)
    print(format_estimate(est), file=text)
    if args.json:
        print(json.dumps(json_record(est, searched=searched)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
