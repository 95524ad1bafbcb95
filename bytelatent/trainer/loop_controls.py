"""Where the loop stops: `steps`, `max_steps`, or `relative_steps` from wherever the run resumed.

`relative_steps=N` means "N more steps from the step this run starts at". A preempted or
requeued job must not extend the target every time it comes back, so the target is part of the
train state (`TrainState.relative_target = {"relative_steps": N, "stop_step": S}`) and:

* resuming before S with the same N continues to S (requeue, resume, crash recovery);
* a launch that finds S reached, no target, or another N sets a new target: current step + N
  (the documented way to ask for N more steps after a run finished).
"""

from __future__ import annotations

from bytelatent.args import TrainArgs
from bytelatent.errors import ConfigError
from bytelatent.trainer.state import TrainState


def resolve_stop_step(args: TrainArgs, state: TrainState) -> int:
    """The step the loop runs to; records a new relative target in `state` when it sets one."""
    if args.relative_steps is None:
        return args.max_steps or args.steps
    n = args.relative_steps
    target = state.relative_target or {}
    if target.get("relative_steps") == n and state.step < target.get("stop_step", 0):
        stop = int(target["stop_step"])
    else:
        stop = state.step + n
        state.relative_target = {"relative_steps": n, "stop_step": stop}
    if stop > args.steps:
        raise ConfigError(
            f"relative_steps={n}: the run is at step {state.step}, so it would stop at {stop}, past "
            f"steps={args.steps} (the LR schedule's horizon); raise steps"
        )
    return stop
