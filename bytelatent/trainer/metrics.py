"""Metrics: the JSONL log, the console line, and `dump_dir/train.log`."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("bytelatent")
LN2 = math.log(2.0)


class LoggingArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    freq: int = Field(10, ge=1, description="log every `freq` optimizer steps")
    console: bool = True
    peak_tflops: float | None = Field(
        None, gt=0, description="per-device peak for MFU; default: known GPUs' dense bf16 peak, none on CPU"
    )


def setup_logging(dump_dir: str | None, rank: int) -> None:
    """Console for every rank (rank-prefixed); `dump_dir/train.log` on rank 0."""
    root = logging.getLogger("bytelatent")
    root.setLevel(logging.INFO)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"{rank}: %(levelname)s %(asctime)s - %(message)s", "%y-%m-%d %H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    if dump_dir and rank == 0:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(dump_dir) / "train.log", mode="a")
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)


def bits_per_byte(loss_sum_nats: float, n_bytes: float) -> float:
    """bpb = Σ cross-entropy (nats) / ln 2 / number of target bytes."""
    return loss_sum_nats / LN2 / max(n_bytes, 1.0)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory: CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


# Dense bf16 tensor-core peaks (TFLOP/s) by device-name substring, from the vendors' datasheets.
GPU_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def peak_flops_per_device(device: torch.device, configured_tflops: float | None) -> float | None:
    """FLOP/s of one device for MFU, or None when unknown (CPU peaks depend on the machine)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


class MetricLogger:
    """Appends one JSON object per call to `path` (rank 0 only) and flushes it."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)

    def log(self, metrics: dict) -> None:
        if self._fh is None:
            return
        record = {"created_at": datetime.now(timezone.utc).isoformat(), **metrics}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class Timer:
    """Wall-clock accumulator for step and data time within a log interval."""

    def __init__(self):
        self.data = 0.0
        self.step = 0.0
        self._t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        return dt

    def reset(self) -> None:
        self.data = 0.0
        self.step = 0.0


def console_line(m: dict) -> str:
    return (
        f"step {m['global_step']:>6} | loss {m['loss']:.4f} | bpb {m['bpb']:.4f} | "
        f"grad {m['grad_norm']:.3g} | lr {m['lr']:.3g} | {m['bytes_per_s']:.0f} B/s | "
        f"{m['flops_per_s'] / 1e9:.1f} GFLOP/s | "
        + (f"mfu {100 * m['mfu']:.1f}% | " if "mfu" in m else "")
        + f"step {1000 * m['step_time_s']:.0f} ms | "
        f"data {1000 * m['data_time_s']:.0f} ms | mem {m['peak_mem_gib']:.2f} GiB"
    )
