"""The comparison's outputs, all drawn from the runs' own metrics files: `compare.json` (per row:
the sweep, the chosen rate, bpb per seed with mean and std), `compare.md` (the table) and
`compare.png` (test bpb against training FLOPs, a band per row over seeds; the sweep; bpb against
training seconds).

Training FLOPs are the trainer's own count (the registry counter on the real bytes; the BLT's on
its real patches, the H-Net's at its measured chunk counts: `useful_flops` = `flops_per_s` x the
interval's seconds), summed up to each validation. Training seconds are the trainer's step time
only; data time (the BLT's on-the-fly entropy patching among it) is kept apart, and start-up and
validation are excluded. Wall and CPU seconds are the whole training command's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from apps.plot import EVAL_METRICS, TRAIN_METRICS, read_records
from bytelatent.errors import DataError

SPLIT_KEYS = {s: f"val/{s}/bpb" for s in ("tune", "test", "ood")}


@dataclass
class Curve:
    """One run's validation points and totals."""

    row: str
    lr: float
    seed: int
    bytes_seen: int
    train_flops: float
    step_s: float  # trainer step time, summed
    data_s: float  # trainer data time, summed (the BLT's entropy patching is here)
    wall_s: float
    cpu_s: float
    bytes_per_patch: float  # measured in training (last half of the logs); 1 for a byte LM
    steps: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    bpb: dict[str, list[float]] = field(default_factory=dict)  # split -> bpb at each validation

    @property
    def flops_per_byte(self) -> float:
        return self.train_flops / max(self.bytes_seen, 1)

    def final(self, split: str) -> float:
        values = self.bpb.get(split) or []
        return values[-1] if values else math.nan


def cumulative(train: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """(log steps, training FLOPs up to each, trainer step seconds up to each)."""
    steps, flops, seconds, f, s = [], [], [], 0.0, 0.0
    for record in train:
        interval_s = record["n_bytes"] / max(record["bytes_per_s"], 1e-9)
        f += record["flops_per_s"] * interval_s
        s += interval_s
        steps.append(int(record["global_step"]))
        flops.append(f)
        seconds.append(s)
    return steps, flops, seconds


def at_step(step: int, steps: list[int], values: list[float]) -> float:
    """`values` at `step`, linear between log steps (validation steps need not be log steps)."""
    previous_step, previous = 0, 0.0
    for s, v in zip(steps, values):
        if s >= step:
            return previous + (v - previous) * (step - previous_step) / max(s - previous_step, 1)
        previous_step, previous = s, v
    return previous


def measured_patch(train: list[dict]) -> float:
    """Mean bytes per patch (BLT) or per last-stage chunk (H-Net) over the last half of the
    logs; 1.0 for a byte LM."""
    late = train[len(train) // 2 :]
    stages = sorted(k for k in late[0] if k.startswith("aux/bytes_per_chunk/stage")) if late else []
    key = "patch_len_mean" if late and "patch_len_mean" in late[0] else (stages or [None])[-1]
    if key is None:
        return 1.0
    values = [r[key] for r in late if r.get(key) is not None]
    return sum(values) / len(values) if values else math.nan


def read_curve(row: str, lr: float, seed: int, dump_dir: Path, record: dict) -> Curve:
    train = read_records(dump_dir / TRAIN_METRICS)
    if not train:
        raise DataError(f"{dump_dir / TRAIN_METRICS}: no training metrics")
    steps, flops, _ = cumulative(train)
    step_cum, data_s, previous, total = [], 0.0, 0, 0.0
    for r, s in zip(train, steps):
        total += r["step_time_s"] * (s - previous)
        data_s += r["data_time_s"] * (s - previous)
        step_cum.append(total)
        previous = s
    curve = Curve(
        row, lr, seed, bytes_seen=int(train[-1]["tokens_seen"]), train_flops=flops[-1],
        step_s=total, data_s=data_s, wall_s=record["wall_s"], cpu_s=record["cpu_s"],
        bytes_per_patch=measured_patch(train),
    )  # fmt: skip
    for record_ in read_records(dump_dir / EVAL_METRICS):
        if record_.get(SPLIT_KEYS["test"]) is None:
            continue
        step = int(record_["global_step"])
        curve.steps.append(step)
        curve.flops.append(at_step(step, steps, flops))
        curve.seconds.append(at_step(step, steps, step_cum))  # step time only, data time apart
        for split, key in SPLIT_KEYS.items():
            curve.bpb.setdefault(split, []).append(float(record_[key]))
    if not curve.steps:
        raise DataError(f"{dump_dir / EVAL_METRICS}: no validation with {SPLIT_KEYS['test']}")
    return curve


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def row_result(name: str, sized, sweep: list[Curve], chosen: float, seeds: list[Curve]) -> dict:
    """One row of compare.json (see docs/compare.md for each field)."""
    test = [c.final("test") for c in seeds]
    ood = [c.final("ood") for c in seeds]
    val_mean, val_std = mean_std(test)
    ood_mean, ood_std = mean_std(ood)
    return {
        "row": name,
        "arch": sized.arch,
        "variant": sized.variant,
        "params": sized.params,
        "size": sized.size,
        "flops_per_byte": statistics.fmean(c.flops_per_byte for c in seeds),
        "flops_per_byte_sized": sized.flops_per_byte,
        "lr": chosen,
        "lr_sweep": {f"{c.lr:g}": c.final("tune") for c in sweep},
        "seeds": [c.seed for c in seeds],
        "val_bpb": test,
        "val_bpb_mean": val_mean,
        "val_bpb_std": val_std,
        "ood_bpb": ood,
        "ood_bpb_mean": ood_mean,
        "ood_bpb_std": ood_std,
        "tune_bpb": [c.final("tune") for c in seeds],
        "bytes_per_patch": statistics.fmean(c.bytes_per_patch for c in seeds),
        "bytes_per_patch_target": sized.bytes_per_patch,
        "train_bytes": seeds[0].bytes_seen,
        "train_flops": statistics.fmean(c.train_flops for c in seeds),
        "train_step_s": statistics.fmean(c.step_s for c in seeds),
        "data_s": statistics.fmean(c.data_s for c in seeds),
        "wall_s": statistics.fmean(c.wall_s for c in seeds),
        "cpu_s": statistics.fmean(c.cpu_s for c in seeds),
        "curves": [
            {"seed": c.seed, "flops": c.flops, "seconds": c.seconds, "test_bpb": c.bpb["test"]}
            for c in seeds
        ],
    }


def table(rows: list[dict], reference_flops: float) -> str:
    header = (
        "| row | arch | params | lr (of sweep) | test bpb | out-of-domain bpb | bytes/patch "
        "(target) | FLOPs/byte (M, ratio) | train s (data s) | wall s | CPU s |\n"
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        sweep = ", ".join(r["lr_sweep"])
        ratio = r["flops_per_byte"] / reference_flops
        lines.append(
            f"| {r['row']} | {r['arch']} | {r['params']:,} | {r['lr']:g} ({sweep}) | "
            f"{r['val_bpb_mean']:.4f} ± {r['val_bpb_std']:.4f} | "
            f"{r['ood_bpb_mean']:.4f} ± {r['ood_bpb_std']:.4f} | "
            f"{r['bytes_per_patch']:.2f} ({r['bytes_per_patch_target']:.2f}) | "
            f"{r['flops_per_byte'] / 1e6:.3f} ({ratio:.3f}) | "
            f"{r['train_step_s']:.0f} ({r['data_s']:.0f}) | {r['wall_s']:.0f} | {r['cpu_s']:.0f} |"
        )
    return header + "\n".join(lines) + "\n"
