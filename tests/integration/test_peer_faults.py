"""A hung or dead peer ends the job with one line naming the rank and the step (issue 22, 9-10).

Two ranks on gloo, launched by hand (no torchrun agent to clean up): one is stopped (SIGSTOP) or
killed (SIGKILL) mid-training; the survivor must exit with code 4 within the collective timeout
plus a few seconds, and say so in one line instead of a backend traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.harness import REPO_ROOT, child_env, model_args, read_metrics
from tests.limits import hang_limit

TIMEOUT_S = 3


def launch_pair(tmp_path: Path, corpus_root: Path) -> list[tuple[subprocess.Popen, Path]]:
    port = str(free_port())
    dump = tmp_path / "run"
    argv = [*model_args("entropy", 2), f"dump_dir={dump}", f"data.root_dir={corpus_root}",
            "steps=100000", "logging.freq=1", "distributed.model_dtype=fp32", "num_threads=1",
            "checkpoint.dump.every=0", f"distributed.timeout_s={TIMEOUT_S}",
            "distributed.first_step_timeout_s=120"]  # fmt: skip
    runs = []
    for rank in (0, 1):
        env = child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                         "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": port, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        err = tmp_path / f"rank{rank}.err"
        proc = subprocess.Popen([sys.executable, "-m", "bytelatent.train", *argv], cwd=REPO_ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=open(err, "w"),
                                start_new_session=True)  # fmt: skip
        runs.append((proc, err))
    deadline = time.monotonic() + hang_limit(180)
    while len(read_metrics(dump)) < 3:
        assert time.monotonic() < deadline, "no training steps within 180 s"
        assert all(p.poll() is None for p, _ in runs), [e.read_text()[-2000:] for _, e in runs]
        time.sleep(0.2)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("fault, victim_rank", [("hung", 1), ("dead", 1), ("dead", 0), ("hung", 0)])
def test_survivor_says_which_rank_in_one_line(tmp_path, corpus_root, fault, victim_rank):
    runs = launch_pair(tmp_path, corpus_root)
    victim = runs[victim_rank][0]
    survivor, err = runs[1 - victim_rank]
    try:
        os.kill(victim.pid, signal.SIGSTOP if fault == "hung" else signal.SIGKILL)
        started = time.monotonic()
        code = survivor.wait(timeout=hang_limit(60))
        waited = time.monotonic() - started
        text = err.read_text()
        lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln]
        assert code == 4, text[-3000:]
        assert waited < TIMEOUT_S + hang_limit(20), waited
        assert "Traceback" not in text, text[-3000:]
        assert len(lines) == 1, text[-3000:]
        assert lines[0].startswith(f"distributed error: rank {1 - victim_rank} at step ")
        assert f"rank {victim_rank} " in lines[0] and "did not answer" in lines[0]
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                os.kill(proc.pid, signal.SIGCONT)
            proc.wait()
