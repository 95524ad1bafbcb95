"""`probe_freq`: every `probe_freq` steps, per-module output statistics and per-parameter grad norms.

On a probed step only: forward hooks on every module record the mean, std and abs max of its
output (the first call per module in the step; with activation checkpointing the recompute is
not counted twice), and after backward the norm of each parameter's gradient (before clipping).
Everything stays on the device until the step ends; one host copy then writes a line to
`dump_dir/probe/probe.{rank}.jsonl`. Other steps install no hook and never sync.

Module statistics are of this rank's micro-batch (a tensor-parallel output's local shard);
gradient norms are of the full gradient (sharded gradients are reduced, on every rank alike).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bytelatent.trainer.run_files import append_line


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _floating_outputs(output) -> list[torch.Tensor]:
    items = output if isinstance(output, (tuple, list)) else [output]
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


class Probe:
    """`begin(step)` before the step's forward, `record_grads()` after backward, `end()` after."""

    def __init__(self, model: nn.Module, freq: int, dump_dir: str, rank: int):
        self.model = model
        self.freq = freq
        self.path = Path(dump_dir) / "probe" / f"probe.{rank}.jsonl"
        self.active = False
        self._step = 0
        self._handles: list = []
        self._module_stats: dict[str, torch.Tensor] = {}
        self._grad_norms: dict[str, torch.Tensor] = {}

    def begin(self, step: int) -> None:
        if step % self.freq != 0:
            return
        self.active, self._step = True, step
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name or "model")))

    def _hook(self, name: str):
        def record(module, inputs, output) -> None:  # noqa: ARG001 - hook signature
            outputs = _floating_outputs(output)
            with torch.no_grad():
                for i, t in enumerate(outputs):
                    key = name if len(outputs) == 1 else f"{name}[{i}]"
                    if key in self._module_stats:
                        continue
                    t = _local(t).detach().float()
                    self._module_stats[key] = torch.stack([t.mean(), t.std(), t.abs().amax()])

        return record

    def record_grads(self) -> None:
        if not self.active:
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.grad is None:
                    continue
                norm = torch.linalg.vector_norm(p.grad.float())
                self._grad_norms[name] = norm.full_tensor() if isinstance(norm, DTensor) else norm

    def end(self) -> None:
        """Remove the hooks, copy the step's numbers to the host once, and write them."""
        if not self.active:
            return
        for handle in self._handles:
            handle.remove()
        self._handles, self.active = [], False
        modules = self._to_host(self._module_stats)
        grads = self._to_host(self._grad_norms)
        record = {
            "step": self._step,
            "modules": {k: dict(zip(("mean", "std", "abs_max"), v)) for k, v in modules.items()},
            "grad_norm": {k: v[0] for k, v in grads.items()},
        }
        self._module_stats, self._grad_norms = {}, {}
        append_line(self.path, json.dumps(record))

    @staticmethod
    def _to_host(values: dict[str, torch.Tensor]) -> dict[str, list[float]]:
        if not values:
            return {}
        stacked = torch.stack([v.reshape(-1) for v in values.values()]).cpu().tolist()
        return dict(zip(values.keys(), stacked))


class NoProbe:
    """`probe_freq` unset: the same calls, doing nothing."""

    active = False

    def begin(self, step: int) -> None:
        pass

    def record_grads(self) -> None:
        pass

    def end(self) -> None:
        pass


def build_probe(model: nn.Module, freq: int | None, dump_dir: str, rank: int) -> Probe | NoProbe:
    return Probe(model, freq, dump_dir, rank) if freq else NoProbe()
