"""Shared fixtures: a small copy of the embedded stdlib corpus, built once per session."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    """A folder holding `stdlib/` (JSONL shards of the stdlib corpus, ~1 MB); use as data.root_dir."""
    root = tmp_path_factory.mktemp("corpus")
    subprocess.run(
        [sys.executable, "-m", "bytelatent.data.prepare", "--out", str(root / "stdlib"), "--max-mb", "1"],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",  # not region_name in client_kwargs: moto rejects the bucket
}


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 endpoint on 127.0.0.1 (a moto server subprocess); yields its URL."""
    pytest.importorskip("moto", reason="S3 tests need `pip install 'moto[server]' 's3fs[boto3]'`")
    pytest.importorskip("s3fs", reason="S3 tests need `pip install 'moto[server]' 's3fs[boto3]'`")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """AWS environment pointing at the moto server, as users configure it (inherited by subprocesses)."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield moto_server
    s3fs.S3FileSystem.clear_instance_cache()
