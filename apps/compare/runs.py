"""The recipe's subprocesses: the entropy model, its threshold, and every training run.

Each run leaves `done.json` next to its metrics, holding the exact trainer command, its wall and
CPU seconds; a rerun reuses it when the command is the same and refuses (one line) a run folder
trained with another command. `threshold.json` does the same for the entropy threshold.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


@dataclass
class Job:
    """One `python -m bytelatent.train` run of a row at a learning rate and a seed."""

    row: str
    lr: float
    seed: int
    dump_dir: Path
    argv: list[str]  # complete: dump_dir, seed and lr included
    title: str = ""  # what to call it when it is not a row's run (the entropy model)

    @property
    def label(self) -> str:
        return self.title or f"{self.row} lr={self.lr:g} seed={self.seed}"

    def done(self) -> dict | None:
        """done.json when this exact command finished; ConfigError for another command."""
        path = self.dump_dir / DONE
        if not path.exists():
            return None
        redo = f"train {self.label} again"
        record = read_record(path, ("argv", "wall_s"), redo)
        for key in ("wall_s", "cpu_s"):
            if key not in record:
                raise DataError(f"{path}: damaged (no {key!r}); delete it to {redo}")
            value = record[key]
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise DataError(f"{path}: damaged ({key}={value!r}); delete it to {redo}")
        if record["argv"] != self.argv:
            raise ConfigError(
                f"{self.dump_dir} was trained with another command (see {path}); the config "
                "changed: delete that folder or choose another out_dir"
            )
        return record


def make_job(out_dir: str, sized, lr: float, seed: int, tag: str = "") -> Job:
    """The run of a sized row at `lr` and `seed`: the seed is the trainer's and the weight
    initialisation's (`model.seed`, which the top-level seed does not set)."""
    size = sized.size.replace("=", "-") or "as-configured"
    dump_dir = Path(out_dir) / "runs" / sized.name / size / f"lr{lr:g}_seed{seed}{tag}"
    seeds = [f"seed={seed}", f"model.seed={seed}"]
    full = [*sized.argv, f"dump_dir={dump_dir}", *seeds, f"optim.lr={lr!r}"]
    return Job(sized.name, lr, seed, dump_dir, full)


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_logged(cmd: list[str], log: Path, threads: int, what: str, nice: int = 0):
    """Run `cmd` with its output in `log`: (wall s, CPU s of the process and its children), or
    a one-line error naming the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["nice", "-n", str(nice), *cmd] if nice else cmd,
            stdout=out, stderr=subprocess.STDOUT, env=_env(threads),
        )  # fmt: skip
        # wait4: this child's own rusage, right even while other runs finish in other threads
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
        raise UserError(f"{what} failed (exit {proc.returncode}, see {log}): {' '.join(tail)}")
    return seconds, usage.ru_utime + usage.ru_stime


def train_job(job: Job, threads: int, nice: int = 0) -> dict:
    """Train one run (a fresh start: an interrupted one's folder is cleared); its done record."""
    cmd = [sys.executable, "-m", "bytelatent.train", *job.argv]
    if job.dump_dir.exists():
        import shutil

        shutil.rmtree(job.dump_dir)  # an interrupted run: no done.json, start it again
    wall, cpu = run_logged(cmd, job.dump_dir / "train.out", threads, f"training {job.label}", nice)
    record = {"argv": job.argv, "wall_s": wall, "cpu_s": cpu}
    (job.dump_dir / DONE).write_text(json.dumps(record, indent=1) + "\n")
    return record


class Progress:
    """One line per run as it starts and ends, with an estimate of what is left."""

    def __init__(self, total: int, parallel: int):
        self.total, self.parallel, self.started, self.finished = total, parallel, 0, 0
        self.walls: list[float] = []
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()

    def start(self, job: Job) -> None:
        with self.lock:
            self.started += 1
            print(f"compare: [{self.started}/{self.total}] start {job.label} "
                  f"({job.dump_dir / 'train.out'})", flush=True)  # fmt: skip

    def end(self, job: Job, record: dict, summary: str) -> None:
        with self.lock:
            self.finished += 1
            self.walls.append(record["wall_s"])
            left = self.total - self.finished
            mean = sum(self.walls) / len(self.walls)
            eta = left * mean / min(self.parallel, max(left, 1))
            print(f"compare: [{self.finished}/{self.total}] done  {job.label} in "
                  f"{record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} CPU-s, {summary}; "
                  f"{left} run(s) left, ~{eta / 60:.1f} min at this pace", flush=True)  # fmt: skip


def run_local(jobs: list[Job], args: CompareArgs, summary) -> None:
    """Train `jobs` (none already done), `args.parallel` at a time; stops at the first failure."""
    progress = Progress(len(jobs), args.parallel)
    failed: list[BaseException] = []

    def one(job: Job) -> None:
        if failed:
            return
        progress.start(job)
        try:
            record = train_job(job, args.threads, args.nice)
        except BaseException as e:  # noqa: BLE001 - reported once, after the pool drains
            failed.append(e)
            return
        progress.end(job, record, summary(job))

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(one, jobs))
    if failed:
        raise failed[0]


def entropy_model(args: CompareArgs) -> tuple[str, float, bool]:
    """A consolidated entropy model folder: the given one, or trained and consolidated here."""
    if args.entropy.checkpoint is not None:
        if not (Path(args.entropy.checkpoint) / "params.json").exists():
            raise ConfigError(
                f"entropy.checkpoint={args.entropy.checkpoint}: no params.json (a consolidated "
                "folder: python -m bytelatent.checkpoint consolidate STEP_DIR)"
            )
        return args.entropy.checkpoint, 0.0, False
    dump_dir = Path(args.out_dir) / "entropy"
    argv = [
        f"config={args.entropy.config}",
        *args.entropy.overrides,
        f"dump_dir={dump_dir}",
        f"steps={args.entropy.steps}",
        f"seed={args.seeds[0]}",
        f"data.root_dir={args.data_root}",
        f"data.sources={{{args.source}: 1.0}}",
        f"checkpoint.dump.every={args.entropy.steps}",
    ]
    job = Job("entropy", 0.0, args.seeds[0], dump_dir, argv, title="the entropy model")
    record, ran = job.done(), False
    if record is None:
        print(f"compare: training the BLT's entropy model ({dump_dir / 'train.out'})", flush=True)
        record, ran = train_job(job, args.threads, args.nice), True
    step_dir = dump_dir / "checkpoints" / f"{args.entropy.steps:010d}"
    consolidated = step_dir / "consolidated"
    if not (consolidated / "params.json").exists():
        cmd = [sys.executable, "-m", "bytelatent.checkpoint", "consolidate", str(step_dir)]
        run_logged(
            cmd, dump_dir / "consolidate.out", args.threads, "consolidating the entropy model"
        )
    return str(consolidated), record["wall_s"], ran


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
