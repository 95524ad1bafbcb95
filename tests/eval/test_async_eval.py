"""Async evals launched as local detached processes; the 2-rank standalone/in-loop equality."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.eval.test_eval_cli import eval_lines
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, TINY_BLT, run_cli

ASYNC = [
    "checkpoint.eval.every=10", "eval.async_launch.mode=local", "eval.async_launch.num_threads=1",
    "eval.async_launch.poll_interval_s=0.2", "eval.async_launch.wait_on_exit_s=240",
    "eval.validation.max_batches=2",
]  # fmt: skip


def async_lines(dump: Path) -> list[dict]:
    return [r for r in eval_lines(dump) if r["eval_mode"] == "async"]


def folders(dump: Path) -> list[int]:
    return sorted(int(p.name) for p in (dump / "checkpoints").iterdir() if p.name.isdigit())


def python_starting_after(marker: Path, folder: Path) -> Path:
    """An `eval.async_launch.python` that waits for `marker` (up to 120 s), then runs Python."""
    script = folder / "python-after-marker"
    script.write_text(
        "#!/bin/sh\n"
        f"for _ in $(seq 1200); do [ -e '{marker}' ] && break; sleep 0.1; done\n"
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


def test_every_eval_checkpoint_gets_results_matching_the_in_loop_eval(tmp_path, corpus_root):
    dump = tmp_path / "run"
    # Eval jobs start once step 30 is saved, so the evals of 10 and 20 are still owed when the
    # saves of 20 and 30 apply retention, however fast or loaded the machine is.
    python = python_starting_after(dump / "checkpoints" / f"{30:010d}" / ".complete", tmp_path)
    res = run_cli("bytelatent.train", [
        *TINY_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=30", *ASYNC,
        "eval.every=10", "checkpoint.eval.keep=1", f"eval.async_launch.python={python}",
    ])  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for step in (10, 20, 30):
        results = json.loads((dump / "evals" / f"{step:010d}" / "results.json").read_text())
        assert results["global_step"] == step
        assert f"async eval of step {step} done" in res.stdout
    in_loop = {r["global_step"]: r for r in eval_lines(dump) if r["eval_mode"] == "loop"}
    launched = async_lines(dump)
    assert sorted(r["global_step"] for r in launched) == [10, 20, 30]
    for row in launched:  # the eval job sees the same model and the same batches
        assert abs(row["val/bpb"] - in_loop[row["global_step"]]["val/bpb"]) <= 1e-6
    # retention (keep=1) held 10 and 20 while their evals were owed or read them (lease), and
    # dropped them after
    kept = [line for line in res.stdout.splitlines() if "retention: keeping" in line]
    for step in (10, 20):
        assert any(f"{step:010d}" in line for line in kept), kept
    assert folders(dump) == [30]
    assert not list((dump / "checkpoints").glob("*/.lease.*"))


def test_a_crashing_eval_job_is_reported_and_training_exits_0(tmp_path, corpus_root):
    dump = tmp_path / "run"
    res = run_cli("bytelatent.train", [
        *TINY_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=10", *ASYNC,
        # the eval job finds no data where it runs: it fails with a data error (exit 2)
        "eval.async_launch.overrides=[data.root_dir=/nonexistent]",
    ])  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "async eval of step 10 failed (exit code 2)" in res.stdout
    assert "data error" in (dump / "evals" / f"{10:010d}" / "eval.log").read_text()
    assert not (dump / "evals" / f"{10:010d}" / "results.json").exists()
    assert not list((dump / "checkpoints").glob("*/.lease.*"))  # released: retention may go on


def _lease_pid(dump: Path, step: int) -> int | None:
    lease = dump / "checkpoints" / f"{step:010d}" / ".lease.eval"
    try:
        return json.loads(lease.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_kill_the_trainer_and_resume_no_eval_twice_none_lost(tmp_path, corpus_root):
    dump = tmp_path / "run"
    cmd = [
        sys.executable, str(REPO / "tests" / "integration" / "train_entry.py"), *TINY_BLT,
        f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=40", *ASYNC,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", BYTELATENT_TEST_STEP_DELAY="0.1")
    first = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + hang_limit(120)
    while _lease_pid(dump, 20) is None:
        assert first.poll() is None and time.monotonic() < deadline, "no eval of step 20 launched"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)  # the trainer dies; its eval jobs live on, detached
    first.wait()
    # ...but the eval of step 20 dies too (as on a lost node): its lease is left stale
    os.kill(_lease_pid(dump, 20), signal.SIGKILL)
    res = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(600)
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "async eval of step 20 is owed: launching it" in res.stdout
    steps = sorted(r["global_step"] for r in async_lines(dump))
    assert steps == [10, 20, 30, 40], steps  # each exactly once
    for step in steps:
        assert (dump / "evals" / f"{step:010d}" / "results.json").exists()
        log = (dump / "evals" / f"{step:010d}" / "eval.log").read_text()
        assert log.count(f"eval step {step}:") == 1, log


@pytest.mark.slow
def test_two_ranks_in_loop_equals_standalone_on_two_ranks_and_one(tmp_path, corpus_root):
    dump = tmp_path / "run"
    fp32 = [
        "distributed.model_dtype=fp32"
    ]  # 1 process autocasts, FSDP casts params: same only in fp32
    torchrun = ["torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    res = run_cli(torchrun[0], [*torchrun[1:], "bytelatent.train", *TINY_BLT, *fp32,
                  f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=20", "eval.every=20",
                  "eval.validation.max_batches=5"])  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    in_loop = eval_lines(dump)[-1]
    assert in_loop["global_step"] == 20
    ckpt = dump / "checkpoints" / f"{20:010d}"
    for launcher, out in ((torchrun, tmp_path / "two"), ([], tmp_path / "one")):
        args = [*launcher[1:], "bytelatent.eval"] if launcher else []
        res = run_cli(launcher[0] if launcher else "bytelatent.eval",
                      [*args, f"ckpt={ckpt}", f"dump_dir={out}"])  # fmt: skip
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        results = json.loads((out / "results.json").read_text())
        assert abs(results["val/bpb"] - in_loop["val/bpb"]) <= 1e-6, (out.name, results, in_loop)
        assert results["val/n_bytes"] == in_loop["val/n_bytes"]
