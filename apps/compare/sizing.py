"""Each run's trainer command, and the rule that sizes the rows to equal FLOPs per byte.

The rule (printed by the recipe): the reference row (`reference`, the byte LM by default: its
FLOPs per byte do not depend on any patching) is trained as configured; every other row's
`size_key` takes the value among `size_values` whose training FLOPs per byte is closest to the
reference's (smallest |log ratio|); a row off by more than `flops_tolerance` stops the recipe with
one config-error line. FLOPs per byte is the architecture's registry counter (`ArchSpec.sizes.flops`,
what the trainer's MFU uses) on a row of `row_bytes` bytes, with the patch counts the row will
really see: static patching at exactly `bytes_per_patch`; space patching at the mean measured by
the patcher on the first `entropy.sample_bytes` of the training shards; entropy patching at the
mean the picked threshold gives on that sample (`bytes_per_patch`); an H-Net at its targets. After
training, each run's FLOPs per byte is recounted from its own metrics (the trainer counts the BLT's
real patches and the H-Net's measured chunk counts) and checked against the same tolerance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from apps.compare.args import CompareArgs
from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.errors import ConfigError, DataError
from bytelatent.model.registry import get_arch


@dataclass
class Sized:
    name: str
    argv: list[str]  # the trainer's arguments without dump_dir, seed and lr
    arch: str
    patched: bool
    flops_per_byte: float
    params: int
    size: str  # "key=value" the sizing chose, or "" for an unsized row
    bytes_per_patch: float  # what the sizing assumed (1 for a byte LM)
    variant: str = ""  # BLT: its patching; H-Net: its number of stages


def blt_patching(
    args: CompareArgs, patching: str, entropy_dir: str | None, threshold: float | None
) -> list[str]:
    """The patcher keys of a BLT row (entropy: computed on the fly by the entropy model)."""
    if patching == "space":
        return ["data.patcher_args.patching_mode=space"]
    if patching == "static":
        return [
            "data.patcher_args.patching_mode=static",
            f"data.patcher_args.patch_size={int(args.bytes_per_patch)}",
        ]
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


def training_sample(args: CompareArgs) -> bytes:
    """The first `entropy.sample_bytes` bytes of the training shards (documents joined)."""
    files = sorted((Path(args.data_root) / args.source).glob(f"{args.source}.chunk.*.jsonl"))
    if not files:
        raise DataError(f"{Path(args.data_root) / args.source}: no {args.source}.chunk.*.jsonl")
    out = bytearray()
    with open(files[0]) as f:
        for line in f:
            out += json.loads(line)["text"].encode()
            if len(out) >= args.entropy.sample_bytes:
                break
    return bytes(out[: args.entropy.sample_bytes])


def space_patch_mean(args: CompareArgs) -> float:
    """Mean bytes per space patch over rows of `row_bytes` bytes of the training sample."""
    from bytelatent.data.patch_rules import patch_lengths
    from bytelatent.data.patcher_args import PatcherArgs
    from bytelatent.tokenizers.constants import OFFSET

    sample = np.frombuffer(training_sample(args), dtype=np.uint8).astype(np.int64) + OFFSET
    n_rows = len(sample) // args.row_bytes
    if n_rows == 0:
        raise DataError(f"{args.source}: under {args.row_bytes} bytes of training text")
    tokens = sample[: n_rows * args.row_bytes].reshape(n_rows, args.row_bytes)
    lengths = patch_lengths(PatcherArgs(patching_mode="space"), tokens)
    return float(tokens.size / np.count_nonzero(lengths))


def row_argv(
    args: CompareArgs,
    name: str,
    splits: dict[str, Path],
    patch_mean: float,
    entropy_dir: str | None = None,
    threshold: float | None = None,
) -> list[str]:
    """The trainer's argv for row `name` before sizing: its config and overrides, then the keys
    the recipe owns (same corpus, rows, batch, steps, schedule and validation for every run)."""
    row = args.rows[name]
    argv = [f"config={row.config}", *row.overrides]
    sources = ", ".join(str(splits[s]) for s in ("tune", "test", "ood"))
    argv += [
        f"steps={args.steps}",
        f"optim.warmup={args.warmup}",
        f"data.root_dir={args.data_root}",
        f"data.sources={{{args.source}: 1.0}}",
        f"data.batch_size={args.batch_size}",
        f"eval.every={args.eval_every}",
        f"eval.validation.sources=[{sources}]",
        f"eval.validation.max_batches={args.val_batches}",
        f"checkpoint.dump.every={args.steps}",
        "checkpoint.dump.keep=1",
        f"logging.freq={math.gcd(args.eval_every, 10)}",
    ]
    if row.patching is not None:
        patches = math.ceil(args.blt_patch_headroom * args.row_bytes / patch_mean)
        argv += [
            f"data.seq_len={patches}",
            f"data.max_encoder_seq_length={args.row_bytes}",
            f"model.max_encoder_seq_length={args.row_bytes}",
            *blt_patching(args, row.patching, entropy_dir, threshold),
        ]
    else:
        argv.append(f"data.seq_len={args.row_bytes}")
    return argv


def measure(args: CompareArgs, name: str, argv: list[str], patch_mean: float, size: str = ""):
    """A `Sized` for `argv`: FLOPs per byte from the registry counter, params on the meta device."""
    import torch

    # each run gets its own dump_dir later; a config may leave it mandatory (???)
    train = parse_args(TrainArgs, [*argv, f"dump_dir={args.out_dir}/runs/{name}"])
    spec = get_arch(train.arch)
    factory = spec.sizes.flops
    if factory is None:
        raise ConfigError(f"rows.{name}: arch {train.arch} has no FLOPs counter; cannot size it")
    count = factory(train.active_model_args(), train.data)
    patches = args.row_bytes / patch_mean if spec.patched else 0
    with torch.device("meta"):
        params = sum(p.numel() for p in spec.build(train.active_model_args()).parameters())
    flops = count(args.row_bytes, patches) / args.row_bytes
    model = train.active_model_args()
    stages = getattr(model, "stages", None)
    if stages is not None:  # an H-Net: its overall target ratio and its depth
        mean = math.prod(s.target_ratio for s in stages)
        variant = f"{len(stages)}-stage"
    else:
        mean = patch_mean if spec.patched else 1.0
        variant = args.rows[name].patching or ""
    return Sized(name, argv, train.arch, spec.patched, flops, params, size, mean, variant)


def patch_means(args: CompareArgs) -> dict[str, float]:
    """The mean bytes per patch each BLT row will see (see the module docstring)."""
    means = {}
    for name, row in args.rows.items():
        if row.patching == "space":
            try:
                means[name] = space_patch_mean(args)
            except DataError:
                if not args.dry_run:
                    raise
                means[name] = args.bytes_per_patch  # no corpus here: the dry run assumes N
                print(f"sizing: {name}: no training text to measure space patches on; the dry "
                      f"run assumes {args.bytes_per_patch:g} bytes per patch")  # fmt: skip
        elif row.patching is not None:
            means[name] = args.bytes_per_patch
        else:
            means[name] = 1.0
    return means


def _candidates(args, name: str, base: list[str], mean: float) -> list[Sized]:
    row = args.rows[name]
    if row.size_key is None:
        return [measure(args, name, base, mean)]
    valid, errors = [], []
    for v in row.size_values:  # a value the architecture refuses (a width too small) is skipped
        try:
            valid.append(
                measure(args, name, [*base, f"{row.size_key}={v}"], mean, f"{row.size_key}={v}")
            )
        except ConfigError as e:
            errors.append(e)
    if not valid:
        raise errors[0]
    return valid


def _closest(candidates: list[Sized], target: float, correction: float = 1.0) -> Sized:
    return min(candidates, key=lambda c: abs(math.log(c.flops_per_byte * correction / target)))


def size_rows(
    args: CompareArgs,
    splits: dict[str, Path],
    entropy_dir: str | None = None,
    threshold: float | None = None,
    previous: dict[str, Sized] | None = None,
    real: dict[str, float] | None = None,
) -> dict[str, Sized]:
    """Every row's argv with its size chosen by the rule in this module's docstring.

    Calibration (`previous` sizes and the FLOPs per byte their runs `real`ly trained at): a row
    within the tolerance of the reference's real value keeps its size; another is sized again
    with every candidate's prediction scaled by its real / predicted ratio (what its measured
    patch or chunk counts did to the count). Without `real`, a row that cannot be matched is a
    ConfigError."""
    means = patch_means(args)
    ref = args.reference
    ref_argv = row_argv(args, ref, splits, means[ref], entropy_dir, threshold)
    sized = {ref: measure(args, ref, ref_argv, means[ref])}
    target = sized[ref].flops_per_byte if real is None else real[ref]
    for name in (n for n in args.rows if n != ref):
        if real is not None and abs(real[name] / target - 1) <= args.flops_tolerance:
            sized[name] = previous[name]
            continue
        base = row_argv(args, name, splits, means[name], entropy_dir, threshold)
        candidates = _candidates(args, name, base, means[name])
        correction = 1.0 if real is None else real[name] / previous[name].flops_per_byte
        sized[name] = s = _closest(candidates, target, correction)
        ratio = s.flops_per_byte / target
        if real is None and abs(ratio - 1) > args.flops_tolerance:  # stop at the first one
            raise ConfigError(
                f"rows.{name}: FLOPs per byte {s.flops_per_byte / 1e6:.3f} M is {ratio:.3f}x "
                f"the {ref}'s ({target / 1e6:.3f} M), outside flops_tolerance="
                f"{args.flops_tolerance}; change rows.{name}.size_values or its overrides"
            )
    return {n: sized[n] for n in args.rows}


def sizing_lines(args: CompareArgs, sized: dict[str, Sized]) -> list[str]:
    target = sized[args.reference].flops_per_byte
    lines = [
        f"sizing: every row matches {args.reference}'s {target / 1e6:.3f} MFLOP/byte of training "
        f"(registry counter, rows of {args.row_bytes} bytes; BLT at its measured mean patch, "
        f"H-Net at its targets, N={args.bytes_per_patch:g}): each row's size_key takes the "
        f"closest value, tolerance ±{args.flops_tolerance:.0%}, rechecked on each run's real counts"
    ]
    for name, s in sized.items():
        chosen = s.size or "as configured"
        lines.append(
            f"  {name:12s} {s.arch:7s} {chosen:24s} {s.params:>11,} params  "
            f"{s.flops_per_byte / 1e6:7.3f} MFLOP/byte  ratio {s.flops_per_byte / target:.3f}  "
            f"bytes/patch {s.bytes_per_patch:.2f}"
        )
    return lines
