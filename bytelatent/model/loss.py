"""The one forward and loss: batch -> logits -> masked cross-entropy.

Training (`Trainer.forward_backward`), validation (`eval/validate.py`, and every eval task through
`EvalContext.forward`) and the activation measurement of `trainer/model_info.py` all call these,
so train and validation loss cannot drift apart. What the model gets from the batch is its
architecture's (`ArchSpec.batch_inputs`, `host_batch`: a BLT gets the batch's patch lengths, a plain
byte LM never does), and so are the auxiliary loss terms its forward returns next to the logits
(`ArchSpec.aux_losses`): `batch_losses` hands them back apart from the LM loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from bytelatent.distributed.env import host_to_device
from bytelatent.model.registry import ArchSpec, arch_of


class Batch(Protocol):
    """What the loss reads of a `bytelatent.data.batch.Batch` (the data layer sits above this)."""

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    patch_lengths: np.ndarray | None


def forward_outputs(
    model: torch.nn.Module, batch: Batch, device: torch.device, spec: ArchSpec | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(logits [B, L, V], {aux loss name: scalar}) of `batch`, the inputs as the model's spec says
    (`arch_of(model)` unless given; a module outside the registry gets the tokens only).

    Our models also get the batch itself as `host`: masks that need host integers (xformers'
    document lengths) read its numpy arrays, so the forward never waits on a device-to-host copy.
    """
    spec = spec if spec is not None else arch_of(model)
    x = host_to_device(batch.x, device)
    if spec is None:
        return model(x), {}
    inputs = {}
    for name in spec.batch_inputs:  # e.g. a BLT's patch_lengths; None: it patches in its forward
        value = getattr(batch, name)
        inputs[name] = None if value is None else host_to_device(value, device)
    if spec.host_batch:
        inputs["host"] = batch
    out = model(x, **inputs)
    if not spec.aux_losses:
        return out, {}
    logits, aux = out
    expected = {term.name for term in spec.aux_losses}
    metrics_only = {name for name in aux if name.startswith(spec.aux_metrics)} - expected
    if set(aux) - metrics_only != expected:
        raise RuntimeError(
            f"arch {spec.name}: the forward returned aux losses {sorted(aux)}, its spec declares "
            f"{sorted(expected)}"
        )
    return logits, aux


def forward_logits(model: torch.nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """Logits [B, L, V] of `batch` (auxiliary terms dropped: validation and eval score the LM)."""
    return forward_outputs(model, batch, device)[0]


def masked_cross_entropy_sum(
    logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Σ cross-entropy (nats, float32) over the targets where `mask` is True."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    return (ce * mask.flatten()).sum()


def batch_loss_sum(
    model: torch.nn.Module,
    batch: Batch,
    device: torch.device,
    forward_context: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """Σ CE over `batch`'s unmasked targets (auxiliary terms dropped)."""
    return batch_losses(model, batch, device, forward_context)[0]


class LogitTerm(Protocol):
    """A loss term computed from the logits outside the model (a frozen teacher's distillation):
    `term(batch, logits)` is a scalar, the mean over the micro-batch, returned under `name`."""

    name: str

    def __call__(self, batch: Batch, logits: torch.Tensor) -> torch.Tensor: ...


def batch_losses(
    model: torch.nn.Module,
    batch: Batch,
    device: torch.device,
    forward_context: contextlib.AbstractContextManager | None = None,
    logit_terms: Sequence[LogitTerm] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(Σ CE over `batch`'s unmasked targets, {aux loss name: float32 scalar}). The forward runs
    inside `forward_context` (autocast, tensor-parallel loss context); the losses outside it, in
    float32, as always. `logit_terms` add their values to the aux dict under their names."""
    y, mask = host_to_device(batch.y, device), host_to_device(batch.target_mask, device)
    with forward_context if forward_context is not None else contextlib.nullcontext():
        logits, aux = forward_outputs(model, batch, device)
    aux = {name: value.float() for name, value in aux.items()}
    for term in logit_terms:
        aux[term.name] = term(batch, logits).float()
    return masked_cross_entropy_sum(logits, y, mask), aux
