"""Device bugs planted into a model for the fake-CUDA trace (trace_step.py): each must fail the
trace naming its line here (the tests find the line by its `# plant:` marker)."""

from __future__ import annotations

import torch


def _cpu_arange(module, inputs, out):
    return out + torch.arange(out.shape[-1], dtype=out.dtype)  # plant: cpu_arange


def _item(module, inputs, out):
    if out.float().abs().sum().item() < 0:  # plant: item
        return out * 0
    return out


def _cpu_tensor(module, inputs, out):
    return out * torch.tensor([2.0], dtype=out.dtype)  # plant: cpu_tensor


HOOKS = {"cpu_arange": _cpu_arange, "item": _item, "cpu_tensor": _cpu_tensor}


def plant(name: str, model: torch.nn.Module) -> None:
    """The bug `name` as a forward hook on the model's first linear layer."""
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(HOOKS[name])
