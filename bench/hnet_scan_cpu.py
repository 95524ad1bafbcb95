"""The H-Net dechunk EMA on CPU: the blocked parallel scan (bytelatent.archs.hnet.dc.ema_scan)
against a sequential loop over positions, one thread, fp32.

Each row is one call on ``[B, L, D]`` (decay shared by the channels of a position, resets at a
few document starts), forward only and forward + backward. Methods and lengths are interleaved
within each round (same machine load for all); the table shows medians over rounds of wall
seconds and process CPU seconds (user + system of this process).

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/hnet_scan_cpu.py --lengths 2048 8192 --dim 256 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bytelatent.archs.hnet.dc.ema import ema_scan, ema_scan_sequential  # noqa: E402


def make_inputs(batch: int, length: int, dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(length)
    prob = torch.rand(batch, length, generator=gen).clamp(1e-4, 1 - 1e-4)
    inputs = torch.randn(batch, length, dim, generator=gen)
    reset = torch.zeros(batch, length, dtype=torch.bool)
    reset[:, :: max(length // 4, 1)] = True  # four documents per row
    return torch.log1p(-prob), inputs, reset


def run_once(method: str, data: tuple[torch.Tensor, ...], backward: bool) -> tuple[float, float]:
    log_decay, inputs, reset = data
    if backward:
        log_decay = log_decay.clone().requires_grad_(True)
        inputs = inputs.clone().requires_grad_(True)
    wall, cpu = time.perf_counter(), time.process_time()
    if method == "sequential":
        states = ema_scan_sequential(log_decay, inputs, reset)
    else:
        states = ema_scan(log_decay, inputs, reset, block_size=int(method.split("=")[1]))
    if backward:
        states.sum().backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    methods = ["sequential", *(f"block={size}" for size in args.blocks)]
    data = {length: make_inputs(args.batch, length, args.dim) for length in args.lengths}
    for length in args.lengths:  # the parallel scan agrees with the loop before anything is timed
        want = ema_scan_sequential(*data[length])
        err = (ema_scan(*data[length]) - want).abs().max().item()
        print(f"L={length}: max |parallel - sequential| = {err:.2e} (fp32)")
    runs: dict[tuple, list[tuple[float, float]]] = {}
    for method in methods:  # warm-up
        run_once(method, data[args.lengths[0]], backward=True)
    for _ in range(args.rounds):
        for length in args.lengths:
            for backward in (False, True):
                for method in methods:
                    key = (length, backward, method)
                    runs.setdefault(key, []).append(run_once(method, data[length], backward))
    print(f"\nB={args.batch} D={args.dim} fp32, 1 thread, median of {args.rounds} rounds")
    print("| L | pass | method | wall s | CPU s | vs sequential (wall) |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        for backward in (False, True):
            base = statistics.median(w for w, _ in runs[(length, backward, "sequential")])
            for method in methods:
                walls, cpus = zip(*runs[(length, backward, method)])
                wall, cpu = statistics.median(walls), statistics.median(cpus)
                name = "fwd+bwd" if backward else "fwd"
                print(
                    f"| {length} | {name} | {method} | {wall:.4f} | {cpu:.4f} | {base / wall:.1f}x |"
                )


if __name__ == "__main__":
    main()
