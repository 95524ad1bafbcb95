"""H-Net's ratio (load-balancing) loss: pushes each stage toward one boundary every N positions.

    F = mean(boundary_mask), G = mean(p)   over ALL positions (padding included, as officially)
    loss = N/(N-1) * ((1-F)(1-G) + (N-1) F G)      float32 scalar; equals 1 at F = G = 1/N

F comes from a bool mask, so the gradient reaches only p (through G).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bytelatent.archs.hnet.dc.routing import RoutingOutput


def boundary_statistics(
    boundary_prob: torch.Tensor, boundary_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, G): the fraction of positions that are boundaries and the mean p, fp32 scalars."""
    return boundary_mask.float().mean(), boundary_prob[..., 1].float().mean()


def load_balancing_loss(
    boundary_prob: torch.Tensor, boundary_mask: torch.Tensor, target_ratio: float
) -> torch.Tensor:
    """The loss of one stage; ``target_ratio`` N > 1 is the target compression (bytes per chunk)."""
    if not target_ratio > 1:
        raise ValueError(f"ratio loss: target_ratio N must be > 1, got {target_ratio}")
    return loss_from_statistics(*boundary_statistics(boundary_prob, boundary_mask), target_ratio)


def loss_from_statistics(
    selected_fraction: torch.Tensor, mean_prob: torch.Tensor, target_ratio: float
) -> torch.Tensor:
    """N/(N-1) * ((1-F)(1-G) + (N-1) F G) from F and G (e.g. over the valid positions only)."""
    n = target_ratio
    balance = (1 - selected_fraction) * (1 - mean_prob) + (n - 1) * selected_fraction * mean_prob
    return balance * n / (n - 1)


def ratio_loss(
    routing: Sequence[RoutingOutput], target_ratios: Sequence[float], weight: float
) -> torch.Tensor:
    """``weight`` (alpha) times the sum of the per-stage losses, outermost stage first."""
    if len(routing) != len(target_ratios):
        raise ValueError(
            f"ratio loss: {len(routing)} routed stages but {len(target_ratios)} target ratios"
        )
    losses = [
        load_balancing_loss(out.boundary_prob, out.boundary_mask, n)
        for out, n in zip(routing, target_ratios)
    ]
    return weight * torch.stack(losses).sum()
