"""Start checkpoint test workers (ckpt_worker.py) as separate processes, one per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.limits import hang_limit

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    return env


def start_ranks(world: int, *args: str) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env=worker_env(rank, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]


def run_ranks(world: int, *args: str, timeout: float = hang_limit(120)) -> None:
    """Run ckpt_worker.py on `world` ranks and fail the test if any rank fails or times out."""
    procs = start_ranks(world, *args)
    deadline = time.monotonic() + timeout
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out = "".join(p.communicate()[0] or "" for p in procs)
            pytest.fail(f"worker {args} timed out after {timeout}s:\n{out[-4000:]}")
        outputs.append((proc.returncode, out))
    bad = [(rank, rc, out) for rank, (rc, out) in enumerate(outputs) if rc != 0]
    if bad:
        # Show every failing rank: the first real error is often on the rank that did not fail first.
        report = "\n".join(f"--- rank {r} exited {rc}:\n{out[-3000:]}" for r, rc, out in bad)
        pytest.fail(f"worker {args} failed:\n{report}")
