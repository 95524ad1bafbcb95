"""Reliability scenarios end to end through `python -m bytelatent.train` (tiny entropy model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bytelatent.checkpoint.consolidate import load_dcp_state_dict
from bytelatent.trainer.run_lock import LOCK_NAME
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, TINY_ENTROPY, metrics, run_cli

ENTRY = REPO / "tests" / "integration" / "train_entry.py"


def _env(**extra: str) -> dict[str, str]:
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in paths if p),
                **extra)  # fmt: skip


def _walk_tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _walk_tensors(value)


@pytest.mark.slow
def test_diverging_run_stops_nonzero_and_leaves_only_finite_checkpoints(tmp_path, corpus_root):
    dump = tmp_path / "diverge"
    res = run_cli(
        "bytelatent.train",
        [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=60",
         "optim.lr=1e4", "optim.clip=0", "optim.warmup=0", "checkpoint.dump.every=2",
         "checkpoint.dump.keep=1", "logging.console=false", "env.WANDB_API_KEY=very-secret"],
    )  # fmt: skip
    output = res.stdout + res.stderr
    assert res.returncode == 3, output[-3000:]
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1, output[-3000:]
    assert "non-finite guard: stopping at step" in errors[0] and "non-finite" in errors[0]
    rows = metrics(dump)
    assert rows[-1]["global_step"] < 60 and rows[-1]["skipped_streak"] == 5
    assert sum(r["skipped_steps"] for r in rows) >= 5
    assert "very-secret" not in (dump / "config.yaml").read_text()  # config dumps are redacted
    folders = sorted((dump / "checkpoints").glob("[0-9]" * 10))
    assert folders, "the last finite checkpoint must survive retention"
    for folder in folders:
        state = load_dcp_state_dict(str(folder))
        tensors = list(_walk_tensors(state))
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
        assert "very-secret" not in (folder / "params.json").read_text()
        saved_at = int(folder.name)
        assert rows[saved_at - 1]["skipped_streak"] == 0  # saved after a good update only


@pytest.mark.slow
def test_second_run_on_same_dump_dir_is_refused(tmp_path, corpus_root):
    dump = tmp_path / "locked"
    # Far more steps than the test waits for: however slow the second start is under load, the
    # first run is still training (and holding the lock) when the second one gives up.
    args = [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=10000",
            "logging.console=false", "checkpoint.dump.every=0"]  # fmt: skip
    first = subprocess.Popen(
        [sys.executable, str(ENTRY), *args], cwd=REPO, env=_env(BYTELATENT_TEST_STEP_DELAY="0.5"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + hang_limit(120)
        while not (dump / "metrics.jsonl").exists() or not metrics(dump):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        before = {p.name: p.stat().st_size for p in dump.iterdir()}
        second = run_cli("bytelatent.train", args)
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith("run lock error:") and f"pid {first.pid}" in lines[0]
        assert {p.name for p in dump.iterdir()} == set(before)  # nothing new written
        assert first.poll() is None, "the first run ended before the second one was refused"
        first.send_signal(signal.SIGUSR2)  # undisturbed: it stops, saves and exits 0 as usual
        out, err = first.communicate(timeout=hang_limit(240))
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    steps = [r["global_step"] for r in metrics(dump)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 10000
    assert (dump / "checkpoints" / f"{steps[-1]:010d}" / ".complete").exists()
    assert not (dump / LOCK_NAME).exists()


HOLDER = """
import sys, time
from bytelatent.trainer.run_lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_lock_taken_over_after_kill_9(tmp_path, caplog):
    from bytelatent.trainer.run_lock import RunLock, RunLockError

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError, match=f"pid {holder.pid}"):
            RunLock(str(tmp_path)).acquire()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=hang_limit(30))
    finally:
        holder.kill()
    lock = RunLock(str(tmp_path))
    with caplog.at_level("WARNING", logger="bytelatent"):
        lock.acquire()
    assert f"pid {holder.pid} is not running" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_rank_run_holds_one_lock(tmp_path, corpus_root):
    dump = tmp_path / "fsdp"
    args = [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=12",
            "logging.console=false", "checkpoint.dump.every=0", "data.batch_size=2",
            "distributed.dp_shard=2"]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", str(ENTRY)]  # fmt: skip
    run = subprocess.Popen(
        [*launcher, *args], cwd=REPO, env=_env(BYTELATENT_TEST_STEP_DELAY="0.3"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + hang_limit(180)
        while not (dump / "metrics.jsonl").exists() or not metrics(dump):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-3000:]
            time.sleep(0.1)
        holder = json.loads((dump / LOCK_NAME).read_text())
        ranks = _ranks_of(run.pid)
        assert sorted(ranks) == [0, 1] and holder["pid"] == ranks[0]
        assert [p.name for p in dump.iterdir() if p.name.startswith(".lock")] == [LOCK_NAME]
        out = run.communicate(timeout=hang_limit(240))[0]
    finally:
        run.kill()
    assert run.returncode == 0, out[-3000:]
    assert "run lock" not in out and not (dump / LOCK_NAME).exists()


def _ranks_of(launcher_pid: int) -> dict[int, int]:
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = int(entry.name)
    return ranks
