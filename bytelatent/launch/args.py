"""Arg types of the jobs we launch: `SlurmArgs` (one sbatch job) and `EnvVars` (its environment).

`SlurmArgs` is read by the training launcher (`bytelatent/launch/slurm.py`) and, as
`eval.async_launch.slurm`, by the async eval launcher; both types live apart from the launchers
so that `EvalArgs` and `TrainArgs` can use them without importing a launcher.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_env(env: dict[str, str]) -> dict[str, str]:
    # The names end up in `export NAME=...` lines of sbatch scripts and in exec environments.
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not an environment variable name "
                "(letters, digits and _, not starting with a digit)"
            )
        if "\0" in value:
            raise ValueError(f"{name}: an environment value cannot hold a NUL byte")
    return env


# Environment variables a job exports: names a shell accepts, values without NUL bytes.
EnvVars = Annotated[dict[str, str], AfterValidator(_check_env)]


class SlurmArgs(BaseModel):
    """Resources and launch options of one sbatch job (training options stay in the config)."""

    model_config = ConfigDict(extra="forbid")

    job_name: str | None = Field(None, description="default: the config's name")
    nodes: int = Field(1, ge=1, description="#SBATCH --nodes (one task per node)")
    nproc_per_node: int = Field(1, ge=1, description="training processes per node (GPUs per node)")
    gpus_per_node: int | None = Field(None, ge=0, description="#SBATCH --gpus-per-node")
    cpus_per_task: int | None = Field(None, ge=1, description="CPUs per node (one task per node)")
    mem: str | None = Field(None, description="#SBATCH --mem, e.g. 0 (all) or 200G")
    time: str | None = Field(None, description="#SBATCH --time, e.g. 72:00:00")
    partition: str | None = Field(None, description="#SBATCH --partition")
    account: str | None = Field(None, description="#SBATCH --account")
    qos: str | None = Field(None, description="#SBATCH --qos")
    constraint: str | None = Field(None, description="#SBATCH --constraint (node features)")
    signal_seconds: int = Field(120, ge=1, description="USR2 this long before the time limit")
    requeue: bool = Field(True, description="#SBATCH --requeue; false: --no-requeue")
    launcher: Literal["auto", "direct", "srun"] = Field(
        "auto", description="auto: direct on one node, srun on several"
    )
    python: str = Field(sys.executable, description="interpreter on the compute nodes")
    module: str = Field("bytelatent.train", description="python module to run (-m)")
    workdir: str = Field(default_factory=os.getcwd, description="cd here before training")
    log_dir: str | None = Field(None, description="default: {dump_dir}/slurm")
    setup: list[str] = Field(default_factory=list, description="shell lines run before training")
    sbatch_args: list[str] = Field(default_factory=list, description="extra sbatch options")

    def resolved_launcher(self) -> Literal["direct", "srun"]:
        if self.launcher == "auto":
            return "direct" if self.nodes == 1 else "srun"
        return self.launcher
