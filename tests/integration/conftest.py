"""Fixtures for end-to-end training tests: the stdlib corpus (built once) and a process runner."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import REPO_ROOT, Runner, child_env, model_args


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding `stdlib/`, made by `python -m bytelatent.data.prepare` (the documented way)."""
    root = tmp_path_factory.mktemp("data")
    subprocess.run(
        [sys.executable, "-m", "bytelatent.data.prepare", "--out", str(root / "stdlib")],
        cwd=REPO_ROOT,
        env=child_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root


@pytest.fixture
def runner(data_root: Path, tmp_path: Path) -> Iterator[Runner]:
    r = Runner(data_root, tmp_path)
    try:
        yield r
    finally:
        r.cleanup()


class References:
    """Uninterrupted 20-step runs, one per (model, nproc), run at most once per session."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self._done: dict[tuple[str, int], Path] = {}

    def dump_dir(self, model: str, nproc: int) -> Path:
        key = (model, nproc)
        if key not in self._done:
            run = self.runner.start(f"ref-{model}-{nproc}", model_args(model, nproc), nproc=nproc)
            run.wait_ok()
            self._done[key] = run.dump_dir
        return self._done[key]


@pytest.fixture(scope="session")
def references(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    r = Runner(data_root, tmp_path_factory.mktemp("references"))
    try:
        yield References(r)
    finally:
        r.cleanup()
