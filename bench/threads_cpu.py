"""Debug-BLT training step time: the default thread choice vs all cores, on a quiet and a loaded machine.

    PYTHONPATH=. python bench/threads_cpu.py --data data --steps 30 --rounds 2

Each row is a fresh `python -m bytelatent.train` run (its own dump_dir, data.load_async=true so the
data worker runs beside the trainer); rows are interleaved per round. "loaded" starts one
busy-looping process per core beside the run, as another job on a shared machine would. The
number is the median `step_time_s` of the run's log lines after the first (warm-up) one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = {"default": [], "all-cores": [f"num_threads={os.cpu_count()}"]}


def _spin() -> None:
    while True:
        pass


def run_once(data: str, steps: int, extra: list[str]) -> float:
    dump = Path(tempfile.mkdtemp(prefix="threads-"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "bytelatent.train", "config=configs/debug.yaml", f"dump_dir={dump}",
           f"data.root_dir={data}", f"steps={steps}", "logging.freq=5", "checkpoint.dump.every=100000",
           *extra]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    lines = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in lines[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in ("quiet", "loaded"):
            spinners = [mp.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
            if load == "loaded":
                for p in spinners:
                    p.start()
            try:
                for name, extra in ROWS.items():
                    t = run_once(args.data, args.steps, extra)
                    results.setdefault((load, name), []).append(t)
                    print(f"{load:7} {name:10} step_time_s={t:.3f}", flush=True)
            finally:
                for p in spinners:
                    if p.is_alive():
                        p.terminate()
    print(f"\n{'load':7} {'row':10} median step_time_s (cores: {os.cpu_count()})")
    for (load, name), ts in results.items():
        print(f"{load:7} {name:10} {statistics.median(ts):.3f}")


if __name__ == "__main__":
    main()
