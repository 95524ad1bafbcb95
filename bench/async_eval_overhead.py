"""Does launching async evals slow training down? Wall time of the same training with and without.

Both rows train configs/debug.yaml (`--model debug`, 2.4M parameters, or `--model tiny`, the
test suite's 170k-parameter widths, for a loaded machine; trainer and eval 1 thread each) for
`--steps` steps with the same
`checkpoint.eval.every` saves; the `local` row also launches an eval job (`python -m
bytelatent.eval`, CPU, niced, 1 thread) on each of them, the `off` row does not. Rows alternate
(off, local, local, off, ...) so the machine's background load falls on both alike; the table
shows medians. The trainer's wall time is the whole process (start to exit; it never waits for
evals: `wait_on_exit_s=0`); between runs the bench waits for the previous run's eval jobs to end,
outside the timing.

    python bench/async_eval_overhead.py --data data --model tiny --repeats 3 --steps 200 --every 50
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
TINY = [
    "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.dim_local_encoder=32",
    "model.dim_local_decoder=32", "model.n_heads_local_encoder=2", "model.n_heads_local_decoder=2",
    "model.cross_attn_nheads=2", "model.n_layers_local_decoder=1",
    "model.encoder_hash_byte_group_vocab=257", "model.max_encoder_seq_length=256",
    "model.local_attention_window_len=64", "data.max_encoder_seq_length=256", "data.seq_len=48",
    "model.max_seqlen=48", "data.load_async=false",
]  # fmt: skip


def run(row: str, data: str, steps: int, every: int, dump: Path, model: str) -> float:
    args = [
        sys.executable, "-m", "bytelatent.train", "config=configs/debug.yaml", f"dump_dir={dump}",
        f"data.root_dir={data}", f"steps={steps}", f"checkpoint.eval.every={every}",
        "checkpoint.dump.every=0", "logging.console=false", "eval.validation.max_batches=8",
        "num_threads=1", *(TINY if model == "tiny" else []),
    ]  # fmt: skip
    if row == "local":
        args += ["eval.async_launch.mode=local", "eval.async_launch.nice=19",
                 "eval.async_launch.num_threads=1", "eval.async_launch.poll_interval_s=2"]  # fmt: skip
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(args, cwd=REPO, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    if row == "local":  # let its eval jobs finish before the next run (not timed)
        deadline = time.monotonic() + 600
        while list((dump / "checkpoints").glob("*/.lease.*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        n = len(list((dump / "evals").glob("*/results.json")))
        assert n == steps // every, f"{n} results for {steps // every} eval checkpoints"
    return wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data", help="data.root_dir holding stdlib/")
    parser.add_argument("--model", choices=["tiny", "debug"], default="tiny")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--out", default=None, help="also write the raw times here (JSON)")
    opts = parser.parse_args()
    times: dict[str, list[float]] = {"off": [], "local": []}
    with tempfile.TemporaryDirectory() as tmp:
        run(
            "off", opts.data, 10, 10, Path(tmp) / "warmup", opts.model
        )  # warm the page cache and imports
        for i in range(opts.repeats):
            for row in ("off", "local") if i % 2 == 0 else ("local", "off"):
                wall = run(
                    row, opts.data, opts.steps, opts.every, Path(tmp) / f"{row}{i}", opts.model
                )
                times[row].append(wall)
                print(f"run {i} {row:5s} {wall:7.2f} s", flush=True)
    off, local = statistics.median(times["off"]), statistics.median(times["local"])
    # runs i of both rows are adjacent in time: their ratio is the least drift-prone estimate
    ratios = [b / a for a, b in zip(times["off"], times["local"])]
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print(
        f"per-pair local/off: {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.3f}"
    )
    print("| row | trainer wall s (median) | runs |")
    print("|---|---|---|")
    print(f"| async evals off | {off:.2f} | {', '.join(f'{t:.1f}' for t in times['off'])} |")
    print(f"| async evals local | {local:.2f} | {', '.join(f'{t:.1f}' for t in times['local'])} |")
    print(
        f"\noverhead: {100 * (local / off - 1):+.1f}% ({opts.steps // opts.every} eval jobs per run)"
    )
    if opts.out:
        Path(opts.out).write_text(json.dumps(times))


if __name__ == "__main__":
    main()
