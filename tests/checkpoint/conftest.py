"""Fixtures for checkpoint tests: multi-rank launcher and a real S3 endpoint (moto server)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])
        ),
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


@pytest.fixture
def run_ranks() -> Callable[..., None]:
    """run_ranks(world, *worker_args, timeout=...) runs ckpt_worker.py on `world` ranks; fails on error."""

    def run(world: int, *args: str, timeout: float = 120) -> None:
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
            rank, rc, out = bad[0]
            pytest.fail(f"worker {args} rank {rank} exited {rc}:\n{out[-4000:]}")

    return run


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A real S3 endpoint on 127.0.0.1 (moto server subprocess); yields its URL."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.05)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_bucket(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the moto server, with the AWS env (also inherited by worker subprocesses)."""
    import uuid

    from bytelatent.checkpoint.fs import get_fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    bucket = f"ckpt-{uuid.uuid4().hex[:10]}"
    get_fs(f"s3://{bucket}").mkdir(bucket)
    return f"s3://{bucket}"
