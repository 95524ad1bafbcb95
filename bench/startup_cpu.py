"""Start-up of a short training run: the data loader's fork server started early vs at the first batch.

    PYTHONPATH=. python bench/startup_cpu.py --data data --rounds 5

"early" is `python -m bytelatent.train ...`, which starts the fork server before importing torch
(bytelatent/data/worker_server.py). "lazy" runs the same `main()` through `python -c`, where the
early start does not happen, so the server starts at the first batch as it did before. Each run is
the tiny debug BLT of the tests for 5 steps (data.load_async=true); rows alternate within a round.
Reported: the median wall time of the whole process and the median wait for the first batch
(`data_time_s` of step 1), with the 1-minute load average before and after.
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

from tests.tiny import TINY_BLT_MODEL  # noqa: E402

LAUNCH = {
    "early": ["-m", "bytelatent.train"],
    "lazy": ["-c", "import sys; from bytelatent.train import main; sys.exit(main())"],
}


def run_once(row: str, data: str) -> tuple[float, float]:
    dump = Path(tempfile.mkdtemp(prefix="startup-"))
    args = ["config=configs/debug.yaml", *TINY_BLT_MODEL, f"dump_dir={dump}",
            f"data.root_dir={data}", "data.seq_len=48", "steps=5", "logging.freq=1", "data.load_async=true"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    start = time.perf_counter()
    subprocess.run([sys.executable, *LAUNCH[row], *args], check=True, capture_output=True,
                   env=env, cwd=REPO)  # fmt: skip
    wall = time.perf_counter() - start
    first = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
    return wall, first["data_time_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data", help="a folder holding stdlib/ (data.root_dir)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    results: dict[str, list[tuple[float, float]]] = {row: [] for row in LAUNCH}
    run_once("early", args.data)  # warm-up: page cache, .pyc files
    for i in range(args.rounds):
        order = list(LAUNCH) if i % 2 == 0 else list(reversed(LAUNCH))
        for row in order:
            results[row].append(run_once(row, args.data))
    print(f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{os.cpu_count()} cores, {args.rounds} rounds")  # fmt: skip
    print("| row | median wall (s) | median first-batch wait (s) | walls |")
    print("|---|---|---|---|")
    for row, got in results.items():
        walls = [w for w, _ in got]
        waits = [d for _, d in got]
        shown = " ".join(f"{w:.1f}" for w in walls)
        print(
            f"| {row} | {statistics.median(walls):.2f} | {statistics.median(waits):.2f} | {shown} |"
        )


if __name__ == "__main__":
    main()
