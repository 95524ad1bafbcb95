"""Shared fixtures: a small copy of the embedded stdlib corpus, built once per session."""

import subprocess
import sys
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
