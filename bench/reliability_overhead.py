"""Cost of the reliability features, side by side in one process (CPU):

* optimizer step with vs without the non-finite guard (foreach and fused AdamW, ~4M params);
* manifest CRC32 throughput (what a save pays per byte written, and `verify=checksum` per byte read).

    PYTHONPATH=. python bench/reliability_overhead.py [--params-m 4] [--file-mb 256] [--repeats 15]

Prints medians after a warm-up; the machine is shared, so compare rows of one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.verify import file_digest
from bytelatent.trainer.guard import NonFiniteGuard


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_step(params_m: float, fused: bool, repeats: int) -> tuple[float, float]:
    dim = int((params_m * 1e6 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(4)])
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused,
                                  foreach=None if fused else True)  # fmt: skip
    guard = NonFiniteGuard(optimizer, torch.device("cpu"))
    loss = torch.tensor(1.0, dtype=torch.float64)
    norm = torch.tensor(1.0)
    # Interleaved, so that load from other users hits both columns alike.
    optimizer.step()
    guard.step(loss, norm)
    plain, guarded = [], []
    for _ in range(repeats):
        for fn, out in ((optimizer.step, plain), (lambda: guard.step(loss, norm), guarded)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return 1000 * statistics.median(plain), 1000 * statistics.median(guarded)


class _NoOpOptimizer:
    defaults = {"fused": False}

    def step(self) -> None:
        pass


def bench_guard_alone(repeats: int) -> float:
    """Microseconds of the guard's own device ops per step (the optimizer step does nothing)."""
    guard = NonFiniteGuard(_NoOpOptimizer(), torch.device("cpu"))
    loss, norm = torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0)

    def hundred() -> None:
        for _ in range(100):
            guard.step(loss, norm)

    return 10 * _median_ms(hundred, repeats)  # ms per 100 steps -> us per step


def bench_crc(file_mb: int, repeats: int) -> float:
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(os.urandom(file_mb << 20))
        path = f.name
    try:
        fs = cfs.get_fs(path)
        ms = _median_ms(lambda: file_digest(fs, path), max(3, repeats // 3))
    finally:
        os.remove(path)
    return file_mb / (ms / 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=4.0)
    parser.add_argument("--file-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    a = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {a.params_m:g}M params, medians of {a.repeats}")
    print(f"{'optimizer':<10} {'plain ms':>9} {'guarded ms':>11} {'overhead':>9}")
    for fused in (False, True):
        plain, guarded = bench_step(a.params_m, fused, a.repeats)
        name = "fused" if fused else "foreach"
        print(f"{name:<10} {plain:>9.2f} {guarded:>11.2f} {100 * (guarded / plain - 1):>8.1f}%")
    print(f"guard bookkeeping alone: {bench_guard_alone(a.repeats):.0f} us per step")
    print(f"manifest CRC32 (page cache): {bench_crc(a.file_mb, a.repeats):.0f} MB/s")


if __name__ == "__main__":
    main()
