"""The EMA that spreads chunk states back to bytes, as a parallel scan in plain PyTorch.

Recurrence (per row, per channel; decay shared by all channels of a position):

    z_t = exp(log_decay_t) * z_{t-1} * (not reset_t) + inputs_t,        z_{-1} = 0

``ema_scan`` computes it in blocks of ``block_size`` positions. Inside a block the map from
inputs to states is a lower-triangular matrix ``W[i, j] = prod_{j<m<=i} decay_m`` (zero across a
reset), built in log space from a masked cumulative sum, so no cumulative product is ever formed:
decays near 1e-4 over thousands of positions underflow to exactly 0 where they should, never to
0/0. The state carried from block to block obeys the same recurrence one level up (decay = the
block's total decay, input = the block's last state with zero carry-in), so it is solved by the
same function recursively: every level is a batched matmul, depth log_{block_size}(L), no Python
loop over positions. The ops are plain tensor ops, so the scan runs (and differentiates) the same
on CPU and CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ema_scan(
    log_decay: torch.Tensor,
    inputs: torch.Tensor,
    reset: torch.Tensor | None = None,
    block_size: int = 64,
) -> torch.Tensor:
    """States z ``[B, L, D]`` of the recurrence above, in the dtype of ``inputs``.

    log_decay: ``[B, L]``, finite and <= 0 (log of the decay; its value at a reset is ignored).
    inputs: ``[B, L, D]``.
    reset: ``[B, L]`` bool or None; True at t means z_t does not see z_{t-1} (a document start).
    """
    if inputs.dim() != 3 or log_decay.shape != inputs.shape[:2]:
        raise ValueError(
            f"ema_scan: expected inputs [B, L, D] and log_decay [B, L], got "
            f"{tuple(inputs.shape)} and {tuple(log_decay.shape)}"
        )
    if block_size < 2:
        raise ValueError(f"ema_scan: block_size must be >= 2, got {block_size}")
    batch, length, dim = inputs.shape
    if length == 0:
        return inputs.clone()
    log_decay = log_decay.to(inputs.dtype)
    if reset is None:
        reset = torch.zeros(batch, length, dtype=torch.bool, device=inputs.device)
    blocks = -(-length // block_size)
    pad = blocks * block_size - length
    if pad:  # padding at the end cannot change earlier states
        log_decay = F.pad(log_decay, (0, pad))
        inputs = F.pad(inputs, (0, 0, 0, pad))
        reset = F.pad(reset, (0, pad))
    log_decay = log_decay.view(batch, blocks, block_size)
    inputs = inputs.view(batch, blocks, block_size, dim)
    reset = reset.view(batch, blocks, block_size)

    # segment[i]: resets seen in the block up to and including i. Two positions of a block are
    # linked only inside one segment; the carry-in reaches only segment 0.
    segment = reset.long().cumsum(-1)
    local = _intra_block(log_decay, inputs, segment)
    if blocks == 1:
        return local[:, 0, :length]

    log_prefix = log_decay.cumsum(-1)  # sum of log decays from the block start to i (all <= 0)
    carry_weight = log_prefix.exp() * (segment == 0)
    # Block-level recurrence: end state c_k = total_decay_k * c_{k-1} + local end state e_k,
    # reset when the block holds a reset.
    block_end = ema_scan(
        log_prefix[..., -1], local[:, :, -1], segment[..., -1] > 0, block_size=block_size
    )
    carry_in = F.pad(block_end[:, :-1], (0, 0, 1, 0))  # state entering block k is c_{k-1}
    states = local + carry_weight[..., None] * carry_in[:, :, None, :]
    return states.view(batch, blocks * block_size, dim)[:, :length]


def _intra_block(
    log_decay: torch.Tensor, inputs: torch.Tensor, segment: torch.Tensor
) -> torch.Tensor:
    """States of each block with a zero carry-in: ``W @ inputs`` per block."""
    size = log_decay.shape[-1]
    below = torch.ones(size, size, dtype=torch.bool, device=log_decay.device).tril(-1)
    # spread[..., m, j] = log_decay[m] where m > j; cumsum over m gives
    # log_span[i, j] = sum_{j < m <= i} log_decay[m] (one subtraction-free sum per entry).
    spread = log_decay[..., :, None].expand(*log_decay.shape, size).masked_fill(~below, 0.0)
    log_span = spread.cumsum(-2)
    linked = below.logical_or(torch.eye(size, dtype=torch.bool, device=log_decay.device))
    linked = linked & (segment[..., :, None] == segment[..., None, :])
    weight = log_span.masked_fill(~linked, float("-inf")).exp()
    return weight @ inputs


def ema_scan_sequential(
    log_decay: torch.Tensor, inputs: torch.Tensor, reset: torch.Tensor | None = None
) -> torch.Tensor:
    """The same recurrence as ``ema_scan``, one position at a time (the test/bench reference)."""
    decay = log_decay.to(inputs.dtype).exp()
    if reset is not None:
        decay = decay.masked_fill(reset, 0.0)
    state = torch.zeros_like(inputs[:, 0])
    states = []
    # unbind once: indexing position t inside the loop would make the backward O(L^2 D)
    for decay_t, input_t in zip(decay.unbind(1), inputs.unbind(1)):
        state = decay_t[:, None] * state + input_t
        states.append(state)
    return torch.stack(states, dim=1)
