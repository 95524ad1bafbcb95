"""Ctrl-C is a preemption: the run saves at the next step boundary and says so in one line; a
second Ctrl-C stops at once. A rerun after an attempt that saved nothing moves that attempt's
metrics aside (issue 43, item 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import TINY_ENTROPY
from tests.limits import hang_limit
from tests.paths import REPO

ENTRY = REPO / "tests" / "integration" / "train_entry.py"


def _env(**extra: str) -> dict[str, str]:
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in paths if p),
                **extra)  # fmt: skip


def _steps(path, live_only: bool = True) -> list[int]:
    """Steps this attempt logged: the dead attempt's records (`"attempt": "dead"`) are copied to
    metrics.replayed.jsonl before metrics.jsonl is cut back, so for a moment both hold them."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["global_step"] for r in records if not live_only or r.get("attempt") != "dead"]


@pytest.mark.slow
def test_ctrl_c_saves_in_one_line_and_a_dead_attempts_metrics_move_aside(tmp_path, corpus_root):
    dump = tmp_path / "run"
    dump.mkdir()
    # An earlier attempt that died before its first checkpoint left these records behind.
    dead = [json.dumps({"global_step": s, "loss": 9.0, "attempt": "dead"}) for s in (1, 2, 3)]
    (dump / "metrics.jsonl").write_text("\n".join(dead) + "\n")
    args = [f"config={REPO / 'configs/entropy_debug.yaml'}", *TINY_ENTROPY, f"dump_dir={dump}",
            f"data.root_dir={corpus_root}", "steps=10000", "logging.freq=1",
            "checkpoint.dump.every=0"]  # fmt: skip
    # A session of its own: the signal goes to the whole process group, as a terminal's Ctrl-C.
    proc = subprocess.Popen(
        [sys.executable, str(ENTRY), *args], cwd=REPO, env=_env(BYTELATENT_TEST_STEP_DELAY="0.3"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + hang_limit(120)
        while (
            not (dump / "metrics.replayed.jsonl").exists()
            or len(_steps(dump / "metrics.jsonl")) < 3
        ):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=hang_limit(240))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    steps = _steps(dump / "metrics.jsonl", live_only=False)  # the dead records are gone from it
    assert steps == list(range(1, len(steps) + 1)) and 3 <= len(steps) < 10000
    assert (dump / "checkpoints" / f"{steps[-1]:010d}" / ".complete").exists()
    on_stderr = [line for line in err.splitlines() if "Ctrl-C" in line]
    on_stdout = [line for line in out.splitlines() if "Ctrl-C" in line]
    assert on_stderr == [
        "bytelatent: Ctrl-C: saving at the next step boundary (Ctrl-C again to stop now)"
    ]
    assert len(on_stdout) == 1 and on_stdout[0].endswith(
        f"Ctrl-C at step {steps[-1]}: saved step {steps[-1]}; run the same command again to resume"
    ), out[-3000:]
    assert (dump / "metrics.replayed.jsonl").read_text().splitlines() == dead  # moved, verbatim
    assert "3 records after step 0" in out


SECOND_CTRL_C = """
import os, signal, time
from bytelatent.distributed.signals import early_flag
flag = early_flag()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
assert flag.received == signal.SIGINT and flag.interactive
print("first kept", flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("not stopped")
"""


def test_second_ctrl_c_stops_at_once_without_a_traceback():
    res = subprocess.run(
        [sys.executable, "-c", SECOND_CTRL_C], cwd=REPO, env=_env(), capture_output=True,
        text=True, timeout=hang_limit(60),
    )  # fmt: skip
    assert res.returncode == 130, res.stderr
    assert res.stdout == "first kept\n"
    assert (
        res.stderr.split()
        == (
            "bytelatent: Ctrl-C: saving at the next step boundary (Ctrl-C again to stop now) "
            "bytelatent: second Ctrl-C: stopping now, without saving"
        ).split()
    )


IGNORED = """
import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
from bytelatent.distributed.signals import early_flag
early_flag()
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
print("ok")
"""


def test_a_background_job_that_ignores_sigint_keeps_ignoring_it():
    res = subprocess.run(
        [sys.executable, "-c", IGNORED], cwd=REPO, env=_env(), capture_output=True, text=True,
        timeout=hang_limit(60),
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout == "ok\n", res.stderr
