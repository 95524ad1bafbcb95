"""The recipe's subprocesses: the entropy model, its threshold, and each compared training run.

Each step leaves a file that says it is done (`done.json` next to a run's metrics, holding the
exact command; `threshold.json`); a rerun reuses it when the command is the same, and refuses to
mix a run trained with another command into the table.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from apps.compare.args import CompareArgs
from bytelatent.errors import ConfigError, DataError, UserError

DONE = "done.json"


def read_record(path: Path, keys: tuple[str, ...], redo: str) -> dict:
    """A step's JSON record with `keys`; a damaged one (a kill mid-write, an edit) is one line
    saying to delete it (`redo`: what the next run then does again)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); delete it to {redo}") from None
    missing = [k for k in keys if not isinstance(record, dict) or k not in record]
    if missing:
        raise DataError(f"{path}: damaged (no {missing[0]!r}); delete it to {redo}")
    return record


def checked_threshold(value: object, where: str, redo: str) -> float:
    """An entropy threshold: a finite number >= 0 (entropies are), else one line."""
    try:
        threshold = float(value)
    except (TypeError, ValueError):
        threshold = float("nan")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise DataError(f"{where}: threshold {value!r} is not a finite number >= 0; {redo}")
    return threshold


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_logged(cmd: list[str], log: Path, threads: int, what: str) -> float:
    """Run `cmd` with its output in `log`; wall seconds, or a one-line error naming the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(threads))
    seconds = time.perf_counter() - start
    if code != 0:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
        raise UserError(f"{what} failed (exit {code}, see {log}): {' '.join(tail)}")
    return seconds


def train(name: str, argv: list[str], dump_dir: Path, threads: int) -> tuple[float, bool]:
    """Train (or reuse) one run; (wall seconds of the training command, whether it ran now)."""
    done = dump_dir / DONE
    if done.exists():
        record = read_record(done, ("argv", "wall_s"), f"train {name} again")
        if record["argv"] != argv:
            raise ConfigError(
                f"{dump_dir} was trained with another command (see {done}); delete the folder "
                "or choose another out_dir"
            )
        wall_s = record["wall_s"]
        if not isinstance(wall_s, int | float) or not math.isfinite(wall_s) or wall_s < 0:
            raise DataError(f"{done}: damaged (wall_s={wall_s!r}); delete it to train {name} again")
        return float(wall_s), False
    print(f"compare: training {name} ({dump_dir / 'train.out'})", flush=True)
    cmd = [sys.executable, "-m", "bytelatent.train", *argv]
    seconds = run_logged(cmd, dump_dir / "train.out", threads, f"training {name}")
    done.write_text(json.dumps({"argv": argv, "wall_s": seconds}, indent=1) + "\n")
    return seconds, True


def entropy_model(args: CompareArgs) -> tuple[str, float, bool]:
    """A consolidated entropy model folder: the given one, or trained and consolidated here."""
    if args.entropy.checkpoint is not None:
        if not (Path(args.entropy.checkpoint) / "params.json").exists():
            raise ConfigError(
                f"entropy.checkpoint={args.entropy.checkpoint}: no params.json (a consolidated "
                "folder: python -m bytelatent.checkpoint consolidate STEP_DIR)"
            )
        return args.entropy.checkpoint, 0.0, False
    dump_dir = Path(args.out_dir) / "runs" / "entropy"
    argv = [
        f"config={args.entropy.config}",
        *args.entropy.overrides,
        f"dump_dir={dump_dir}",
        f"steps={args.entropy.steps}",
        f"seed={args.seed}",
        f"data.root_dir={args.data_root}",
        f"data.sources={{{args.source}: 1.0}}",
        f"checkpoint.dump.every={args.entropy.steps}",
    ]
    seconds, ran = train("entropy model", argv, dump_dir, args.threads)
    step_dir = dump_dir / "checkpoints" / f"{args.entropy.steps:010d}"
    consolidated = step_dir / "consolidated"
    if not (consolidated / "params.json").exists():
        cmd = [sys.executable, "-m", "bytelatent.checkpoint", "consolidate", str(step_dir)]
        run_logged(
            cmd, dump_dir / "consolidate.out", args.threads, "consolidating the entropy model"
        )
    return str(consolidated), seconds, ran


def corpus_files(args: CompareArgs) -> str:
    """The training shards of the corpus (a glob patch_size reads; validation file excluded)."""
    folder = Path(args.data_root) / args.source
    if not folder.is_dir():
        raise DataError(
            f"{folder}: no such corpus folder (python -m bytelatent.data.prepare --out {folder})"
        )
    return str(folder / f"{args.source}.chunk.*.jsonl")


def pick_threshold(args: CompareArgs, entropy_dir: str) -> tuple[float, bool]:
    """`python -m bytelatent.data.patch_size` for N bytes per patch on the training corpus."""
    cmd = [
        sys.executable, "-m", "bytelatent.data.patch_size",
        "--target-mean", f"{args.bytes_per_patch}",
        "--entropy-model", entropy_dir,
        "--text", corpus_files(args),
        "--sample-bytes", str(args.entropy.sample_bytes),
        "--device", "cpu",
    ]  # fmt: skip
    cache = Path(args.out_dir) / "threshold.json"
    if cache.exists():
        redo = "delete it to pick the threshold again"
        record = read_record(cache, ("command", "threshold"), "pick the threshold again")
        if record["command"] == cmd[1:]:
            return checked_threshold(record["threshold"], str(cache), redo), False
    log = Path(args.out_dir) / "patch_size.out"
    print(f"compare: picking the entropy threshold for {args.bytes_per_patch:g} bytes per patch")
    run_logged(cmd, log, args.threads, "python -m bytelatent.data.patch_size")
    found = re.search(r"^threshold=(\S+)$", log.read_text(), re.MULTILINE)
    if found is None:
        raise UserError(f"patch_size printed no threshold=<value> line (see {log})")
    threshold = checked_threshold(found.group(1), f"patch_size (see {log})", "check its output")
    record = {"command": cmd[1:], "threshold": threshold, "output": log.name}
    cache.write_text(json.dumps(record, indent=1) + "\n")
    return threshold, True
