"""Each compared run's trainer command, and the rule that sizes the runs to equal FLOPs per byte.

The rule (printed by the recipe): the reference run (`reference`, the H-Net by default) is
trained as configured; for each other run, `size_key` takes the value among `size_values` whose
training FLOPs per byte is closest to the reference's (smallest |log ratio|), and the recipe
stops if that ratio is off by more than `flops_tolerance`. FLOPs per byte is the architecture's
registry counter (`ArchSpec.sizes.flops`, what the trainer's MFU uses) on a row of `row_bytes` bytes:
the H-Net at its target ratio N, the BLT at N bytes per patch (the entropy threshold is picked for
that mean), the byte LM per byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from apps.compare.args import ARCHS, CompareArgs
from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.errors import ConfigError
from bytelatent.model.registry import get_arch


@dataclass
class Sized:
    name: str
    argv: list[str]  # the trainer's arguments (config=..., key=value ...)
    flops_per_byte: float
    params: int
    size: str  # "key=value" the sizing chose, or "" for the reference


def blt_patching(args: CompareArgs, entropy_dir: str | None, threshold: float | None) -> list[str]:
    """Entropy patching computed on the fly by the entropy model, at the picked threshold."""
    keys = [
        "data.patcher_args.patching_mode=entropy",
        f"data.patcher_args.patch_size={args.bytes_per_patch}",
        "data.patcher_args.patching_device=cpu",
    ]
    if entropy_dir is not None:
        keys += [
            "data.patcher_args.realtime_patching=true",
            f"data.patcher_args.entropy_model_checkpoint_dir={entropy_dir}",
        ]
    if threshold is not None:
        keys.append(f"data.patcher_args.threshold={threshold!r}")
    return keys


def run_argv(
    args: CompareArgs, name: str, entropy_dir: str | None = None, threshold: float | None = None
) -> list[str]:
    """The trainer's argv for run `name`, before sizing: its config and overrides, then the keys
    the recipe owns (same corpus, rows, batch, steps and validation points for every run)."""
    run = args.runs[name]
    argv = [f"config={run.config}", *run.overrides]
    argv += [
        f"dump_dir={Path(args.out_dir) / 'runs' / name}",
        f"steps={args.steps}",
        f"seed={args.seed}",
        f"data.root_dir={args.data_root}",
        f"data.sources={{{args.source}: 1.0}}",
        f"data.batch_size={args.batch_size}",
        f"eval.every={args.eval_every}",
        f"eval.validation.max_batches={args.val_batches}",
        f"checkpoint.dump.every={args.steps}",
        f"logging.freq={math.gcd(args.eval_every, 10)}",
    ]
    if name == "blt":
        patches = math.ceil(args.blt_patch_headroom * args.row_bytes / args.bytes_per_patch)
        argv += [
            f"data.seq_len={patches}",
            f"data.max_encoder_seq_length={args.row_bytes}",
            f"model.max_encoder_seq_length={args.row_bytes}",
            *blt_patching(args, entropy_dir, threshold),
        ]
    else:
        argv.append(f"data.seq_len={args.row_bytes}")
    return argv


def flops_and_params(train: TrainArgs, row_bytes: int, bytes_per_patch: float):
    """(training FLOPs per byte from the registry counter, parameter count on the meta device)."""
    import torch

    spec = get_arch(train.arch)
    factory = spec.sizes.flops
    if factory is None:
        raise ConfigError(
            f"arch {train.arch}: no FLOPs counter (its spec's Sizes.flops); cannot size it"
        )
    count = factory(train.active_model_args(), train.data)
    patches = row_bytes / bytes_per_patch if spec.patched else 0
    with torch.device("meta"):
        params = sum(p.numel() for p in spec.build(train.active_model_args()).parameters())
    return count(row_bytes, patches) / row_bytes, params


def measure(args: CompareArgs, name: str, argv: list[str], size: str = "") -> Sized:
    train = parse_args(TrainArgs, argv)
    flops, params = flops_and_params(train, args.row_bytes, args.bytes_per_patch)
    return Sized(name, argv, flops, params, size)


def size_runs(
    args: CompareArgs, entropy_dir: str | None = None, threshold: float | None = None
) -> dict[str, Sized]:
    """Every run's argv with its size chosen by the rule in this module's docstring."""
    sized = {args.reference: measure(args, args.reference, run_argv(args, args.reference))}
    target = sized[args.reference].flops_per_byte
    for name in (n for n in args.runs if n != args.reference):
        run, base = args.runs[name], run_argv(args, name, entropy_dir, threshold)
        if run.size_key is None:
            sized[name] = measure(args, name, base)
            continue
        candidates = [
            measure(args, name, [*base, f"{run.size_key}={v}"], f"{run.size_key}={v}")
            for v in run.size_values
        ]
        sized[name] = min(candidates, key=lambda c: abs(math.log(c.flops_per_byte / target)))
    for name, s in sized.items():
        ratio = s.flops_per_byte / target
        if abs(ratio - 1) > args.flops_tolerance:
            raise ConfigError(
                f"runs.{name}: FLOPs per byte {s.flops_per_byte / 1e6:.3f} M is {ratio:.3f}x the "
                f"{args.reference}'s ({target / 1e6:.3f} M), outside flops_tolerance="
                f"{args.flops_tolerance}; change runs.{name}.size_values or its overrides"
            )
    return {n: sized[n] for n in ARCHS}


def sizing_lines(args: CompareArgs, sized: dict[str, Sized]) -> list[str]:
    target = sized[args.reference].flops_per_byte
    lines = [
        f"sizing: {args.reference} is the reference ({target / 1e6:.3f} MFLOP/byte at "
        f"N={args.bytes_per_patch:g}, rows of {args.row_bytes} bytes); each other run takes the "
        f"value of its size_key closest in FLOPs/byte (tolerance ±{args.flops_tolerance:.0%})"
    ]
    for name, s in sized.items():
        chosen = s.size or "as configured"
        lines.append(
            f"  {name:5s} {chosen:24s} {s.params:>11,} params  {s.flops_per_byte / 1e6:7.3f} "
            f"MFLOP/byte  ratio {s.flops_per_byte / target:.3f}"
        )
    return lines
