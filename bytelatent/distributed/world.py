"""The world a process belongs to, read from the launcher's environment, and the mesh layout
that must fill it. Torch-free: `python -m bytelatent.train` checks a config against it before
it imports torch (`bytelatent/preflight.py`); `env.py` and `mesh.py` build on it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from bytelatent.distributed.args import DistributedArgs
from bytelatent.errors import ConfigError

Launcher = Literal["torchrun", "slurm", "single"]


def int_env(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r}: expected an integer") from None


@dataclass(frozen=True)
class LaunchRanks:
    rank: int
    local_rank: int
    world_size: int
    launcher: Launcher


def launch_ranks() -> LaunchRanks:
    """This process's ranks from torchrun's or srun's variables (no side effects)."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return LaunchRanks(
            int_env("RANK"), int_env("LOCAL_RANK"), int_env("WORLD_SIZE"), "torchrun"
        )
    if "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" in os.environ:
        # Only inside an srun step: a batch script or salloc shell is one process even when
        # SLURM_NTASKS > 1, and waiting for the other tasks would hang.
        tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in os.environ else "SLURM_NTASKS"
        return LaunchRanks(
            int_env("SLURM_PROCID"), int_env("SLURM_LOCALID"), int_env(tasks), "slurm"
        )
    return LaunchRanks(0, 0, 1, "single")


@dataclass(frozen=True)
class MeshLayout:
    """Resolved sizes of the three mesh dimensions (no -1 left)."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp


def resolve_layout(args: DistributedArgs, world_size: int) -> MeshLayout:
    """Fill the -1 dimension and check the product against the world size."""
    sizes = {
        "dp_replicate": args.dp_replicate,
        "dp_shard": args.dp_shard,
        "tp_size": args.tp_size,
    }
    if args.fsdp_type == "no_shard":
        # Replication only: every data-parallel rank goes to dp_replicate.
        sizes["dp_shard"] = 1
        if args.tp_size != -1 and args.dp_replicate == 1:
            sizes["dp_replicate"] = -1
    fill = [name for name, size in sizes.items() if size == -1]
    if fill:
        known = 1
        for size in sizes.values():
            if size != -1:
                known *= size
        if world_size % known:
            others = " × ".join(f"{n}({s})" for n, s in sizes.items() if s != -1)
            raise ConfigError(
                f"distributed: WORLD_SIZE {world_size} is not divisible by {others} = {known}, "
                f"so {fill[0]}=-1 cannot fill it"
            )
        sizes[fill[0]] = world_size // known
    product = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp_size"]
    if product != world_size:
        dims = " × ".join(f"{n}({s})" for n, s in sizes.items())
        if world_size == 1:  # the usual cause: a multi-rank config started without a launcher
            raise ConfigError(
                f"distributed: {dims} = {product} but this is one process (no torchrun or srun "
                f"variables); launch {product} with `torchrun --nproc-per-node {product} -m "
                "bytelatent.train ...`, or set them to 1"
            )
        raise ConfigError(
            f"distributed: {dims} = {product} but WORLD_SIZE is {world_size}; "
            "change them or set one to -1 to fill"
        )
    return MeshLayout(sizes["dp_replicate"], sizes["dp_shard"], sizes["tp_size"])
