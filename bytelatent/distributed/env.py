"""Launcher detection (torchrun / SLURM srun / single process) and setup.

One code path for a laptop and a cluster: gloo on CPU, nccl on CUDA. A single process has no
process group (`backend is None`) unless it trains through FSDP on a 1-rank mesh
(`distributed.single_device_fsdp`, the default on CUDA: one GPU runs what N GPUs run).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.world import int_env as _int_env
from bytelatent.distributed.world import launch_ranks
from bytelatent.errors import ConfigError
from bytelatent.exit_hooks import before_os_exit_hooks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its ranks, who launched it, its device and backend."""

    rank: int
    local_rank: int
    world_size: int
    launcher: Literal["torchrun", "slurm", "single"]
    device: torch.device
    backend: str | None  # None: single process, no process group


def _default_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def detect_env() -> DistEnv:
    """Read the launcher's environment variables (no side effects)."""
    ranks = launch_ranks()
    device, backend = _default_device(ranks.local_rank)
    if ranks.launcher == "single":
        backend = None
    return DistEnv(ranks.rank, ranks.local_rank, ranks.world_size, ranks.launcher, device, backend)


def slurm_master_addr(nodelist: str) -> str:
    """First host of an allocation (`scontrol show hostnames` expands `node[01-04]`)."""
    if shutil.which("scontrol") is None:
        raise RuntimeError("SLURM launch without `scontrol` on PATH; set MASTER_ADDR")
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not out:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} printed no host")
    return out[0]


def slurm_master_port(job_id: str, step_id: str) -> int:
    """A port every task of a step derives alike; steps of one job get different ports. Below
    Linux's default ephemeral range (32768-60999), where outgoing connections take ports and a
    listening rendezvous could find its port taken (EADDRINUSE)."""
    return random.Random(f"{job_id}.{step_id}").randint(20000, 32767)


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks of a step on its node `node_id`, from SLURM's compressed SLURM_STEP_TASKS_PER_NODE
    ("2(x3),1": two tasks on each of nodes 0-2, one on node 3)."""
    counts: list[int] = []
    try:
        for part in tasks_per_node.split(","):
            count, _, repeat = part.partition("(x")
            counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
        return counts[node_id]
    except (ValueError, IndexError):
        raise ConfigError(
            f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} has no task count for node {node_id}"
        ) from None


def _export_slurm_rendezvous(env: DistEnv) -> None:
    """torch's env:// rendezvous needs the torchrun variables; derive them from SLURM's."""
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = slurm_master_addr(os.environ["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" not in os.environ:
        port = slurm_master_port(os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"])
        os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(env.rank)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    # Processes on this node (what torchrun exports): CPU thread defaults split this node's
    # cores among them, not among every rank of the job.
    tasks = os.environ.get("SLURM_STEP_TASKS_PER_NODE")
    if tasks and "SLURM_NODEID" in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        local = slurm_tasks_on_node(tasks, _int_env("SLURM_NODEID"))
        os.environ["LOCAL_WORLD_SIZE"] = str(local)


def _set_numerics(args: DistributedArgs) -> None:
    if args.deterministic:
        # read by cuBLAS when its handle is created: set before the first CUDA matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.deterministic)
    torch.backends.cudnn.deterministic = args.deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = args.matmul_allow_tf32
    torch.backends.cudnn.allow_tf32 = args.matmul_allow_tf32
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (
        args.allow_bf16_reduced_precision_reduction
    )
    torch.autograd.set_detect_anomaly(args.detect_anomaly)


def setup_distributed(args: DistributedArgs) -> DistEnv:
    """Detect the launcher, pick the device, and init the process group when world > 1."""
    from bytelatent.compat import check_torch

    check_torch()
    _set_numerics(args)
    if mp.get_start_method(allow_none=True) is None:
        mp.set_start_method(args.spawn_method)
    env = detect_env()
    if env.device.type == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {env.local_rank} but only {torch.cuda.device_count()} CUDA "
                "devices are visible; launch at most one process per GPU"
            )
        torch.cuda.set_device(env.device)
    if env.launcher == "single":
        if not args.use_single_device_fsdp(env.device.type):
            return env
        env = _single_process_group(env, args)
        logger.info("distributed: one process, FSDP2 on a 1-rank mesh (%s)", env.device)
        return env
    if env.launcher == "slurm":
        _export_slurm_rendezvous(env)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=env.backend,
            rank=env.rank,
            world_size=env.world_size,
            device_id=env.device if env.device.type == "cuda" else None,
            timeout=timedelta(seconds=args.first_step_timeout_s),
        )
    logger.info(
        "distributed: rank %d/%d (local %d) via %s on %s, backend %s",
        env.rank,
        env.world_size,
        env.local_rank,
        env.launcher,
        env.device,
        env.backend,
    )
    return env


def _single_process_group(env: DistEnv, args: DistributedArgs) -> DistEnv:
    """A 1-rank process group over an in-memory store (no port, no launcher variables)."""
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    if os.path.exists("/sys/class/net/lo"):
        # gloo groups (CPU side groups, async saves) otherwise bind to the hostname's address,
        # which sandboxes and some nodes do not resolve; one process only needs loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=env.device if env.device.type == "cuda" else None,
            timeout=timedelta(seconds=args.first_step_timeout_s),
        )
    return DistEnv(0, 0, 1, "single", env.device, backend)


def cleanup_and_exit(code: int = 0) -> None:
    """Destroy the process group, flush stdio, then `os._exit(code)`.

    Why `os._exit`: a DeviceMesh keeps its gloo groups alive past destroy_process_group, and at
    interpreter shutdown a gloo worker thread can destroy work that holds Python tensors and
    abort the process ("terminate called without an active exception", SIGABRT in about a
    third of CPU FSDP runs). Skipping interpreter finalisation avoids it, so anything that must
    be flushed (logs, wandb.finish(), async checkpoints) has to be finished before calling this.
    """
    _finish_wandb(code)
    try:
        for hook in before_os_exit_hooks():
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - leaving anyway; say what was not released
                logger.warning("cleanup before exit: %s failed: %s", hook.__qualname__, e)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken pipe: nothing left to save
                pass
        os._exit(code)


def _finish_wandb(code: int) -> None:
    """`os._exit` skips wandb's atexit hook: finish a run still open, then let wandb's service
    flush its files and stop (no-op without wandb)."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    try:
        if getattr(wandb, "run", None) is not None:
            wandb.finish(exit_code=code)
        wandb.teardown(exit_code=code)
    except Exception as e:  # noqa: BLE001 - an observer must not change how the process exits
        logger.warning("wandb.finish failed: %s", e)


def host_to_device(array, device: torch.device) -> torch.Tensor:
    """A numpy array on `device`, without the host waiting (`host_tensor_to_device`)."""
    return host_tensor_to_device(torch.from_numpy(array), device)


def host_tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes through pinned memory with a non-blocking copy:
    `non_blocking` from pageable memory would be a synchronous copy in disguise (the host waits).
    The caching host allocator keeps the pinned block until the copy has run. Elsewhere a plain
    `.to(device)` (the same tensor when it is there already)."""
    if device.type != "cuda":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
