"""Fixtures for checkpoint tests: multi-rank launcher and a real S3 endpoint (moto server)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from ckpt_launch import free_port
from ckpt_launch import run_ranks as _run_ranks


@pytest.fixture
def run_ranks() -> Callable[..., None]:
    """run_ranks(world, *worker_args, timeout=...) runs ckpt_worker.py on `world` ranks."""
    return _run_ranks


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
