"""The training metrics of one log interval: sums kept between log steps, one dict out.

    metrics.add(out, batches, data_time)      # every step: device tensors and host numbers, no sync
    m = metrics.compute(step, lr=..., ...)    # a log step: one host copy, float64 all-reduce, reset

Throughput counts real tokens only (`bytes_per_s`, `flops_per_s` and `mfu` are useful work);
`padding_frac` is the share of positions that were padding, `padding_flops_frac` the share of the
executed FLOPs spent on padding (positions and a BLT's padded patch columns); step times include
the device work a step queued (`throughput.StepClock`). Rates are over the interval's real time,
each second counted once (`IntervalMetrics.elapsed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bytelatent.data.batch import Batch
from bytelatent.trainer.metrics import (
    Timings,
    bits_per_byte,
    peak_flops_per_device,
    peak_memory_gib,
)
from bytelatent.trainer.patch_stats import PatchLengthStats
from bytelatent.trainer.throughput import BatchSizes, FlopsCounter, StepClock

# Host-side sums of an interval, all-reduced together in float64 at the log step.
_HOST_SUMS = (
    "n_targets", "n_bytes", "tokens", "real_tokens", "patches", "real_patches",
    "useful_flops", "executed_flops",
)  # fmt: skip


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # Σ CE in nats over this rank's target bytes (float64, on device)
    n_targets: int  # this rank's target tokens (the loss is a mean over these)
    n_bytes: int  # bytes those targets stand for (equal to n_targets for byte tokenizers)
    grad_norm: torch.Tensor
    # Σ over this step's micro-batches of each auxiliary loss term (float64, on device), and how
    # many micro-batches that is: `aux/<name>` is the mean over micro-batches, steps and ranks
    aux_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    n_micro_batches: int = 0


class IntervalMetrics:
    """Owns the interval sums, the step clock, timings and patch statistics of the trainer."""

    def __init__(
        self,
        device: torch.device,
        flops: FlopsCounter,
        peak_flops: float | None,
        world_size: int,
        dp_size: int,
        dp_group: Callable[[], object],
    ) -> None:
        self.device, self.flops, self.peak_flops = device, flops, peak_flops
        self.world_size, self.dp_size, self._dp_group = world_size, dp_size, dp_group
        self.clock = StepClock(device)  # start()/stop() around each train_step
        # timing/* metrics; e.g. `with metrics.timings.measure("eval_s")`
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.timings = Timings(sync=sync)
        self.patch_stats = PatchLengthStats()  # patch_len_* metrics of BLT runs, host-side
        self._reset()

    @classmethod
    def for_run(cls, args, env, dp_size: int, dp_group: Callable[[], object]) -> IntervalMetrics:
        """From `TrainArgs` and the `DistEnv`: FLOPs of the run's model, the peak for its dtype."""
        d = args.distributed
        peak = peak_flops_per_device(
            env.device, args.logging.peak_tflops, d.model_dtype, d.matmul_allow_tf32
        )
        return cls(env.device, FlopsCounter(args), peak, env.world_size, dp_size, dp_group)

    def _reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.aux_sums: dict[str, torch.Tensor] = {}
        self.aux_micro_batches = 0
        self.sums = dict.fromkeys(_HOST_SUMS, 0.0)
        self.steps = 0
        self.data_time = 0.0
        self.first_data_time = 0.0  # the interval's first step: its data loading opens the span

    def start(self) -> None:
        """The first interval starts now (after set-up and any evaluation before training)."""
        self.timings.start_interval()

    def add(self, out: StepOutput, batches: list[Batch], data_time: float) -> None:
        self.loss_sum += out.loss_sum
        for name, value in out.aux_sums.items():
            self.aux_sums[name] = self.aux_sums.get(name, 0.0) + value
        if out.aux_sums:
            self.aux_micro_batches += out.n_micro_batches
        self.sums["n_targets"] += out.n_targets
        self.sums["n_bytes"] += out.n_bytes
        for batch in batches:
            sizes = BatchSizes.of(batch)
            self.sums["tokens"] += sizes.tokens
            self.sums["real_tokens"] += sizes.real_tokens
            self.sums["patches"] += sizes.patches
            self.sums["real_patches"] += sizes.real_patches
            self.sums["useful_flops"] += self.flops.useful(sizes)
            self.sums["executed_flops"] += self.flops.executed(sizes)
        if self.steps == 0:
            self.first_data_time = data_time
        self.steps += 1
        self.data_time += data_time
        self.patch_stats.add(batches)

    def _reduced(self, tokens_seen: int) -> dict[str, float]:
        """The interval's sums, and each rank's run total `tokens_seen`, over data-parallel ranks
        (float64: exact to 2**53)."""
        aux_names = sorted(self.aux_sums)  # the same order on every rank
        aux_keys = [f"aux/{name}" for name in aux_names]
        values = [self.loss_sum.item(), *self.sums.values(), float(tokens_seen)]
        if aux_names:  # runs without auxiliary losses reduce exactly what they always did
            values += [float(self.aux_sums[n]) for n in aux_names] + [self.aux_micro_batches]
            aux_keys.append("aux_micro_batches")
        sums = torch.tensor(values, dtype=torch.float64)
        if self.dp_size > 1:
            sums = sums.to(self.device)
            dist.all_reduce(sums, group=self._dp_group())
            sums = sums.cpu()
        return dict(zip(("loss_sum", *_HOST_SUMS, "tokens_seen", *aux_keys), sums.tolist()))

    def elapsed(self, step_time: float) -> float:
        """The interval's real seconds, for `bytes_per_s`, `flops_per_s` and `mfu`.

        On CPU work runs in sequence: step time plus data time. On CUDA a step's host work (the
        next batch's loading among it) overlaps the device work queued before it, so event step
        time plus host data time would count the overlap twice: instead the host span from the
        first step's data loading to the end of the last step's device work (`clock.span`, read
        after the sync), less the measured non-step work inside it (evaluation, saves).
        """
        if not self.clock.cuda:
            return max(step_time + self.data_time, 1e-9)
        first_start, end = self.clock.span
        start = first_start - self.first_data_time
        return max(end - start - self.timings.within(start, end), 1e-9)

    def _recount_flops(self, s: dict[str, float], aux: dict[str, float]) -> None:
        """FLOPs at what the forward measured in this interval (H-Net: its chunk counts, the
        means over micro-batches and ranks) where the architecture gives a measured counter;
        the per-batch counts at the targets otherwise."""
        measured = self.flops.measured({k.removeprefix("aux/"): v for k, v in aux.items()})
        if measured is not None:
            s["useful_flops"] = measured(s["real_tokens"], s["real_patches"])
            s["executed_flops"] = measured(s["tokens"], s["patches"])

    def compute(self, step: int, tokens_seen: int = 0, **extra: float) -> dict:
        """The metric record of the interval that ends at `step`; starts the next interval.

        `tokens_seen` is this rank's target bytes since the run began (`TrainState`); the record
        holds the sum over data-parallel ranks, like `n_bytes` (which counts this interval only).
        """
        s = self._reduced(tokens_seen)  # the host copy of the loss waits for the queued steps
        step_time = self.clock.pop()
        elapsed = self.elapsed(step_time)
        aux = {k: v / max(s["aux_micro_batches"], 1.0) for k, v in s.items() if k[:4] == "aux/"}
        self._recount_flops(s, aux)
        m = {
            "global_step": step,
            "loss": s["loss_sum"] / max(s["n_targets"], 1.0),
            "bpb": bits_per_byte(s["loss_sum"], s["n_bytes"]),
            "n_bytes": int(s["n_bytes"]),
            "tokens_seen": int(s["tokens_seen"]),
            # auxiliary loss terms (unweighted means; not part of loss or bpb)
            **aux,
            **extra,
            "bytes_per_s": s["real_tokens"] / elapsed,
            "flops_per_s": s["useful_flops"] / elapsed,
            "padding_frac": 1.0 - s["real_tokens"] / max(s["tokens"], 1.0),
            # compute spent on padding: padded positions and, in BLTs, padded patch columns
            "padding_flops_frac": 1.0 - s["useful_flops"] / max(s["executed_flops"], 1.0),
            "step_time_s": step_time / self.steps,
            "data_time_s": self.data_time / self.steps,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        if self.peak_flops:
            m["mfu"] = m["flops_per_s"] / (self.peak_flops * self.world_size)
        m.update(self.timings.pop(self.steps))
        m.update(self.patch_stats.pop())
        self._reset()
        return m
