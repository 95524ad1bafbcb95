"""`EvalArgs`: the `eval:` section of a training run (and of `python -m bytelatent.eval`).

eval.every               steps between in-loop validations (0: off)
eval.before_training     validate the initial or restored model before the first step
eval.tasks               what an evaluation runs (default: ["bpb"], validation bits-per-byte);
                         names come from the registry in bytelatent/eval/tasks.py
eval.task_args           per-task options, {task name: {...}}, validated by that task
eval.validation.*        which data, how many batches, batch size and row length
eval.async_launch.*      on every `checkpoint.eval` save, evaluate that checkpoint in a
                         separate job (local detached process or SLURM) without waiting
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from bytelatent.eval.tasks import known_tasks
from bytelatent.launch.args import EnvVars, SlurmArgs


class ValidationArgs(BaseModel):
    """Validation data. Each entry of `sources` is one source, reported as `val/<name>/bpb`."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str] | None = Field(
        None,
        description="null: the *.val.jsonl files beside each training source; else entries that "
        "are training source names (their *.val.jsonl), or files/directories/globs, local or "
        "s3://, relative to data.root_dir unless absolute",
    )
    max_batches: int | None = Field(
        None, ge=1, description="batches per source (over all ranks); null: one full pass"
    )
    batch_size: int | None = Field(None, ge=1, description="default: data.batch_size")
    seq_len: int | None = Field(None, ge=1, description="row length; default: data.seq_len")


class AsyncLaunchArgs(BaseModel):
    """How `checkpoint.eval` saves are evaluated by separate jobs (the training never waits)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["none", "local", "slurm"] = Field(
        "none",
        description="none; local: a detached process on this machine; slurm: an sbatch job",
    )
    devices: str | None = Field(
        None, description="local: CUDA_VISIBLE_DEVICES of the eval process (e.g. '6,7'); null: CPU"
    )
    nproc: int = Field(1, ge=1, description="eval processes per job (torchrun when > 1)")
    python: str = Field(sys.executable, description="interpreter that runs the eval")
    overrides: list[str] = Field(
        default_factory=list,
        description="extra key=value arguments of the eval job (e.g. data.root_dir=/fast/data)",
    )
    env: EnvVars = Field(default_factory=dict, description="extra environment variables")
    nice: int = Field(0, ge=0, le=19, description="local: run the eval with this niceness")
    num_threads: int | None = Field(
        None,
        ge=1,
        description="OMP_NUM_THREADS of the eval job (null: 1 for a local CPU job, which shares "
        "the trainer's cores; else inherited / torch's)",
    )
    poll_interval_s: float = Field(
        10.0, gt=0, description="how often the trainer checks its eval jobs (non-blocking)"
    )
    wait_on_exit_s: float = Field(
        0.0, ge=0, description="at the end of training wait this long for eval jobs (0: never)"
    )
    slurm: SlurmArgs = Field(
        default_factory=lambda: SlurmArgs(time="01:00:00", requeue=False),
        description="sbatch options of eval jobs (same fields as the training launcher)",
    )


class EvalArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(0, ge=0, description="steps between in-loop validations; 0 = off")
    before_training: bool = Field(
        False, description="validate the initial or restored model before the first step"
    )
    tasks: list[str] = Field(
        default_factory=lambda: ["bpb"],
        description="what an evaluation runs: bpb (validation bits per byte), harness (lm-eval; "
        "not in the loop), registry in bytelatent/eval/tasks.py",
    )
    task_args: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-task options, {task name: {...}}, checked by it"
    )
    validation: ValidationArgs = Field(
        default_factory=ValidationArgs,
        description="validation data: sources, batches, batch size and row length",
    )
    async_launch: AsyncLaunchArgs = Field(
        default_factory=AsyncLaunchArgs,
        description="evaluate each checkpoint.eval save in a separate job; training never waits",
    )
    progress: bool | None = Field(
        None, description="tqdm progress bars in the standalone eval; null: only on a terminal"
    )

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        known = known_tasks()
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise ValueError(
                f"unknown task '{unknown[0]}'; known tasks: {', '.join(sorted(known))}"
            )
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"a task is listed twice in {tasks}")
        return tasks

    @field_validator("task_args")
    @classmethod
    def _args_of_listed_tasks(
        cls, task_args: dict[str, dict[str, Any]], info: ValidationInfo
    ) -> dict[str, dict[str, Any]]:
        stray = sorted(set(task_args) - set(info.data.get("tasks", [])))
        if stray:
            raise ValueError(f"'{stray[0]}' is not in eval.tasks")
        return task_args

    @property
    def enabled(self) -> bool:
        """Whether anything evaluates (so validation data must exist before training starts)."""
        return self.every > 0 or self.before_training or self.async_launch.mode != "none"
