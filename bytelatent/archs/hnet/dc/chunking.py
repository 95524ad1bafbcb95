"""Chunk (keep the states at boundaries) and dechunk (EMA of the chunk states back to bytes).

Two layouts, as in the official code:
* padded: ``[B, L, D]`` with ``mask [B, L]`` (valid tokens a prefix of each row); the chunk level
  is ``[B, M, D]`` with ``next_mask [B, M]``, M the most boundaries in a row;
* packed: ``[T, D]`` with ``cu_seqlens [N+1]``; the chunk level is ``[T', D]`` with the chunk-level
  ``cu_seqlens`` (each document keeps at least one chunk: its start is always a boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.archs.hnet.dc.ema import ema_scan

PROB_CLAMP = 1e-4  # DeChunk clamps p to [1e-4, 1 - 1e-4]: no state is copied or dropped whole


@dataclass
class ChunkOutput:
    """The chunk-level sequence.

    hidden_states: ``[B, M, D]`` (padded) or ``[T', D]`` (packed).
    mask: ``[B, M]`` bool, j < num_tokens[b] (padded); None when packed.
    cu_seqlens: ``[N+1]`` int64 chunk offsets per document (packed); None when padded.
    max_seqlen: the most chunks in a document (packed); None when padded.
    num_tokens: ``[B]`` / ``[N]`` int64, chunks per row / document.
    """

    hidden_states: torch.Tensor
    mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None
    num_tokens: torch.Tensor


def boundaries_first(boundary_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions of each row: its boundaries in order, then its other positions in order."""
    return torch.sort((~boundary_mask).to(torch.uint8), dim=-1, stable=True).indices


def padded_width(num_tokens: torch.Tensor, limit: int) -> int:
    """The chunk level's width in the padded layout: the most chunks in a row (at most `limit`,
    the row length).

    The one host sync of an H-Net forward (per stage): the inner stage's sequence length depends
    on the routing. The static bound `limit` would avoid it but run the inner stages and the
    global transformer on L positions instead of about L / N (docs/hnet.md, "Host syncs").
    tests/distributed/test_fake_cuda_trace.py counts the calls and refuses any other host read."""
    return int(num_tokens.max())


class ChunkLayer(nn.Module):
    """Keeps the hidden states at the boundaries (no parameters; the gradient is a scatter)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        boundary_mask: torch.Tensor,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> ChunkOutput:
        if cu_seqlens is not None:
            chunk_counts = boundary_mask.long().cumsum(0)
            next_cu_seqlens = F.pad(chunk_counts[cu_seqlens[1:].long() - 1], (1, 0))
            num_tokens = next_cu_seqlens.diff()
            return ChunkOutput(
                hidden_states=hidden_states[boundary_mask],
                mask=None,
                cu_seqlens=next_cu_seqlens,
                max_seqlen=int(num_tokens.max()),
                num_tokens=num_tokens,
            )
        num_tokens = boundary_mask.sum(-1)
        width = padded_width(num_tokens, boundary_mask.shape[1])
        # Slots past a row's chunks hold its first non-boundary states (as the official code
        # does): they are masked out, and dechunk never reads them back.
        order = boundaries_first(boundary_mask)[:, :width]
        next_hidden = hidden_states.gather(
            1, order[..., None].expand(-1, -1, hidden_states.shape[-1])
        )
        next_mask = torch.arange(width, device=boundary_mask.device) < num_tokens[:, None]
        return ChunkOutput(next_hidden, next_mask, None, None, num_tokens)


class DeChunkLayer(nn.Module):
    """EMA of the chunk states spread back to every byte:

        z_k = p_k h_k + (1 - p_k) z_{k-1}   over the boundaries t_0 < t_1 < ... of a row / document,
        out_t = z_{(boundaries at positions <= t) - 1},   p = clamp(fp32(boundary_prob[..., 1]), 1e-4, 1 - 1e-4)

    ``hidden_states`` is chunk level (``[B, M, D]`` / ``[T', D]``); ``boundary_mask`` and
    ``boundary_prob`` token level; ``cu_seqlens`` (packed) the chunk-level offsets that
    ``ChunkLayer`` returned. The output is token level, in the dtype of ``hidden_states``.

    kernel_dtype None: the EMA runs in promote(hidden dtype, fp32) with decay 1 - p and input p h
    (p rounded to fp32 first: the official fp32 island). kernel_dtype set (bf16 is the official
    model's default): the official Mamba2-kernel route, dt = log(1/(1 - p)) in fp32, then dt,
    h/dt and p rounded to kernel_dtype, decay exp(-dt) and input dt (h/dt) p in fp32 (fp64 for
    fp64), output rounded to kernel_dtype. Same recurrence, the official rounding.
    """

    def __init__(self, kernel_dtype: torch.dtype | None = None, block_size: int = 64) -> None:
        super().__init__()
        self.kernel_dtype = kernel_dtype
        self.block_size = block_size

    def forward(
        self,
        hidden_states: torch.Tensor,
        boundary_mask: torch.Tensor,
        boundary_prob: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return dechunk(
            hidden_states,
            boundary_mask,
            boundary_prob,
            cu_seqlens,
            kernel_dtype=self.kernel_dtype,
            block_size=self.block_size,
        )


def dechunk(
    hidden_states: torch.Tensor,
    boundary_mask: torch.Tensor,
    boundary_prob: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    kernel_dtype: torch.dtype | None = None,
    fp32_prob: bool = True,
    block_size: int = 64,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``DeChunkLayer`` as a function; ``fp32_prob=False`` drops the fp32 island (exact fp64 EMA).

    ``starts`` (padded form, ``[B, L]`` bool, a subset of ``boundary_mask``): document starts
    inside the rows; the EMA restarts there, as the packed form restarts at each document.
    Autocast is off inside (the EMA's dtypes are the ones above, also under bf16 autocast)."""
    with torch.autocast(hidden_states.device.type, enabled=False):
        return _dechunk(
            hidden_states,
            boundary_mask,
            boundary_prob,
            cu_seqlens,
            kernel_dtype=kernel_dtype,
            fp32_prob=fp32_prob,
            block_size=block_size,
            starts=starts,
        )


def _dechunk(
    hidden_states: torch.Tensor,
    boundary_mask: torch.Tensor,
    boundary_prob: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    kernel_dtype: torch.dtype | None,
    fp32_prob: bool,
    block_size: int,
    starts: torch.Tensor | None,
) -> torch.Tensor:
    prob = boundary_prob[..., 1]
    if fp32_prob:
        prob = prob.float()
    prob = prob.clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if cu_seqlens is not None:
        # one stream; the state restarts at every document's first chunk
        chunk_prob = prob[boundary_mask][None]
        # one slot more than there are chunks, for the offset of an empty last document
        reset = torch.zeros(chunk_prob.shape[1] + 1, dtype=torch.bool, device=prob.device)
        reset[cu_seqlens[:-1].long()] = True
        reset = reset[None, :-1]
        chunk_states = hidden_states[None]
    else:
        order = boundaries_first(boundary_mask)[:, : hidden_states.shape[1]]
        chunk_prob = prob.gather(1, order)  # slots past a row's chunks: never read back
        chunk_states = hidden_states
        reset = None if starts is None else starts.gather(1, order)
    states = _ema(chunk_states, chunk_prob, reset, kernel_dtype, block_size)
    # token t reads the state of the last chunk starting at or before it (positions before a
    # row's first boundary exist only in an all-padding row: they read chunk 0, don't-care)
    source = (boundary_mask.long().cumsum(-1) - 1).clamp(min=0)
    if cu_seqlens is not None:
        states = states[0]
    out = states.gather(-2, source[..., None].expand(*source.shape, states.shape[-1]))
    return out.to(hidden_states.dtype)


def _ema(
    hidden_states: torch.Tensor,
    prob: torch.Tensor,
    reset: torch.Tensor | None,
    kernel_dtype: torch.dtype | None,
    block_size: int,
) -> torch.Tensor:
    """z_k = p_k h_k + (1 - p_k) z_{k-1} over ``[B, M, D]`` chunk states."""
    log_decay, inputs = _ema_terms(hidden_states, prob, kernel_dtype)
    states = ema_scan(log_decay, inputs, reset, block_size)
    return states if kernel_dtype is None else states.to(kernel_dtype)


def _ema_terms(
    hidden_states: torch.Tensor, prob: torch.Tensor, kernel_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log decay ``[...]``, input ``[..., D]``) of the EMA recurrence for chunk states
    ``[..., D]`` and their clamped probabilities ``[...]``, in the EMA's compute dtype."""
    if kernel_dtype is None:
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        prob = prob.to(compute)
        return torch.log1p(-prob), prob[..., None] * hidden_states.to(compute)
    # The official route through mamba_chunk_scan_combined: decay exp(A dt) with A = -1,
    # input dt * x * B with x = h / dt, B = p; the kernel keeps its state in fp32 (fp64 here for
    # fp64 inputs, as the fixtures' stand-in does).
    dt = torch.log(1 / (1 - prob.float())).to(kernel_dtype)
    scaled = (hidden_states / dt[..., None]).to(kernel_dtype)
    gate = prob.to(kernel_dtype)
    compute = torch.promote_types(kernel_dtype, torch.float32)
    dt = dt.to(compute)
    return -dt, (dt * gate.to(compute))[..., None] * scaled.to(compute)


def dechunk_step(
    state: torch.Tensor,
    hidden_states: torch.Tensor,
    boundary_prob: torch.Tensor,
    reset: torch.Tensor,
    *,
    kernel_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new chunk per row of ``dechunk`` (padded form, incremental generation).

    state: ``[B, D]`` the EMA state after the row's previous chunk, in the EMA's compute dtype
    (fp32 at least; zeros before a row's first chunk). hidden_states: ``[B, D]`` the new chunk
    states (the main network's output); boundary_prob: ``[B, 2]`` at their boundaries; reset:
    ``[B]`` bool, the chunk starts a document. Returns (new state, the output every byte of the
    chunk reads ``[B, D]`` in the dtype of ``hidden_states``)."""
    prob = boundary_prob[..., 1].float().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    log_decay, inputs = _ema_terms(hidden_states, prob, kernel_dtype)
    decay = log_decay.exp().masked_fill(reset, 0.0)
    state = decay[..., None] * state + inputs
    out = state if kernel_dtype is None else state.to(kernel_dtype)
    return state, out.to(hidden_states.dtype)
