"""Start of the data loader's worker: what a short training run costs with two source trees.

    OMP_NUM_THREADS=1 python bench/worker_start.py --data data --tree new=. --tree old=PATH --rounds 5

Each run is `python -m bytelatent.train` on a tiny model of the tests (tests/tiny.py) for 20
steps with `data.load_async=true`, one process: the entropy model (its worker does not patch) and
the debug BLT (its worker patches). Rows alternate within a round, after one warm-up run of each.
Reported per row: median wall time, median wait for the first batch (`data_time_s` of step 1)
and median CPU seconds of the whole machine during the run (/proc/stat: the trainer, its fork
server and the worker, which `getrusage` would miss: nobody waits for the fork server), with the
1-minute load average before and after. Run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.tiny import TINY_BLT_MODEL, TINY_ENTROPY_MODEL  # noqa: E402

MODELS = {
    "entropy": ["config=configs/entropy_debug.yaml", *TINY_ENTROPY_MODEL, "data.seq_len=64"],
    "blt": ["config=configs/debug.yaml", *TINY_BLT_MODEL, "data.seq_len=48"],
}
COMMON = ["steps=20", "logging.freq=1", "data.load_async=true", "checkpoint.dump.every=0",
          "num_threads=1"]  # fmt: skip


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system = (int(v) for v in f.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def run_once(tree: str, model: str, data: str) -> tuple[float, float, float]:
    dump = Path(tempfile.mkdtemp(prefix="worker-start-"))
    argv = [*MODELS[model], *COMMON, f"dump_dir={dump}", f"data.root_dir={os.path.abspath(data)}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.abspath(tree))
    cpu0, t0 = machine_cpu_s(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "bytelatent.train", *argv], cwd=tree, env=env,
                   check=True, capture_output=True)  # fmt: skip
    wall = time.perf_counter() - t0
    time.sleep(0.5)  # the fork server and the worker exit after the trainer
    cpu = machine_cpu_s() - cpu0
    first = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
    return wall, first["data_time_s"], cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="data.root_dir holding stdlib/")
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    rows = [(model, name) for model in MODELS for name in trees]
    for model, name in rows:  # warm-up: page cache, .pyc files
        run_once(trees[name], model, args.data)
    load_before = os.getloadavg()[0]
    samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {r: [] for r in rows}
    for _ in range(args.rounds):
        for model, name in rows:
            samples[model, name].append(run_once(trees[name], model, args.data))
    print(f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} rounds\n")  # fmt: skip
    print(
        "| model | tree | median wall (s) | median first-batch wait (s) | median machine CPU (s) |"
    )
    print("|---|---|---|---|---|")
    for model, name in rows:
        walls, waits, cpus = zip(*samples[model, name])
        print(f"| {model} | {name} | {statistics.median(walls):.2f} | "
              f"{statistics.median(waits):.2f} | {statistics.median(cpus):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
