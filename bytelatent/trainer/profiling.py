"""`profiling.*`: a torch.profiler window of a few steps, written as a chrome trace.

Off by default and then free: `build_profiler` returns a `NoProfiler` whose calls do nothing. The window
counts steps of this process, not global steps, so a resumed or requeued job profiles too and
the first steps (compilation, allocator warm-up) stay out of the trace.

Files, under `dump_dir/profiling/`:
* `trace_steps{a}-{b}.rank{r}.json`: chrome trace (CPU ops, and CUDA kernels when on CUDA);
  open in chrome://tracing or https://ui.perfetto.dev;
* with `memory=true`: allocations in the trace, and on CUDA `memory_snapshot_steps{a}-{b}.rank{r}.pickle`
  for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from bytelatent.trainer.args import ProfilerArgs

logger = logging.getLogger("bytelatent")

MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Call `step_done()` after every training step; it starts, stops and writes the trace."""

    def __init__(self, args: ProfilerArgs, dump_dir: str, rank: int, device: torch.device):
        self.args = args
        self.folder = Path(dump_dir) / args.trace_folder
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.steps_done = 0
        self._prof: torch.profiler.profile | None = None
        first, last = args.start_step, args.start_step + args.active_steps - 1
        self._suffix = f"steps{first}-{last}.rank{rank}"
        self.trace_path = self.folder / f"trace_{self._suffix}.json"

    def step_done(self) -> None:
        self.steps_done += 1
        if self.steps_done == self.args.start_step - 1:
            self._start()
        elif self.steps_done == self.args.start_step - 1 + self.args.active_steps:
            self._stop()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.args.memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._prof = torch.profiler.profile(
            activities=activities, profile_memory=self.args.memory, record_shapes=True
        )
        self._prof.start()

    def _stop(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        if self.cuda and self.args.memory:
            snapshot = self.folder / f"memory_snapshot_{self._suffix}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        logger.info("profiler: trace written to %s", self.trace_path)

    def close(self) -> None:
        """A run that ended inside the window still writes what it recorded."""
        self._stop()


class NoProfiler:
    """`profiling.run=false`: the same calls, doing nothing."""

    def step_done(self) -> None:
        pass

    def close(self) -> None:
        pass


def build_profiler(
    args: ProfilerArgs, dump_dir: str, rank: int, device: torch.device
) -> Profiler | NoProfiler:
    return Profiler(args, dump_dir, rank, device) if args.run else NoProfiler()
