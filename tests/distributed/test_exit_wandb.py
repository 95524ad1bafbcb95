"""`cleanup_and_exit` leaves through `os._exit`, which skips atexit: it must finish wandb first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, wandb
from bytelatent.distributed.env import cleanup_and_exit
run = wandb.init(project="p", mode="offline", dir=sys.argv[1], settings=wandb.Settings(console="off"))
run.log({"loss": 1.0}, step=1)
run.log({"loss": 0.5}, step=2)  # still pending in the open row until finish
cleanup_and_exit(0)
"""


def test_cleanup_and_exit_finishes_an_open_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    from tests.trainer.wandb_offline import offline_runs

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = offline_runs(tmp_path / "wandb")
    assert run.exited and [row["_step"] for row in run.history] == [1, 2]
