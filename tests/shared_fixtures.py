"""Session artifacts built once per test run, also under `pytest -n N` (xdist).

Each xdist worker runs its own session, so a session fixture would otherwise be built once per
worker (a trained run, the reference runs). `built_once` builds it in the folder that all workers
of this run share (the parent of each worker's base temp), under a file lock; the first worker to
get the lock builds it and the others read it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp folder of this whole test run (all xdist workers), or of this session."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> Path:
    """`<shared root>/name`, made by `build(folder)` unless a worker already made it."""
    folder = shared_root(tmp_path_factory) / name
    done = folder.with_name(f"{name}.built")  # beside it: the folder holds only what build made
    with FileLock(f"{folder}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            done.touch()
    return folder
