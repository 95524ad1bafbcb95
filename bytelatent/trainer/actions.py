"""Actions: small objects the loop runs after every log step and every evaluation (T5X's shape).

An action looks at the step and the metrics just produced and may ask the loop to stop
(`Stop`): early stopping saves and exits 0; a guard may stop without saving and exit non-zero.
Each action's state (best value, patience left, ...) is JSON in `TrainState.actions`, so it
survives a resume. To add one: an args class with a unique `kind` literal (add it to
`ActionArgs`), an `Action` subclass, and one line in `_ACTION_TYPES`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("bytelatent")


@dataclass(frozen=True)
class Stop:
    """An action's request to end the run."""

    reason: str
    save: bool = True  # save a checkpoint before leaving (never for non-finite weights)
    exit_code: int = 0


class EarlyStopArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["early_stop"] = "early_stop"
    metric: str = Field("val/bpb", description="a key of the train or eval metrics")
    mode: Literal["min", "max"] = "min"
    patience: int = Field(3, ge=1, description="evaluations without improvement before stopping")
    min_delta: float = Field(0.0, ge=0.0, description="smallest change that counts as improvement")


ActionArgs = Annotated[EarlyStopArgs, Field(discriminator="kind")]


class Action:
    """Base class: `run` returns a `Stop` to end the run, or None to go on."""

    kind: str = ""

    def run(self, step: int, metrics: dict[str, Any]) -> Stop | None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class EarlyStop(Action):
    """Stop when `metric` has not improved by `min_delta` for `patience` reports of it."""

    kind = "early_stop"

    def __init__(self, args: EarlyStopArgs):
        self.args = args
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_reports = 0

    def run(self, step: int, metrics: dict[str, Any]) -> Stop | None:
        value = metrics.get(self.args.metric)
        if value is None or not math.isfinite(value):
            return None
        sign = 1.0 if self.args.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.args.min_delta:
            self.best, self.best_step, self.bad_reports = float(value), step, 0
            return None
        self.bad_reports += 1
        if self.bad_reports < self.args.patience:
            return None
        return Stop(
            f"early stop at step {step}: {self.args.metric} has not improved on "
            f"{self.best:.6g} (step {self.best_step}) for {self.bad_reports} reports"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_reports": self.bad_reports}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_step = state.get("best_step")
        self.bad_reports = int(state.get("bad_reports", 0))


_ACTION_TYPES: dict[str, type[Action]] = {"early_stop": EarlyStop}


class Actions:
    """The configured actions, run in order; the first `Stop` wins."""

    def __init__(self, actions: list[Action]):
        self.actions = actions

    @classmethod
    def build(cls, args: list[BaseModel]) -> Actions:
        return cls([_ACTION_TYPES[a.kind](a) for a in args])

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def run(self, step: int, metrics: dict[str, Any]) -> Stop | None:
        for action in self.actions:
            stop = action.run(step, metrics)
            if stop is not None:
                return stop
        return None

    def _key(self, index: int, action: Action) -> str:
        return f"{index}:{action.kind}"

    def state_dict(self) -> dict[str, Any]:
        return {self._key(i, a): a.state_dict() for i, a in enumerate(self.actions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, action in enumerate(self.actions):
            if self._key(i, action) in state:
                action.load_state_dict(state[self._key(i, action)])
