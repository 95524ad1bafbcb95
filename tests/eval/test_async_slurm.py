"""Async evals as SLURM jobs on the real single-node cluster the SLURM tests start.

Skipped without SLURM, unless BYTELATENT_REQUIRE_SLURM=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.eval.test_async_eval import async_lines
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, TINY_BLT

sys.path.insert(0, str(REPO / "tests" / "integration"))
from slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: E402, F401 (the fixture)


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_eval_jobs_are_submitted_run_and_write_results(
    slurm_cluster: SlurmCluster, tmp_path: Path, corpus_root: Path
) -> None:
    import subprocess

    dump = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "bytelatent.train", *TINY_BLT, f"dump_dir={dump}",
         f"data.root_dir={corpus_root}", "steps=20", "checkpoint.eval.every=10",
         "eval.async_launch.mode=slurm", "eval.async_launch.slurm.cpus_per_task=1",
         "eval.async_launch.slurm.time=00:10:00", "eval.async_launch.num_threads=1",
         "eval.async_launch.env={OMP_NUM_THREADS: '1'}", "eval.async_launch.poll_interval_s=0.5",
         "eval.async_launch.wait_on_exit_s=300", "eval.validation.max_batches=2"],
        cwd=REPO, env={**os.environ, **slurm_cluster.env(), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=hang_limit(600),
    )  # fmt: skip
    logs = res.stdout[-4000:] + res.stderr[-2000:] + slurm_cluster.logs()
    assert res.returncode == 0, logs
    job_ids = re.findall(r"async eval of step (\d+) launched \(SLURM job (\d+)\)", res.stdout)
    assert [int(step) for step, _ in job_ids] == [10, 20], logs
    for step, job_id in job_ids:
        out = dump / "evals" / f"{int(step):010d}"
        script = (out / "eval.slurm").read_text()
        assert "#SBATCH --time=00:10:00" in script and "#SBATCH --no-requeue" in script
        assert "-m bytelatent.eval" in script
        results = json.loads((out / "results.json").read_text())
        assert results["global_step"] == int(step), logs
        assert f"eval step {step}:" in (out / f"{job_id}.out").read_text()
        assert slurm_cluster.job(job_id).get("JobState") == "COMPLETED"
    assert sorted(r["global_step"] for r in async_lines(dump)) == [10, 20]
    assert "async eval of step 20 done" in res.stdout, logs
