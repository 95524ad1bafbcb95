"""The code follows ruff.toml: lint rules and formatting (ruff comes with the `test` extra, so CI
runs this on every submission; `ruff check --fix . && ruff format .` repairs most of it)."""

import subprocess
import sys

import pytest

from tests.limits import hang_limit
from tests.paths import REPO


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff(command):
    res = subprocess.run(
        [sys.executable, "-m", "ruff", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert (
        res.returncode == 0
    ), f"ruff {' '.join(command)}:\n{res.stdout[-4000:]}{res.stderr[-2000:]}"
