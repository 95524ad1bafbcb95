"""bench/gpu/check.py runs on CPU (`--device cpu --quick`) so it cannot rot before a GPU is lent."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import check  # noqa: E402


@pytest.mark.slow
def test_quick_check_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run(
        [sys.executable, "bench/gpu/check.py", "--device", "cpu", "--quick", "--out", str(out),
         "--work", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(300),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(statuses) == [name for name, _, _ in check.STEPS]
    assert statuses.pop("throughput_compiled") == "skip"  # inductor runs on the GPU only
    assert set(statuses.values()) == {"ok"}, summary
    assert len(list(out.iterdir())) <= check.MAX_OUT_FILES
    attention = next(s for s in summary["steps"] if s["step"] == "attention")
    assert attention["cases"] >= 16 and attention["worst_rel_err"]["float32"] < 1e-4


def test_a_step_that_overruns_is_recorded_as_timeout(tmp_path, monkeypatch):
    """The driver records what a killed step could not; the summary still lists every step."""
    import steps

    def sleeps(*args, **kwargs):  # the forked step (a copy of this process) overruns for sure
        time.sleep(60)

    monkeypatch.setattr(steps, "run", sleeps)
    monkeypatch.setattr(check, "STEPS", [("env", 60, 0.5)])
    code = check.main(
        ["--device", "cpu", "--quick", "--out", str(tmp_path), "--work", str(tmp_path)]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 1
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [("env", "timeout")]


def test_record_appends_atomically(tmp_path):
    check.record(tmp_path, {"step": "a", "status": "ok"})
    check.record(tmp_path, {"step": "b", "status": "skip", "reason": "r"})
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["a", "b"]
    assert not (tmp_path / "summary.tmp").exists()
