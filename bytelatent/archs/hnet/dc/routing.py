"""H-Net routing: the probability that each position starts a chunk (cosine of adjacent states).

p_t = clamp((1 - cos(W_q x_{t-1}, W_k x_t)) / 2, 0, 1),   p = 1 at the first position of a row
(padded form) and at every document start (packed form); a boundary where p > 0.5 (an exact
tie p = 0.5 is not one, as the official argmax picks class 0 on a tie).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.model.cpu_bf16 import Linear


@dataclass
class RoutingOutput:
    """What the router hands to the chunk/dechunk layers and the ratio loss.

    boundary_prob: ``[B, L, 2]`` / ``[T, 2]``, columns (1 - p, p), also at padding positions.
    boundary_mask: ``[B, L]`` / ``[T]`` bool, p > 0.5 and (padded form) a valid position.
    selected_probs: ``[B, L, 1]`` / ``[T, 1]``, p where p > 0.5 else 1 - p (masking ignored);
        the STE's input: its gradient is +dL/dp at boundaries and -dL/dp elsewhere.
    """

    boundary_prob: torch.Tensor
    boundary_mask: torch.Tensor
    selected_probs: torch.Tensor


class RoutingModule(nn.Module):
    """Boundary probabilities from ``W_q``/``W_k`` (``[D, D]``, no bias, identity-initialised).

    Padded form: ``hidden_states [B, L, D]`` with ``mask [B, L]`` (valid tokens a prefix of each
    row). Packed form: ``hidden_states [T, D]`` with ``cu_seqlens [N+1]`` (document offsets).
    Everything runs in the input dtype (the official code has no fp32 island here).
    """

    def __init__(
        self,
        d_model: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.q_proj_layer = Linear(d_model, d_model, bias=False, device=device, dtype=dtype)
        self.k_proj_layer = Linear(d_model, d_model, bias=False, device=device, dtype=dtype)
        self.init_weights()

    def init_weights(self) -> None:
        """The official init: W_q = W_k = I (cosine of the raw states at the start)."""
        with torch.no_grad():
            for layer in (self.q_proj_layer, self.k_proj_layer):
                # zero + diagonal rather than copying torch.eye: cheap on every device (torch.eye
                # on the meta device costs seconds of decomposition set-up)
                layer.weight.zero_().diagonal().fill_(1.0)

    def forward(
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        starts: torch.Tensor | None = None,
    ) -> RoutingOutput:
        """``starts`` (padded form, ``[B, L]`` bool): document starts inside the rows, forced to
        p = 1 like the packed form's ``cu_seqlens`` (rows of packed documents, docs/hnet.md)."""
        packed = cu_seqlens is not None
        if packed == (hidden_states.dim() == 3):
            raise ValueError(
                "RoutingModule: pass hidden_states [B, L, D] (with mask) or [T, D] with cu_seqlens, "
                f"got {tuple(hidden_states.shape)} and cu_seqlens={'set' if packed else 'None'}"
            )
        rows = hidden_states[None] if packed else hidden_states
        queries = F.normalize(self.q_proj_layer(rows[:, :-1]), dim=-1)
        keys = F.normalize(self.k_proj_layer(rows[:, 1:]), dim=-1)
        cos = (queries * keys).sum(-1)
        prob = torch.clamp((1 - cos) / 2, min=0.0, max=1.0)  # a no-op up to rounding
        prob = F.pad(prob, (1, 0), value=1.0)  # the first position always starts a chunk
        if packed:
            prob = prob[0]
            starts = torch.zeros_like(prob, dtype=torch.bool)
            starts[cu_seqlens[:-1].long()] = True
            # a document start is a chunk start whatever its cosine with the previous document
            prob = prob.masked_fill(starts, 1.0)
        elif starts is not None:
            prob = prob.masked_fill(starts, 1.0)
        boundary_prob = torch.stack((1 - prob, prob), dim=-1)
        # argmax over (1 - p, p) with ties to class 0, i.e. a boundary only where p > 0.5
        chosen = boundary_prob[..., 1] > boundary_prob[..., 0]
        selected_probs = torch.where(chosen, boundary_prob[..., 1], boundary_prob[..., 0])[
            ..., None
        ]
        boundary_mask = chosen if mask is None else chosen & mask
        return RoutingOutput(boundary_prob, boundary_mask, selected_probs)
