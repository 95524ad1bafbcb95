"""Actions: small objects the loop runs after every log step and every evaluation (T5X's shape).

An action looks at the step and the metrics just produced and may ask the loop to stop
(`Stop`): early stopping saves and exits 0; a guard may stop without saving and exit non-zero.
`observe` sees a log step's record before it is written and may add an event to it (H-Net's
router collapse warning, `bytelatent/archs/hnet/dc/monitor.py`, an action of its spec).
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

    kind: Literal["early_stop"] = Field(
        "early_stop", description="early_stop: stop (saving) when `metric` stops improving"
    )
    metric: str = Field("val/bpb", description="a key of the train or eval metrics")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher")
    patience: int = Field(3, ge=1, description="evaluations without improvement before stopping")
    min_delta: float = Field(0.0, ge=0.0, description="smallest change that counts as improvement")


class NonFiniteStopArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["nonfinite_stop"] = Field(
        "nonfinite_stop",
        description="nonfinite_stop: stop without saving after consecutive non-finite updates",
    )
    max_skipped_steps: int = Field(
        5, ge=1, description="consecutive skipped (non-finite) updates before the run stops"
    )


ActionArgs = Annotated[EarlyStopArgs | NonFiniteStopArgs, Field(discriminator="kind")]

# Exit code of a run stopped because its updates stayed non-finite (2 is a user error).
NONFINITE_EXIT_CODE = 3


class Action:
    """Base class: `run` returns a `Stop` to end the run, or None to go on."""

    kind: str = ""

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Before the log step's record is written: may add entries to it (an event)."""

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


class NonFiniteStop(Action):
    """Stop without saving after `max_skipped_steps` consecutive skipped updates.

    Reads `skipped_streak` / `nonfinite` that the non-finite guard adds to the log-step metrics
    (bytelatent.trainer.guard); the streak itself is counted on the device, every step.
    """

    kind = "nonfinite_stop"

    def __init__(self, args: NonFiniteStopArgs):
        self.args = args
        self.resumed: tuple[str, int] | None = (
            None  # (checkpoint folder, step) this run resumed from
        )

    def note_resume(self, path: str, step: int) -> None:
        self.resumed = (path, step)

    def run(self, step: int, metrics: dict[str, Any]) -> Stop | None:
        streak = int(metrics.get("skipped_streak", 0))
        if streak < self.args.max_skipped_steps:
            return None
        first = step - streak + 1
        what = metrics.get("nonfinite", "loss or grad_norm")
        verb = "were" if " and " in what else "was"
        return Stop(
            f"non-finite guard: stopping at step {step}: {streak} consecutive updates skipped "
            f"(steps {first}-{step}) because {what} {verb} non-finite; nothing saved, the newest "
            f"checkpoint is the last finite one ({self._advice(first)})",
            save=False,
            exit_code=NONFINITE_EXIT_CODE,
        )

    def _advice(self, first: int) -> str:
        if self.resumed is not None and first == self.resumed[1] + 1:
            # Non-finite from the first step after a resume: the loaded weights are the suspect.
            path = self.resumed[0]
            return (
                f"every update since resuming from {path} was non-finite: that checkpoint may be "
                f"damaged; check it with `python -m bytelatent.checkpoint verify {path}`, or set "
                "checkpoint.load_path to an earlier step folder"
            )
        return "lower optim.lr, set optim.clip, or raise optim.max_skipped_steps"


_ACTION_TYPES: dict[str, type[Action]] = {
    "early_stop": EarlyStop,
    "nonfinite_stop": NonFiniteStop,
}


def with_nonfinite_stop(actions: list[BaseModel], max_skipped_steps: int) -> list[BaseModel]:
    """`actions` plus a `nonfinite_stop` from `optim.max_skipped_steps` unless one is configured
    (0 disables the automatic one: skipped updates are then only counted)."""
    if max_skipped_steps <= 0 or any(a.kind == "nonfinite_stop" for a in actions):
        return list(actions)
    return [*actions, NonFiniteStopArgs(max_skipped_steps=max_skipped_steps)]


class Actions:
    """The configured actions, run in order; the first `Stop` wins."""

    def __init__(self, actions: list[Action]):
        self.actions = actions

    @classmethod
    def build(cls, args: list[BaseModel]) -> Actions:
        return cls([_ACTION_TYPES[a.kind](a) for a in args])

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def note_resume(self, path: str, step: int) -> None:
        """Tell the actions this run resumed from checkpoint `path` at `step`."""
        for action in self.actions:
            if hasattr(action, "note_resume"):
                action.note_resume(path, step)

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        for action in self.actions:
            action.observe(step, metrics)

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
