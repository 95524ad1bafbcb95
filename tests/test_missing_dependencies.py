"""`python -m bytelatent...` under an interpreter without the dependencies: one line naming them
and the install command, exit 2, no traceback (issue 43, item 5)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.limits import hang_limit
from tests.paths import REPO


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    # -S: no site-packages, so the package is found (PYTHONPATH) and its dependencies are not,
    # as with a system python in a fresh clone
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=hang_limit(60))  # fmt: skip


def test_an_entry_point_without_dependencies_says_what_to_install(tmp_path):
    res = _run(["-m", "bytelatent.train", "config=configs/debug.yaml"], tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("bytelatent: missing dependencies 'torch', ")
    assert "'fsspec'" in lines[0]
    assert lines[0].endswith("run: python3 -m venv .venv && .venv/bin/pip install -e . "
                             "(then source .venv/bin/activate)")  # fmt: skip
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()  # a venv that was not activated
    res = _run(["-m", "bytelatent.generate", "--help"], tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().endswith("run .venv/bin/python -m ... or source .venv/bin/activate")


def test_importing_the_package_is_unchanged(tmp_path):
    res = _run(["-c", "import bytelatent; print(bytelatent.missing_dependencies()[:1])"], tmp_path)
    assert res.returncode == 0 and res.stdout == "['torch']\n", res.stderr
