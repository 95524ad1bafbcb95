"""The one forward and loss: batch -> logits -> masked cross-entropy.

Training (`Trainer.forward_backward`), validation (`eval/validate.py`, and every eval task through
`EvalContext.forward`) and the activation measurement of `trainer/model_info.py` all call these,
so train and validation loss cannot drift apart. Whether the model gets the batch's patch lengths
is decided here, from the model itself: a BLT gets them when the batch carries them, a plain byte
LM (the entropy model) never does.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from bytelatent.distributed.env import host_to_device
from bytelatent.model.blt import ByteLatentTransformer
from bytelatent.model.transformer import LMTransformer


class Batch(Protocol):
    """What the loss reads of a `bytelatent.data.batch.Batch` (the data layer sits above this)."""

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    patch_lengths: np.ndarray | None


def forward_logits(model: torch.nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """Logits [B, L, V] of `batch`; patch lengths go to a BLT whenever the batch has them.

    Our models also get the batch itself as `host`: masks that need host integers (xformers'
    document lengths) read its numpy arrays, so the forward never waits on a device-to-host copy.
    """
    x = host_to_device(batch.x, device)
    if isinstance(model, ByteLatentTransformer):
        # without patch lengths in the batch the model patches in its forward
        lengths = batch.patch_lengths
        lengths = None if lengths is None else host_to_device(lengths, device)
        return model(x, patch_lengths=lengths, host=batch)
    if isinstance(model, LMTransformer):
        return model(x, host=batch)
    return model(x)


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
    """Σ CE over `batch`'s unmasked targets. The forward runs inside `forward_context` (autocast,
    tensor-parallel loss context); the loss outside it, in float32, as always."""
    y, mask = host_to_device(batch.y, device), host_to_device(batch.mask, device)
    with forward_context if forward_context is not None else contextlib.nullcontext():
        logits = forward_logits(model, batch, device)
    return masked_cross_entropy_sum(logits, y, mask)
