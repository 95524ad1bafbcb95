"""Metrics: one `MetricLogger.log(m)` call fans out to sinks (metrics.jsonl, console, wandb).

Also the console line, `dump_dir/train.log`, and `Timings` (the `timing/*` metrics).
"""

from __future__ import annotations

import contextlib
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

from bytelatent.trainer.args import LoggingArgs
from bytelatent.trainer.run_files import LineAppender, QuietStreamHandler, RunLogHandler
from bytelatent.trainer.wandb_sink import WandbSink

logger = logging.getLogger("bytelatent")
LN2 = math.log(2.0)


def setup_logging(dump_dir: str | None, rank: int) -> None:
    """Console for every rank (rank-prefixed); `dump_dir/train.log` on rank 0 (whole lines; a full
    disk stops it quietly and ends the run with one line, see `run_files`)."""
    root = logging.getLogger("bytelatent")
    root.setLevel(logging.INFO)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"{rank}: %(levelname)s %(asctime)s - %(message)s", "%y-%m-%d %H:%M:%S")
    stream = QuietStreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    stream.addFilter(lambda record: not getattr(record, "file_only", False))
    root.addHandler(stream)
    if dump_dir and rank == 0:
        file_handler = RunLogHandler(Path(dump_dir) / "train.log")
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


# Dense (no sparsity) peaks in TFLOP/s per device, from the vendors' datasheets, keyed by the exact
# name torch.cuda.get_device_name reports: "H100" alone would give an H100 PCIe the SXM peak.
# Columns: bf16/fp16 tensor cores, tf32 tensor cores, fp32 without tensor cores.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "NVIDIA H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM5
    "NVIDIA H100 PCIe": {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "NVIDIA H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "NVIDIA A100-SXM4-40GB": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "NVIDIA A100 80GB PCIe": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "NVIDIA A100-PCIE-40GB": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "NVIDIA L40S": {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA A10G": {"bf16": 70.0, "tf32": 35.0, "fp32": 31.2},
}


def peak_column(model_dtype: str, allow_tf32: bool) -> str:
    """Which peak a run's matmuls can reach: bf16/fp16 tensor cores, tf32, or plain fp32."""
    if model_dtype in ("bf16", "fp16"):
        return "bf16"
    return "tf32" if allow_tf32 else "fp32"


def peak_flops_per_device(
    device: torch.device,
    configured_tflops: float | None,
    model_dtype: str = "bf16",
    allow_tf32: bool = False,
) -> float | None:
    """FLOP/s of one device for MFU, or None when unknown (CPU peaks depend on the machine; a GPU
    missing from the table is named once so that `logging.peak_tflops` can be set)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = GPU_PEAK_TFLOPS.get(name)
    if peaks is None:
        logger.warning("no peak FLOP/s known for %r: no mfu; set logging.peak_tflops", name)
        return None
    return peaks[peak_column(model_dtype, allow_tf32)] * 1e12


class JsonlSink:
    """Appends one JSON object per record to `path`, as a whole line or not at all (a partial last
    line left by a kill is cut off when the file is opened again; a full disk is a DiskError)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lines = LineAppender(self.path)

    def log(self, metrics: dict) -> None:
        record = {"created_at": datetime.now(timezone.utc).isoformat(), **metrics}
        self._lines.append(json.dumps(record) + "\n")

    def close(self, exit_code: int = 0) -> None:  # noqa: ARG002 - the sink interface
        self._lines.close()


class ConsoleSink:
    """The one-line summary of a train record; other records (eval, ...) as `key value` pairs.

    `health`: name prefixes of the architecture's own metrics (its spec's `aux_metrics`, logged
    as `aux/<prefix><part>`), shown on the step line after the throughput fields."""

    def __init__(self, health: tuple[str, ...] = ()):
        self.health = tuple(health)

    def log(self, metrics: dict) -> None:
        if all(k in metrics for k in _CONSOLE_KEYS):
            logger.info(console_line(metrics, self.health))
        else:
            logger.info(generic_line(metrics))

    def close(self, exit_code: int = 0) -> None:
        pass


class MetricLogger:
    """One `log(metrics)` call, many sinks; the caller never knows which are on.

    `MetricLogger(path)` is the JSONL-only logger (None: logs nothing, as on ranks > 0).
    Every record carries `global_step`; sinks may rely on it.
    """

    def __init__(self, path: str | os.PathLike | None = None, sinks: list | None = None):
        self.sinks = list(sinks or [])
        if path is not None:
            self.sinks.insert(0, JsonlSink(path))

    @classmethod
    def build(
        cls,
        args: LoggingArgs,
        dump_dir: str,
        rank: int,
        name: str,
        config: dict,
        start_step: int = 0,
        health: tuple[str, ...] = (),
    ) -> MetricLogger:
        """metrics.jsonl, console and wandb on rank 0; nothing on the other ranks.

        `start_step`: the step the run resumed at (0: a new run), for sinks that continue a run.
        `health`: the architecture's metric prefixes for the console line (`ConsoleSink`).
        """
        if rank != 0:
            return cls()
        sinks: list = [JsonlSink(os.path.join(dump_dir, "metrics.jsonl"))]
        if args.console:
            sinks.append(ConsoleSink(health))
        if args.wandb is not None:
            sinks.append(WandbSink(args.wandb, dump_dir, name, config, start_step))
        return cls(sinks=sinks)

    def log(self, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def log_external(self, metrics: dict) -> None:
        """A record another component already stored in its own file (evaluation results): only
        the sinks that mirror every record elsewhere (wandb) get it."""
        for sink in self.sinks:
            if getattr(sink, "mirrors_all", False):
                sink.log(metrics)

    def set_summary(self, values: dict) -> None:
        """Run-level values (parameter count, ...) for sinks that keep them (wandb)."""
        for sink in self.sinks:
            if hasattr(sink, "set_summary"):
                sink.set_summary(values)

    def close(self, exit_code: int = 0) -> None:
        for sink in self.sinks:
            sink.close(exit_code)
        self.sinks = []


class Timings:
    """`timing/*` metrics: durations recorded anywhere, reported once with the next log record.

    The trainer owns one; `with timings.measure("eval_s"): ...` (or `record`) adds to
    `timing/eval_s` of the next record, `pop()` hands them over and starts afresh. `measure`
    also keeps when the work ran (`within`), so throughput can leave out the non-step work (eval,
    saves) that fell inside a log interval; `sync` (the device's synchronize) runs before each
    measured block, so device work the steps queued before it is not counted as that work.
    """

    def __init__(self, now=time.perf_counter, sync=None):
        self._now, self._sync = now, sync
        self._pending: dict[str, float] = {}
        self._spans: list[tuple[float, float]] = []  # (start, end) of each measured block
        self._last_log = now()

    def record(self, name: str, seconds: float) -> None:
        key = f"timing/{name}"
        self._pending[key] = self._pending.get(key, 0.0) + seconds

    @contextlib.contextmanager
    def measure(self, name: str):
        if self._sync is not None:
            self._sync()
        t0 = self._now()
        try:
            yield
        finally:
            t1 = self._now()
            self._spans.append((t0, t1))
            self.record(name, t1 - t0)

    def within(self, start: float, end: float) -> float:
        """Seconds of measured work between host times `start` and `end` (since the last pop)."""
        return sum(max(0.0, min(t1, end) - max(t0, start)) for t0, t1 in self._spans)

    def start_interval(self) -> None:
        self._last_log = self._now()

    def pop(self, steps: int) -> dict[str, float]:
        """Pending durations, plus `timing/steps_per_s` over the wall time since the last pop."""
        now = self._now()
        out = {**self._pending, "timing/steps_per_s": steps / max(now - self._last_log, 1e-9)}
        self._pending, self._spans, self._last_log = {}, [], now
        return out


def console_line(m: dict, health: tuple[str, ...] = ()) -> str:
    """The step line: loss, bpb, optimizer and throughput, then the model's health fields."""
    line = (
        f"step {m['global_step']:>6} | loss {m['loss']:.4f} | bpb {m['bpb']:.4f} | "
        f"grad {m['grad_norm']:.3g} | lr {m['lr']:.3g} | {m['bytes_per_s']:.0f} B/s | "
        f"{m['flops_per_s'] / 1e9:.1f} GFLOP/s | "
        + (f"mfu {100 * m['mfu']:.1f}% | " if "mfu" in m else "")
        + f"step {1000 * m['step_time_s']:.0f} ms | "
        f"data {1000 * m['data_time_s']:.0f} ms | mem {m['peak_mem_gib']:.2f} GiB"
    )
    return " | ".join([line, *health_fields(m, health)])


def health_fields(m: dict, health: tuple[str, ...]) -> list[str]:
    """What says whether the model segments its bytes as it should: real bytes per patch of a
    patched architecture (`patch_len_mean`), and for each prefix in `health` the record's
    `aux/<prefix>*` values, one field per prefix (`bytes_per_chunk 2.05/4.41`: stage 0, 1, ...)."""
    fields = []
    if "patch_len_mean" in m:
        fields.append(f"patch {m['patch_len_mean']:.2f} B")
    for prefix in health:
        keys = sorted(k for k in m if k.startswith(f"aux/{prefix}"))
        if keys:
            name = prefix.rstrip("/_")
            fields.append(f"{name} " + "/".join(f"{m[k]:.3g}" for k in keys))
    return fields


_CONSOLE_KEYS = (
    "loss",
    "bpb",
    "grad_norm",
    "lr",
    "bytes_per_s",
    "flops_per_s",
    "step_time_s",
    "data_time_s",
    "peak_mem_gib",
)


def generic_line(m: dict) -> str:
    parts = [f"step {m.get('global_step', '?'):>6}"]
    for key, value in m.items():
        if key != "global_step":
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)
