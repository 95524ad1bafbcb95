"""The recipe's subprocesses: the entropy model, its threshold, and each compared training run.

Each step leaves a file that says it is done (`done.json` next to a run's metrics, holding the
exact command; `threshold.json`); a rerun reuses it when the command is the same, and refuses to
mix a run trained with another command into the table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from apps.compare.args import CompareArgs
from bytelatent.errors import ConfigError, DataError, UserError

DONE = "done.json"


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
        record = json.loads(done.read_text())
        if record["argv"] != argv:
            raise ConfigError(
                f"{dump_dir} was trained with another command (see {done}); delete the folder "
                "or choose another out_dir"
            )
        return float(record["wall_s"]), False
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
        record = json.loads(cache.read_text())
        if record["command"] == cmd[1:]:
            return float(record["threshold"]), False
    log = Path(args.out_dir) / "patch_size.out"
    print(f"compare: picking the entropy threshold for {args.bytes_per_patch:g} bytes per patch")
    run_logged(cmd, log, args.threads, "python -m bytelatent.data.patch_size")
    found = re.search(r"^threshold=(\S+)$", log.read_text(), re.MULTILINE)
    if found is None:
        raise UserError(f"patch_size printed no threshold=<value> line (see {log})")
    threshold = float(found.group(1))
    record = {"command": cmd[1:], "threshold": threshold, "output": log.name}
    cache.write_text(json.dumps(record, indent=1) + "\n")
    return threshold, True
