"""Gradient-norm clipping over any mix of plain tensors and DTensors (any mesh, any placement).

torch's clip_grad_norm_ stacks all per-grad norms into one tensor, which fails when plain
tensors and DTensors are mixed (TP-only or partially sharded models) or when DTensors live on
different meshes (TP × FSDP). Here grads are grouped by mesh, each group's norm is reduced to a
plain tensor, and the groups are combined; the clip itself scales the local shards in place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _group_by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    return groups


class _SequentialReduceNotice(logging.Filter):
    """Drops DTensor's notice that reducing a norm that is partial over two mesh dims (TP x FSDP)
    takes "2 sequential all_reduce operations ... suboptimal ... may give inconsistent results
    between ranks". Here it is a few norms per step (tiny collectives), and not inconsistent:
    after the first all-reduce every rank of a group holds the same value, so the second reduces
    identical inputs on every group. Other messages of that logger pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_reduce operations" not in record.getMessage()


_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def _group_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    notice = _SequentialReduceNotice()  # get_total_norm's stack and full_tensor both reduce
    _REDISTRIBUTE_LOG.addFilter(notice)
    try:
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces partial/sharded norms over the mesh
    finally:
        _REDISTRIBUTE_LOG.removeFilter(notice)
    return norm.float()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip grads to `max_norm` (skipped when max_norm <= 0); return the total norm.

    The returned norm is a plain scalar tensor, identical on every rank and equal to the norm a
    single process would compute over the full gradients.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    norms = [_group_norm(group, norm_type, foreach) for group in _group_by_mesh(grads).values()]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Scaling is linear, so scaling local shards is right for sharded, replicated and
        # partial grads alike.
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_kind.setdefault((local.device, local.dtype), []).append(local)
        for (dev, dtype), tensors in by_kind.items():
            torch._foreach_mul_(tensors, scale.to(device=dev, dtype=dtype))
    return total
