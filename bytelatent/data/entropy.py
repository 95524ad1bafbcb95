"""Next-byte entropies from an entropy model (a byte LM), computed one document at a time.

Rules (rows never bleed into each other; docs/differences.md, Entropies):

- Every row / document is cut on its own into consecutive, non-overlapping windows of
  ``max_length`` tokens (default: the model's ``max_seqlen``). The model's context restarts at
  each window boundary, exactly like the reference does every 8192 bytes of a document. A window
  never holds tokens of two rows or two documents.
- Windows are batched ``batch_size`` at a time (longest first, to keep padding small) and
  right-padded with token 0. The entropy model is causal, so padding after a window's tokens
  never changes their outputs.
- ``entropy`` is ``-sum p log p`` of the softmax, in nats, computed in float32.

The entropy model itself is loaded by ``bytelatent.checkpoint.pretrained.load_entropy_model``
(reading checkpoints is the checkpoint package's concern); this module only runs a model it is
given. ``resolve_device`` picks the device it runs on: this process's GPU (``LOCAL_RANK``), so
each rank's data worker uses its own GPU rather than GPU 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 8192  # the reference's window when a model does not say


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the last dim: [..., V] -> [...] float32."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def resolve_device(name: str | torch.device | None) -> torch.device:
    """'auto' -> this process's GPU if CUDA is available, else cpu; 'cuda' without CUDA is a
    ConfigError. 'cuda' without an index is this process's GPU: `LOCAL_RANK` (set by torchrun,
    and by `setup_distributed` under srun) modulo the visible GPUs, else the current device."""
    if isinstance(name, torch.device):
        device = name
    elif name is None or name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device {name!r} asked for but CUDA is not available; use 'cpu' or 'auto'"
            )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", _local_gpu_index())
    return device


def _local_gpu_index() -> int:
    local_rank = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
    if local_rank is not None and local_rank.isdigit():
        return int(local_rank) % max(torch.cuda.device_count(), 1)
    return torch.cuda.current_device()


def model_max_length(model: nn.Module) -> int:
    """The window length a model can take: args.max_seqlen, max_seqlen or max_length."""
    args = getattr(model, "args", None)
    for value in (
        getattr(args, "max_seqlen", None),
        getattr(model, "max_seqlen", None),
        getattr(model, "max_length", None),
    ):
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_LENGTH


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _forward_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    if isinstance(out, tuple | list):  # some LMs return (logits, ...)
        out = out[0]
    return out


@torch.no_grad()
def per_document_outputs(
    docs: Sequence[torch.Tensor],
    model: nn.Module,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int,
    device: str | torch.device | None = None,
    max_length: int | None = None,
) -> list[torch.Tensor]:
    """Run ``model`` over each 1-D token tensor in windows; ``reduce(logits [b,S,V]) -> [b,S]``.

    Returns one tensor per document (same length as it, on the CPU), never mixing documents.
    """
    if batch_size < 1:
        raise ConfigError(f"patching_batch_size={batch_size} must be >= 1")
    window = model_max_length(model)
    if max_length is not None:
        if max_length > window:
            raise ConfigError(
                f"window max_length={max_length} exceeds the entropy model's max_seqlen="
                f"{window}; use a value <= {window}"
            )
        window = max_length
    run_device = _model_device(model) if device is None else resolve_device(device)
    pieces: list[tuple[int, int, int]] = []  # (doc index, start, end)
    for index, doc in enumerate(docs):
        if doc.dim() != 1:
            raise ValueError(f"document {index} must be 1-D, got shape {tuple(doc.shape)}")
        for start in range(0, doc.numel(), window):
            pieces.append((index, start, min(start + window, doc.numel())))
    # longest first: each batch pads only to its own longest window
    pieces.sort(key=lambda piece: piece[2] - piece[1], reverse=True)
    results: list[torch.Tensor | None] = [None] * len(docs)
    chunks: list[list[tuple[int, torch.Tensor]]] = [[] for _ in docs]
    for first in range(0, len(pieces), batch_size):
        group = pieces[first : first + batch_size]
        width = group[0][2] - group[0][1]
        batch = torch.zeros((len(group), width), dtype=torch.long)
        for row, (index, start, end) in enumerate(group):
            batch[row, : end - start] = docs[index][start:end]
        values = reduce(_forward_logits(model, batch.to(run_device))).cpu()
        for row, (index, start, end) in enumerate(group):
            chunks[index].append((start, values[row, : end - start]))
    for index, doc in enumerate(docs):
        if doc.numel() == 0:
            results[index] = reduce(torch.zeros((1, 0, 1))).reshape(0)
            continue
        ordered = sorted(chunks[index], key=lambda chunk: chunk[0])
        results[index] = torch.cat([values for _, values in ordered])
    return results  # type: ignore[return-value]


def document_entropies(
    docs: Sequence[torch.Tensor | Sequence[int]],
    entropy_model: nn.Module,
    batch_size: int,
    device: str | torch.device | None = None,
    max_length: int | None = None,
) -> list[torch.Tensor]:
    """Entropies (float32, nats) per token of each document (ragged list in, list out)."""
    tensors = [torch.as_tensor(doc, dtype=torch.long) for doc in docs]
    return per_document_outputs(tensors, entropy_model, entropy, batch_size, device, max_length)


def calculate_entropies(
    tokens: torch.Tensor,
    entropy_model: nn.Module,
    batch_size: int,
    device: str | torch.device | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """tokens [B,N] -> entropies [B,N] float32 (nats) on tokens.device, row by row.

    ``device`` is where the model runs (default: where its parameters are).
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, N], got shape {tuple(tokens.shape)}")
    rows = list(tokens.detach().to("cpu", torch.long).unbind(0))
    values = per_document_outputs(rows, entropy_model, entropy, batch_size, device, max_length)
    if not values:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    return torch.stack(values).to(tokens.device)
