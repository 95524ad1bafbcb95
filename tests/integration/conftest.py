"""Fixtures for end-to-end training tests: the stdlib corpus (built once) and a process runner."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import REPO_ROOT, Runner, child_env, model_args

from tests.limits import hang_limit
from tests.shared_fixtures import built_once


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding `stdlib/`, made by `python -m bytelatent.data.prepare` (the documented way)."""

    def build(root: Path) -> None:
        cmd = [sys.executable, "-m", "bytelatent.data.prepare", "--out", str(root / "stdlib")]
        subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), check=True, capture_output=True,
                       timeout=hang_limit(300))  # fmt: skip

    return built_once(tmp_path_factory, "integration_data", build)


@pytest.fixture
def runner(data_root: Path, tmp_path: Path) -> Iterator[Runner]:
    r = Runner(data_root, tmp_path)
    try:
        yield r
    finally:
        r.cleanup()


class References:
    """Uninterrupted 20-step runs, one per (model, nproc), run at most once per test run (shared by
    xdist workers: tests/shared_fixtures.py)."""

    def __init__(self, data_root: Path, tmp_path_factory: pytest.TempPathFactory):
        self.data_root = data_root
        self.tmp_path_factory = tmp_path_factory

    def dump_dir(self, model: str, nproc: int) -> Path:
        def build(folder: Path) -> None:
            runner = Runner(self.data_root, folder)
            try:
                runner.start("run", model_args(model, nproc), nproc=nproc).wait_ok()
            finally:
                runner.cleanup()

        return built_once(self.tmp_path_factory, f"ref-{model}-{nproc}", build) / "run"


@pytest.fixture(scope="session")
def references(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(data_root, tmp_path_factory)
