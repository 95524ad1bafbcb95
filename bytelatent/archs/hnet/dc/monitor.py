"""Router collapse: a warning (and a metric) when a stage's learned chunk size stays far from its
target for several log steps in a row (docs/hnet.md, "Router collapse").

A router can collapse to (almost) no chunk boundaries (a whole row in one chunk) or to a boundary
at (almost) every position; the ratio loss is meant to prevent both, and a run whose ratio loss
weight is too small, or whose learning rate is too large, trains on in that state. The rule, per
stage s with target N = `stages[s].target_ratio` and the log interval's mean chunk size
L = `aux/chunk_len_mean/stage{s}` (input positions per chunk, L >= 1):

* too few boundaries: L > 4 N;
* too many boundaries: L - 1 < (N - 1) / 4 (within a quarter of the target's distance from one
  position per chunk: N = 4 gives L < 1.75).

A stage in that state for `PATIENCE` consecutive log steps spanning at least `MIN_STEPS`
optimizer steps is warned about once (on rank 0; again only after it recovered and collapsed
anew), and each metric record while it lasts gets `hnet/router_collapse/stage{s}` = L / N. Log
steps within the lr warmup do not count: the router's start-up overshoot is expected (the debug
model goes from 4.8 N at step 10 to 34 N at step 20 and is back near N by step 30; at
`logging.freq=1` that is 20 log steps in a row).
"""

from __future__ import annotations

import logging
from typing import Any

from bytelatent.trainer.actions import Action, Stop

logger = logging.getLogger("bytelatent")

PATIENCE = 5  # consecutive log steps
MIN_STEPS = 100  # optimizer steps from the first of them
FEW_FACTOR = 4.0  # L > 4 N: too few boundaries
MANY_FRACTION = 0.25  # L - 1 < (N - 1) / 4: too many boundaries


def collapse_side(chunk_len: float, target: float) -> str | None:
    """'few' / 'many' (boundaries) when `chunk_len` is far from `target` by the rule above."""
    if chunk_len > FEW_FACTOR * target:
        return "few"
    if chunk_len - 1 < MANY_FRACTION * (target - 1):
        return "many"
    return None


class RouterCollapseMonitor(Action):
    """Warns about a collapsed router; never stops the run."""

    kind = "hnet_router_collapse"

    def __init__(
        self, targets: list[float], weights: list[float], warmup: int = 0, warn: bool = True
    ) -> None:
        self.targets, self.weights, self.warmup, self.warn = targets, weights, warmup, warn
        self.streaks = [0] * len(targets)  # consecutive far log steps per stage
        self.since: list[int | None] = [None] * len(targets)  # the first of them
        self.warned = [False] * len(targets)  # this episode was reported
        self.key = "model"  # what the config called its section (hnet_actions sets it)

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        for s, target in enumerate(self.targets):
            value = metrics.get(f"aux/chunk_len_mean/stage{s}")
            if value is None or step <= self.warmup:
                continue
            side = collapse_side(float(value), target)
            if side is None:
                self.streaks[s], self.since[s], self.warned[s] = 0, None, False
                continue
            self.streaks[s] += 1
            if self.since[s] is None:
                self.since[s] = step
            if self.streaks[s] < PATIENCE or step - self.since[s] < MIN_STEPS:
                continue
            metrics[f"hnet/router_collapse/stage{s}"] = float(value) / target
            if not self.warned[s]:
                self.warned[s] = True
                if self.warn:
                    logger.warning(self._line(s, step, float(value), side))

    def _line(self, s: int, step: int, value: float, side: str) -> str:
        what = "almost no chunk boundaries" if side == "few" else "a boundary almost everywhere"
        return (
            f"H-Net router collapse at step {step}: stage {s} has {value:.3g} positions per "
            f"chunk (aux/chunk_len_mean/stage{s}) since step {self.since[s]}, target "
            f"{self.targets[s]:g}: {what}; raise {self.key}.stages[{s}].ratio_loss_weight (now "
            f"{self.weights[s]:g}) or lower optim.lr"
        )

    def run(self, step: int, metrics: dict[str, Any]) -> Stop | None:
        return None  # a warning, not a reason to stop

    def state_dict(self) -> dict[str, Any]:
        return {"streaks": self.streaks, "since": self.since, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved episode, when it is one of this many stages (else start afresh)."""
        saved = [state.get(k) for k in ("streaks", "since", "warned")]
        if all(isinstance(v, list) and len(v) == len(self.targets) for v in saved):
            self.streaks = [int(v) for v in saved[0]]
            self.since = [None if v is None else int(v) for v in saved[1]]
            self.warned = [bool(v) for v in saved[2]]


def hnet_actions(train_args: Any, rank: int) -> list[Action]:
    """The H-Net spec's `actions`: the router collapse monitor (warnings on rank 0 only)."""
    stages = train_args.model.stages
    targets, weights = [s.target_ratio for s in stages], [s.ratio_loss_weight for s in stages]
    monitor = RouterCollapseMonitor(targets, weights, train_args.optim.warmup, warn=rank == 0)
    monitor.key = getattr(train_args, "model_key", "model")  # the section as the config named it
    return [monitor]
