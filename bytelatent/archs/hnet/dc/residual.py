"""The stage's skip path: an fp32 residual projection, and the straight-through estimator (STE)
that lets the router's confidence receive a gradient without changing the forward value:

    y = (fp32(dechunk_out) * STE(selected_probs) + residual_proj(fp32(x_enc))).to(x dtype)
    STE(s) = 1 in the forward pass; dL/ds = dL/dSTE(s) in the backward pass.
"""

from __future__ import annotations

import torch
from torch import nn


def straight_through(selected_probs: torch.Tensor) -> torch.Tensor:
    """Ones shaped like ``selected_probs`` whose gradient flows to it unchanged.

    Written as 1 + (s - s.detach()) (exactly 1.0 for finite s) rather than an autograd.Function,
    so that torch.compile traces it without a graph break.
    """
    return torch.ones_like(selected_probs) + (selected_probs - selected_probs.detach())


def merge_residual(
    dechunk_out: torch.Tensor, residual: torch.Tensor, selected_probs: torch.Tensor
) -> torch.Tensor:
    """``dechunk_out * STE(selected_probs) + residual`` (the official ``residual_func``), in the
    promoted dtype of its operands; ``selected_probs`` is ``[..., 1]``, the others ``[..., D]``."""
    return dechunk_out * straight_through(selected_probs) + residual


class ResidualProjection(nn.Linear):
    """``[.., D] -> [.., D]`` linear kept in fp32 whatever the model dtype ("do the residual in
    fp32"): the input is cast to fp32 and the output is fp32. The weight starts at zero (the
    official init; the bias keeps nn.Linear's default init). Under FSDP it is its own unit
    gathered in fp32 (`fsdp_param_dtype`), whatever `distributed.model_dtype` is."""

    fsdp_param_dtype = torch.float32

    def __init__(self, d_model: int, device: torch.device | str | None = None) -> None:
        super().__init__(d_model, d_model, bias=True, device=device, dtype=torch.float32)
        self.init_weights()

    def init_weights(self) -> None:
        super().reset_parameters()  # the bias: nn.Linear's uniform init, as the official one
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # autocast off: under bf16 autocast the linear would run (and return) bf16
        with torch.autocast(hidden_states.device.type, enabled=False):
            return super().forward(hidden_states.to(self.weight.dtype))
