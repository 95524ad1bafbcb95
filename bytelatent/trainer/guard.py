"""Non-finite guard: an optimizer update whose loss or gradient norm is not finite is skipped.

The decision stays on the device, so the hot path never waits for the host:

* fused AdamW (the default, on CUDA and CPU): the optimizer's `found_inf` tensor
  (the path GradScaler uses) makes the fused kernel leave parameters, moments and step counts
  untouched when it is 1; with 0 the update is bitwise the unguarded one.
* foreach AdamW on CPU (`optim.fused=false`): the flag is a CPU tensor, so reading it costs no device sync; the step
  simply is not called.
* foreach AdamW on an accelerator (`optim.fused=false`): there is no masked path, so the flag is
  read every step (warned once).

Counters (consecutive skips, skips this log interval, what was non-finite) are device tensors
read at log steps (`read`) and before every save (`safe_to_save`), where a sync is acceptable.
The stop after `optim.max_skipped_steps` consecutive skips is an action (`NonFiniteStop`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger("bytelatent")

LOSS_BIT, GRAD_NORM_BIT = 1, 2


def describe_nonfinite(bits: int) -> str:
    """'loss', 'grad_norm' or 'loss and grad_norm' for the bitmask kept by the guard."""
    names = [name for bit, name in ((LOSS_BIT, "loss"), (GRAD_NORM_BIT, "grad_norm")) if bits & bit]
    return " and ".join(names) or "nothing"


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class NonFiniteGuard:
    """Wraps `optimizer.step()`: skips updates with a non-finite loss or gradient norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = device
        self.fused = bool(optimizer.defaults.get("fused"))
        self.host_check = not self.fused  # CPU: free; accelerator + foreach: a sync (warned)
        if self.host_check and device.type != "cpu":
            logger.warning(
                "non-finite guard: optim.fused=false on %s reads a flag every step (a host sync); "
                "leave optim.fused unset for the fused AdamW path",
                device.type,
            )
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.what = torch.zeros((), dtype=torch.int64, device=device)

    @torch.no_grad()
    def step(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """`optimizer.step()` unless the loss (on any rank) or the gradient norm is non-finite."""
        if isinstance(loss_sum, DTensor):  # tensor-parallel loss: this rank's part (reduced below)
            loss_sum = loss_sum.to_local()
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        loss_bad = (~torch.isfinite(loss_sum)).to(torch.int64).reshape(())
        if _world() > 1:
            # Ranks see different losses; they must take the same decision or shards drift apart.
            # A device all-reduce is queued like any collective: no host sync.
            dist.all_reduce(loss_bad)
        loss_bad = (loss_bad > 0).to(torch.int64)
        norm_bad = (~torch.isfinite(grad_norm.to(self.device))).to(torch.int64).reshape(())
        bits = loss_bad * LOSS_BIT + norm_bad * GRAD_NORM_BIT
        bad = (bits > 0).to(torch.int64)
        self.streak.add_(1).mul_(bad)  # +1 on a skip, 0 on a good update
        self.skipped.add_(bad)
        self.what.copy_(torch.where(bad.bool(), bits, self.what))
        if self.fused:
            self.optimizer.found_inf = bad.to(torch.float32)
            self.optimizer.step()
        elif not bool(bad):
            self.optimizer.step()

    def read(self) -> dict[str, int | str]:
        """Metrics for a log step (one host read); resets the per-interval skip count."""
        streak, skipped, what = torch.stack([self.streak, self.skipped, self.what]).tolist()
        self.skipped.zero_()
        out: dict[str, int | str] = {"skipped_steps": int(skipped), "skipped_streak": int(streak)}
        if streak > 0:
            out["nonfinite"] = describe_nonfinite(int(what))
        return out

    @torch.no_grad()
    def safe_to_save(self, model: torch.nn.Module, step: int, final: bool = False) -> bool:
        """False (logged) if the last update was skipped or any weight is non-finite.

        Collective: every rank calls it before a save and all get the same answer. `final`: the
        run's last save; refusing it is an error (logged as one ERROR line; the caller exits with
        NONFINITE_EXIT_CODE), since the run then ends without its result.
        """
        locals_ = [
            (p.to_local() if isinstance(p, DTensor) else p).detach() for p in model.parameters()
        ]
        finite = torch.stack([torch.isfinite(t).all() for t in locals_]).all() if locals_ else None
        bad = torch.zeros(2, dtype=torch.int64, device=self.device)
        bad[0] = self.streak
        if finite is not None:
            bad[1] = (~finite).to(torch.int64)
        if _world() > 1:
            dist.all_reduce(bad)
        streak_bad, weights_bad = (int(v) > 0 for v in bad.tolist())
        what = "final checkpoint" if final else "checkpoint"
        ending = "; the run ends without its final checkpoint" if final else ""
        if weights_bad:
            logger.error(
                "step %d: not saving a %s: some weights are non-finite%s", step, what, ending
            )
        elif streak_bad:
            (logger.error if final else logger.warning)(
                "step %d: not saving a %s: the last %d update(s) were skipped (non-finite "
                "%s); the previous checkpoint stays the newest%s",
                step,
                what,
                int(self.streak),
                describe_nonfinite(int(self.what)),
                ending,
            )
        return not (streak_bad or weights_bad)
