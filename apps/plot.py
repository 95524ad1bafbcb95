"""`python -m apps.plot DUMP_DIR [--out DIR]`: PNG plots of a run's metrics.

Reads `DUMP_DIR/metrics.jsonl` (train, one record per log step) and, when present,
`DUMP_DIR/metrics.eval.jsonl` (validation: `global_step`, `val/loss`, `val/bpb`), and writes to
`DUMP_DIR/plots/` (or `--out`):

* loss.png, bpb.png: train and validation against step;
* lr.png: learning rate; throughput.png: input bytes/s;
* patch_lengths.png (BLT runs): histogram of patch lengths over the run and mean patch length
  against step (the trainer logs `patch_len_mean` / `patch_len_hist`).

Needs matplotlib (`pip install 'bytelatent[plot]'`). A resume from a checkpoint older than the
last logged step moves the records of the steps it logs again to `metrics.replayed.jsonl` (not
plotted), so `metrics.jsonl` has one record per step; in files of older versions, or in
`metrics.eval.jsonl`, a step logged twice is read once: the last record of each step wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bytelatent.errors import DataError, UserError
from bytelatent.trainer.patch_stats import PATCH_LEN_BINS

TRAIN_METRICS = "metrics.jsonl"
EVAL_METRICS = "metrics.eval.jsonl"


def read_records(path: Path) -> list[dict]:
    """Records sorted by global_step, one per step (the last one logged); [] if no file."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a line being written right now
            raise DataError(f"{path}:{number}: not a JSON object") from None
        if "global_step" in record:
            by_step[int(record["global_step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["global_step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _figure(title: str, ylabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_train_val(train, val, key: str, val_key: str, ylabel: str, out: Path, name: str):
    fig, ax = _figure(f"{name}: {ylabel}", ylabel)
    steps, values = series(train, key)
    ax.plot(steps, values, label="train", color="tab:blue", linewidth=1.2)
    v_steps, v_values = series(val, val_key)
    if v_steps:
        ax.plot(v_steps, v_values, "o-", label="validation", color="tab:orange", markersize=4)
    ax.legend()
    return _save(fig, out)


def plot_single(train, key: str, ylabel: str, out: Path, name: str, log_y: bool = False):
    fig, ax = _figure(f"{name}: {ylabel}", ylabel)
    steps, values = series(train, key)
    ax.plot(steps, values, color="tab:green", linewidth=1.2)
    if log_y and values and min(values) > 0:
        ax.set_yscale("log")
    return _save(fig, out)


def plot_patch_lengths(train, out: Path, name: str) -> Path | None:
    hists = [r["patch_len_hist"] for r in train if r.get("patch_len_hist")]
    if not hists:
        return None
    import matplotlib.pyplot as plt

    totals = [sum(column) for column in zip(*hists)]
    n = max(sum(totals), 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    labels = list(PATCH_LEN_BINS[: len(totals)])
    left.bar(labels, [100 * t / n for t in totals], color="tab:purple")
    left.set_title(f"{name}: patch lengths ({n:,} patches)")
    left.set_xlabel("patch length (bytes)")
    left.set_ylabel("% of patches")
    left.grid(True, axis="y", alpha=0.3)
    steps, means = series(train, "patch_len_mean")
    right.plot(steps, means, color="tab:purple", linewidth=1.2)
    right.set_title("mean patch length")
    right.set_xlabel("step")
    right.set_ylabel("bytes per patch")
    right.grid(True, alpha=0.3)
    return _save(fig, out)


def plot_run(dump_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write every plot the run's metrics allow; returns the PNG paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
    except ImportError:
        raise UserError("matplotlib is not installed: pip install 'bytelatent[plot]'") from None
    train = read_records(dump_dir / TRAIN_METRICS)
    if not train:
        raise DataError(f"{dump_dir / TRAIN_METRICS}: no metrics (is {dump_dir} a run's dump_dir?)")
    val = read_records(dump_dir / EVAL_METRICS)
    out_dir = out_dir or dump_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = dump_dir.resolve().name
    written = [
        plot_train_val(train, val, "loss", "val/loss", "loss (nats)", out_dir / "loss.png", name),
        plot_train_val(train, val, "bpb", "val/bpb", "bits per byte", out_dir / "bpb.png", name),
        plot_single(train, "lr", "learning rate", out_dir / "lr.png", name),
        plot_single(train, "bytes_per_s", "bytes/s", out_dir / "throughput.png", name),
    ]
    patches = plot_patch_lengths(train, out_dir / "patch_lengths.png", name)
    return written + ([patches] if patches else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m apps.plot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dump_dir", type=Path, help="a run's dump_dir (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="default: DUMP_DIR/plots")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.dump_dir, args.out)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
