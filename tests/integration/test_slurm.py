"""Real SLURM: sbatch a 2-rank job, preempt it with USR2, and check it saves, requeues and resumes.

The cluster (munge + slurmctld + slurmd on 127.0.0.1, in a temp dir) is started by the fixture and
stopped at teardown. Without SLURM installed the test is skipped, unless BYTELATENT_REQUIRE_SLURM=1
(CI) where that is a failure. Install it with scripts/ci_slurm_setup.sh.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import REPO_ROOT, child_env, losses_by_step, model_args, read_metrics
from slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 (the fixture)
from test_resume import PREEMPT_AT, STEP_DELAY

from tests.limits import hang_limit


def wait_until(condition, what: str, cluster: SlurmCluster, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-6000:] if log.exists() else "(no job log)"
            pytest.fail(
                f"timed out after {timeout}s waiting for {what}\n--- job log:\n{text}\n{cluster.logs()}"
            )
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_preempt_requeue_resume(
    slurm_cluster: SlurmCluster, runner, references, tmp_path: Path
) -> None:
    expected = losses_by_step(references.dump_dir("entropy", 2))
    options = ["--nproc-per-node=2", "--cpus-per-task=2"]
    preempt_requeue_resume(slurm_cluster, runner, options, tmp_path / "job", expected)


# What SLURM sends ahead of a time limit (`--signal=B:USR2@N`, to the batch shell), and what a
# preemption with GraceTime sends (slurmctld's job_signal without KILL_FULL_JOB: SIGCONT and
# SIGTERM to every process of the job's steps on every node, not the batch shell; SIGKILL follows
# after KillWait).
WARNING_SIGNAL = ["--signal=USR2", "--batch"]
PREEMPTION_SIGNAL = ["--signal=TERM"]


def preempt_requeue_resume(
    cluster: SlurmCluster,
    runner,
    options: list[str],
    dump_dir: Path,
    expected: dict[int, float],
    signal_args: list[str] = WARNING_SIGNAL,
) -> tuple[str, dict[str, str]]:
    """Submit the 2-rank tiny entropy run with the launcher's `options`, `scancel signal_args` it
    at step PREEMPT_AT, and check it saves, requeues once, resumes and matches `expected`
    bitwise; returns the job log and `scontrol show job`."""
    launch = subprocess.run(
        [
            sys.executable, "-m", "bytelatent.launch.slurm", *options,
            "--module=train_entry", "--job-name=bytelatent-test",
            *runner.config(model_args("entropy", 2), dump_dir),
        ],
        cwd=REPO_ROOT,
        env=child_env({**cluster.env(), **STEP_DELAY}),
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )  # fmt: skip
    assert launch.returncode == 0, launch.stderr
    job_id = re.search(r"submitted job (\d+)", launch.stdout).group(1)
    script = (dump_dir / "submit.slurm").read_text()
    assert "#SBATCH --signal=B:USR2@120" in script and "#SBATCH --requeue" in script
    log = dump_dir / "slurm" / f"{job_id}.out"

    def at_step() -> bool:
        records = read_metrics(dump_dir)
        return bool(records) and records[-1]["global_step"] >= PREEMPT_AT

    wait_until(at_step, f"step {PREEMPT_AT}", cluster, log, timeout=hang_limit(240))
    subprocess.run(
        ["scancel", *signal_args, job_id],
        env={**os.environ, **cluster.env()},
        check=True,
        timeout=hang_limit(30),
    )

    def finished() -> bool:
        job = cluster.job(job_id)
        if job.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            pytest.fail(f"job {job_id} ended {job.get('JobState')}\n{log.read_text()[-6000:]}")
        return job.get("JobState") == "COMPLETED"

    wait_until(
        finished, f"job {job_id} to requeue and complete", cluster, log, timeout=hang_limit(300)
    )
    job = cluster.job(job_id)
    text = log.read_text(errors="replace")
    assert job["Restarts"] == "1" and job["ExitCode"] == "0:0", (job, text[-4000:])
    assert f"job {job_id} restart 0" in text and f"job {job_id} restart 1" in text, text[-4000:]
    if signal_args == WARNING_SIGNAL:
        assert "SIGUSR2 received; forwarding it to the training processes" in text
    assert f"requeued SLURM job {job_id}" in text
    stopped = int(re.search(r"preemption: saving at step (\d+)", text).group(1))
    assert PREEMPT_AT <= stopped < 20
    assert f"resumed from {dump_dir / 'checkpoints' / f'{stopped:010d}'} at step {stopped}" in text
    assert "training exited with status 0 (restart 1)" in text
    # the requeue (SIGTERM to the whole job) runs after torchrun exited: nothing reads like a crash
    for noise in ("SignalException", "Traceback", "leaked semaphore", "died unexpectedly"):
        assert noise not in text, text[-4000:]

    got = losses_by_step(dump_dir)  # both runs of the job append to the same metrics.jsonl
    assert sorted(got) == list(range(1, 21))
    mismatches = {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}
    assert not mismatches, f"losses differ from the uninterrupted run (got, expected): {mismatches}"
    return text, job
