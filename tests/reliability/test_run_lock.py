"""Run lock rules: who may take over a lock and who is refused (no training involved)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from bytelatent.trainer.run_lock import LOCK_NAME, RunLock, RunLockArgs, RunLockError
from tests.limits import hang_limit


def _plant(tmp_path, age_s: float = 0.0, **fields) -> None:
    data = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None,
            "start_time": time.time() - age_s, "token": "planted"} | fields  # fmt: skip
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(data))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_second_lock_in_same_process_is_refused_and_release_frees(tmp_path):
    first = RunLock(str(tmp_path))
    first.acquire()
    with pytest.raises(RunLockError, match=f"in use by another run \\(pid {os.getpid()}"):
        RunLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    again = RunLock(str(tmp_path))
    again.acquire()
    again.release()


@pytest.mark.parametrize(
    ("fields", "age_s", "env", "reason"),
    [
        ({"pid": "dead"}, 0, {}, "is not running"),
        ({"host": "other-node"}, 1000, {}, "heartbeat 1000s old"),
        ({"host": "other-node", "slurm_job_id": "777"}, 0, {"SLURM_JOB_ID": "777"}, "requeued"),
        ({"pid": 1, "pid_start": "-1"}, 0, {}, "belongs to another process"),
    ],
    ids=["dead-pid", "old-heartbeat-other-host", "same-slurm-job", "reused-pid"],
)
def test_stale_locks_are_taken_over(tmp_path, monkeypatch, caplog, fields, age_s, env, reason):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if fields.get("pid") == "dead":
        fields = {**fields, "pid": _dead_pid()}
    _plant(tmp_path, age_s=age_s, **fields)
    lock = RunLock(str(tmp_path), RunLockArgs(stale_after_s=300))
    with caplog.at_level("WARNING", logger="bytelatent"):
        lock.acquire()
    assert reason in caplog.text and "taking over stale" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # no leftovers
    lock.release()


@pytest.mark.parametrize(
    "fields", [{"host": "other-node"}, {"pid": 1}], ids=["fresh-other-host", "live-pid"]
)
def test_live_locks_are_respected(tmp_path, monkeypatch, fields):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _plant(tmp_path, age_s=5, **fields)
    with pytest.raises(RunLockError) as info:
        RunLock(str(tmp_path)).acquire()
    line = info.value.one_line()
    assert line.startswith("run lock error:") and "\n" not in line
    assert f"pid {fields['pid'] if 'pid' in fields else os.getpid()}" in line
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "planted"


def test_heartbeat_refreshes_and_release_leaves_a_foreign_lock(tmp_path):
    lock = RunLock(str(tmp_path), RunLockArgs(heartbeat_s=0.05))
    lock.acquire()
    path = tmp_path / LOCK_NAME
    os.utime(path, (time.time() - 500, time.time() - 500))
    deadline = time.monotonic() + hang_limit(10)
    while time.time() - path.stat().st_mtime > 100:
        assert time.monotonic() < deadline, "heartbeat did not refresh the lock"
        time.sleep(0.02)
    _plant(tmp_path, host="other-node")  # someone else took it over meanwhile
    lock.release()
    assert json.loads(path.read_text())["token"] == "planted"


def test_stale_timeout_must_exceed_heartbeat():
    with pytest.raises(ValueError, match="at least twice"):
        RunLockArgs(heartbeat_s=60, stale_after_s=90)
