"""Fixtures for checkpoint tests: multi-rank launcher and a real S3 endpoint (moto server)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ckpt_launch import run_ranks as _run_ranks


@pytest.fixture
def run_ranks() -> Callable[..., None]:
    """run_ranks(world, *worker_args, timeout=...) runs ckpt_worker.py on `world` ranks."""
    return _run_ranks


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    """A fresh bucket on the moto server, with the AWS env (also inherited by worker subprocesses)."""
    import uuid

    from bytelatent.checkpoint.fs import get_fs

    bucket = f"ckpt-{uuid.uuid4().hex[:10]}"
    get_fs(f"s3://{bucket}").mkdir(bucket)
    return f"s3://{bucket}"
