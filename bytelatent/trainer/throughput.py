"""Honest throughput: FLOPs of each batch from its real sizes, and step times that include the
device work a step queued.

* `BatchSizes`: host-side counts every batch already carries (numpy, no device sync): tokens the
  model runs on (padding included) and real tokens (those with a target), patches the global
  model runs on (every column of `patch_lengths`) and real patches (those holding a real byte).
* `FlopsCounter`: training FLOPs of a batch, `executed` (what the hardware computes, padding
  included; what `torch.utils.flop_counter` counts, up to the attention convention of
  `model/flops.py`) and `useful` (the same formula on the real tokens and patches). `mfu` is
  useful work; `padding_frac` is the share of tokens that are padding. An architecture whose
  FLOPs depend on what the model decides (H-Net's chunk counts) gives `measured`: the log step
  recounts the interval at the measured values (`ArchSpec.measured_flops`).
* `StepClock`: on CUDA a pair of events around each step, read once at the log step (so queued
  kernels count in the step that queued them, and the hot path never syncs); on CPU, where work
  runs synchronously, `time.perf_counter`. It also keeps the interval's host span (first step
  start to the end of the last step's work), which `IntervalMetrics` turns into throughput.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bytelatent.data.batch import Batch
from bytelatent.model.registry import get_arch


@dataclass
class BatchSizes:
    tokens: int  # rows x row length: what the local (byte) layers run on
    real_tokens: int  # positions with a target (mask True)
    patches: int  # rows x patch columns: what the global model runs on (0 without patches)
    real_patches: int  # patches that start at a real position

    @classmethod
    def of(cls, batch: Batch) -> BatchSizes:
        real_per_row = batch.mask.sum(axis=1)
        sizes = cls(int(batch.x.size), int(real_per_row.sum()), 0, 0)
        if batch.patch_lengths is not None:
            lengths = batch.patch_lengths
            starts = np.cumsum(lengths, axis=1) - lengths
            sizes.patches = int(lengths.size)
            sizes.real_patches = int(((lengths > 0) & (starts < real_per_row[:, None])).sum())
        return sizes


class FlopsCounter:
    """Training FLOPs (forward + backward) of a batch, from `BatchSizes`, by the run's
    architecture (`ArchSpec.sizes.flops`; an architecture without one counts 0)."""

    def __init__(self, args) -> None:  # TrainArgs
        spec = get_arch(args.arch)
        factory = spec.sizes.flops
        self.count = factory(args.active_model_args(), args.data) if factory else lambda t, p: 0.0
        measured = spec.sizes.measured_flops
        self._measured = (
            functools.partial(measured, args.active_model_args(), args.data) if measured else None
        )

    def measured(self, aux: dict[str, float]) -> Callable[[float, float], float] | None:
        """`(tokens, patches) -> FLOPs` at what the forward measured in a log interval (`aux`:
        its `aux/` means without the prefix; H-Net: chunk counts), or None: keep `count`."""
        return self._measured(aux) if self._measured is not None else None

    def executed(self, s: BatchSizes) -> float:
        return self.count(s.tokens, s.patches)

    def useful(self, s: BatchSizes) -> float:
        return self.count(s.real_tokens, s.real_patches)


class StepClock:
    """Seconds of the steps between two `pop()`s, device work included; and `span`, the host
    times of the popped interval's first step start and of the end of its last step's work
    (CUDA: read on the host once that step's end event has completed)."""

    def __init__(self, device: torch.device, now=time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self._now = now
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0
        self._start: float | torch.cuda.Event = 0.0
        self._first_start: float | None = None  # host time of the interval's first start()
        self._last_stop = 0.0  # host time of the last stop() (CPU: the step's work is done)
        self.span: tuple[float, float] = (0.0, 0.0)

    def start(self) -> None:
        now = self._now()
        if self._first_start is None:
            self._first_start = now
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = now

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._last_stop = self._now()
            self._seconds += self._last_stop - self._start

    def pop(self) -> float:
        """Total step seconds since the last pop (on CUDA: waits for the last step's work)."""
        end = self._last_stop
        if self._events:
            self._events[-1][1].synchronize()
            end = self._now()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        self.span = (end if self._first_start is None else self._first_start, end)
        seconds, self._seconds, self._events = self._seconds, 0.0, []
        self._first_start = None
        return seconds
