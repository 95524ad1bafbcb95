"""What verifying CRC32s at resume costs: load a ~1 GB checkpoint with checkpoint.verify=size and
with the default checkpoint.verify=checksum, and the checksum pass alone.

    PYTHONPATH=. python bench/checkpoint_verify.py [--gib 1.0] [--repeats 3] [--dir /tmp/ckbench]

Prints one table; run on a quiet machine. Files come from the page cache after the first read
(the save just wrote them), so this is the CPU cost of CRC32 (zlib) plus one more read of each
file; on a network filesystem the extra read is I/O as well.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time

import torch

from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.verify import verify_step_folder


def build(gib: float) -> torch.nn.Module:
    """A model of `gib` GiB of float32 weights in 64 MiB tensors (DCP writes one file per rank)."""
    n = max(1, round(gib * 16))
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(16 << 20) / 8, requires_grad=False) for _ in range(n)]
    )
    return model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    root = args.dir or tempfile.mkdtemp(prefix="ckbench-")
    try:
        model = build(args.gib)
        saver = CheckpointManager(CheckpointArgs(path=root, verify="size"))
        folder = saver.save(1, model, None, {"step": 1})
        size = sum(p.numel() * 4 for p in model.parameters()) / 2**30
        rows: dict[str, list[float]] = {"load, verify=size": [], "load, verify=checksum": [],
                                        "checksum pass alone": []}  # fmt: skip
        for _ in range(args.repeats):  # interleaved, so machine noise hits every row alike
            for mode in ("size", "checksum"):
                manager = CheckpointManager(CheckpointArgs(path=root, verify=mode))
                rows[f"load, verify={mode}"].append(timed(lambda m=manager: m.load(model, None)))
            rows["checksum pass alone"].append(
                timed(lambda: verify_step_folder(folder, checksum=True))
            )
        print(f"torch {torch.__version__}, checkpoint {size:.2f} GiB, medians of {args.repeats}")
        base = statistics.median(rows["load, verify=size"])
        for name, values in rows.items():
            median = statistics.median(values)
            extra = f"  +{(median - base) / base:.0%}" if name.endswith("checksum") else ""
            print(f"{name:24s} {median:7.2f} s  ({size / median:.2f} GiB/s){extra}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
