"""The comparison's outputs: validation bpb against training FLOPs and time, as a table
(`compare.md`), numbers (`compare.json`) and a plot (`compare.png`).

Training FLOPs are the trainer's own count (`flops_per_s` of each log interval times its
seconds: the registry counter on the real bytes, and for the BLT on its real patches), summed up
to each validation step; training seconds are the trainer's (step and data time, validation and
start-up excluded). Wall time in the table is the whole training command.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from apps.plot import EVAL_METRICS, TRAIN_METRICS, read_records
from bytelatent.errors import DataError


@dataclass
class Curve:
    """One run's validation points and totals."""

    name: str
    params: int
    flops_per_byte: float  # the sizing's analytic value
    chunk: str  # bytes per patch / chunk measured in training ("1" for the byte LM)
    bytes_seen: int
    train_flops: float
    train_s: float
    wall_s: float
    steps: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    val_bpb: list[float] = field(default_factory=list)

    @property
    def final_bpb(self) -> float:
        return self.val_bpb[-1] if self.val_bpb else math.nan


def cumulative(train: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """(log steps, training FLOPs up to each, trainer seconds up to each)."""
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


def chunk_size(name: str, train: list[dict]) -> str:
    """Mean bytes per patch (BLT) or per chunk (H-Net) over the run's last quarter of logs."""
    key = {"blt": "patch_len_mean", "hnet": "aux/bytes_per_chunk/stage0"}.get(name)
    if key is None:
        return "1"
    values = [r[key] for r in train[len(train) * 3 // 4 :] if r.get(key) is not None]
    return f"{sum(values) / len(values):.2f}" if values else "n/a"


def read_curve(name: str, dump_dir: Path, params: int, flops_per_byte: float, wall_s: float):
    train = read_records(dump_dir / TRAIN_METRICS)
    if not train:
        raise DataError(f"{dump_dir / TRAIN_METRICS}: no training metrics")
    steps, flops, seconds = cumulative(train)
    curve = Curve(
        name, params, flops_per_byte, chunk_size(name, train),
        bytes_seen=int(train[-1]["tokens_seen"]), train_flops=flops[-1], train_s=seconds[-1],
        wall_s=wall_s,
    )  # fmt: skip
    for record in read_records(dump_dir / EVAL_METRICS):
        if record.get("val/bpb") is None:
            continue
        step = int(record["global_step"])
        curve.steps.append(step)
        curve.flops.append(at_step(step, steps, flops))
        curve.seconds.append(at_step(step, steps, seconds))
        curve.val_bpb.append(float(record["val/bpb"]))
    return curve


def table(curves: list[Curve]) -> str:
    header = (
        "| arch | params | FLOPs/byte (M) | bytes/patch or chunk | final val bpb | training "
        "bytes | training FLOPs | training s | wall s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = [
        f"| {c.name} | {c.params:,} | {c.flops_per_byte / 1e6:.3f} | {c.chunk} | "
        f"{c.final_bpb:.3f} | {c.bytes_seen:,} | {c.train_flops:.3g} | {c.train_s:.0f} | "
        f"{c.wall_s:.0f} |"
        for c in curves
    ]
    return header + "\n".join(rows) + "\n"


def write_json(path: Path, curves: list[Curve], extra: dict) -> None:
    runs = [{**asdict(c), "final_val_bpb": c.final_bpb} for c in curves]
    path.write_text(json.dumps({**extra, "runs": runs}, indent=1) + "\n")


def write_png(path: Path, curves: list[Curve]) -> bool:
    """Two panels: val bpb against training FLOPs and against training seconds; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_flops, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for c in curves:
        by_flops.plot(c.flops, c.val_bpb, "o-", label=c.name, markersize=4)
        by_time.plot(c.seconds, c.val_bpb, "o-", label=c.name, markersize=4)
    for ax, xlabel in ((by_flops, "training FLOPs"), (by_time, "training seconds")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation bits per byte")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
