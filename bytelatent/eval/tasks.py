"""The eval task registry: what `eval.tasks` names, and how a new task plugs in.

An evaluation (in-loop, before training, standalone or async) runs each task listed in
`eval.tasks` on the same model and merges the metric dicts they return into one results record
(`metrics.eval.jsonl`, `evals/{step:010d}/results.json`). The built-in task is `bpb` (validation
bits-per-byte, `bytelatent/eval/validate.py`).

Registration contract (e.g. an lm-eval harness adapter in `bytelatent/eval/harness.py`):

    from pydantic import BaseModel, ConfigDict
    from bytelatent.eval.tasks import EvalContext, register_task

    class HarnessArgs(BaseModel):                       # eval.task_args.harness.* (optional)
        model_config = ConfigDict(extra="forbid")
        tasks: list[str] = ["hellaswag"]

    def run_harness(ctx: EvalContext) -> dict[str, float]:
        ...                                              # ctx.model, ctx.forward, ctx.tokenizer, ...
        return {"harness/hellaswag/acc": 0.31}

    register_task("harness", run_harness, args_model=HarnessArgs, in_loop=False)

* The module registers at import time. `PROVIDERS` maps a task name to the module that
  registers it; `harness` and `generation` are already listed, so a module of that name needs no
  edit here. Other modules add a line to `PROVIDERS`. Modules are imported only when a run lists
  the task, so heavy imports (lm_eval) cost nothing otherwise.
* `run(ctx)` is called on every rank (it may use collectives over `ctx.dp_group`; an FSDP model
  needs every rank to run the same number of forwards), under `torch.no_grad()` with the model
  in eval mode. It returns flat `{name: number}`; keys are prefixed by the task
  (`val/...` belongs to `bpb`). Rank 0's dict is what gets recorded.
* `args_model` validates `eval.task_args.<name>` before anything runs; the instance is
  `ctx.task_args`. Errors a user can cause raise `bytelatent.errors` types.
* `in_loop=False` keeps a slow task out of the training loop: it runs only in the standalone
  and async evals (`python -m bytelatent.eval`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pydantic
from pydantic import BaseModel

from bytelatent.errors import ConfigError

if TYPE_CHECKING:
    import torch

PROVIDERS: dict[str, str] = {
    "bpb": "bytelatent.eval.validate",
    "harness": "bytelatent.eval.harness",
    "generation": "bytelatent.eval.generation",
    "chat": "bytelatent.eval.chat",
}


@dataclass
class EvalContext:
    """Everything a task gets: the model, how to run it, where it sits, and the configs."""

    model: torch.nn.Module
    forward: Callable[[Any], torch.Tensor]  # Batch -> logits [B, L, V] float32 (patching handled)
    step: int | None
    eval_args: Any  # EvalArgs
    data_args: Any  # DataArgs (the run's data config; tokenizer and patcher come from it)
    tokenizer: Any
    validation_sources: dict[str, list[str]]  # resolved validation files per source
    device: torch.device
    dp_rank: int
    dp_size: int
    dp_group: Any  # torch.distributed.ProcessGroup | None (None: a single process)
    fsdp: bool  # every rank must run the same number of forwards
    progress: bool  # show tqdm bars (rank 0)
    task_args: BaseModel | None = None


@dataclass(frozen=True)
class EvalTask:
    name: str
    run: Callable[[EvalContext], dict[str, float]]
    args_model: type[BaseModel] | None = None
    in_loop: bool = True


_REGISTRY: dict[str, EvalTask] = {}


def register_task(
    name: str,
    run: Callable[[EvalContext], dict[str, float]],
    *,
    args_model: type[BaseModel] | None = None,
    in_loop: bool = True,
) -> EvalTask:
    """Make `name` usable in `eval.tasks`; registering the same name twice is a bug."""
    existing = _REGISTRY.get(name)
    if existing is not None and existing.run is not run:
        raise ValueError(f"eval task '{name}' is already registered by {existing.run.__module__}")
    task = EvalTask(name=name, run=run, args_model=args_model, in_loop=in_loop)
    _REGISTRY[name] = task
    return task


def known_tasks() -> set[str]:
    """Names `eval.tasks` accepts (registered or provided by a module), without importing."""
    return set(_REGISTRY) | set(PROVIDERS)


def get_task(name: str) -> EvalTask:
    if name not in _REGISTRY and name in PROVIDERS:
        try:
            importlib.import_module(PROVIDERS[name])
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"eval.tasks: task '{name}' is not available ({PROVIDERS[name]}: {e}); "
                "remove it or install what it needs"
            ) from None
    if name not in _REGISTRY:
        raise ConfigError(
            f"eval.tasks: unknown task '{name}'; known tasks: {', '.join(sorted(known_tasks()))}"
        )
    return _REGISTRY[name]


def task_args(task: EvalTask, raw: dict[str, Any]) -> BaseModel | None:
    """Validate `eval.task_args.<name>` with the task's args model (ConfigError on bad keys)."""
    if task.args_model is None:
        if raw:
            raise ConfigError(f"eval.task_args.{task.name}: task '{task.name}' takes no options")
        return None
    try:
        return task.args_model.model_validate(raw)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"eval.task_args.{task.name}.{key}: {err['msg']}") from None
