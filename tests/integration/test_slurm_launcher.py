"""The SLURM launcher without a cluster: the script it writes, its CLI errors, and requeue fallbacks.

The generated script is also executed with plain bash here (no sbatch): a USR2 sent to the batch
shell must reach the training process, which then saves and stops.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import REPO_ROOT, child_env, model_args, read_metrics

from bytelatent.distributed.signals import requeue_slurm_job
from bytelatent.launch.slurm import SlurmArgs, main, render_script
from tests.limits import hang_limit

TRAIN_ARGV = ["config=configs/entropy_debug.yaml", "dump_dir=/nonexistent/run", "steps=10"]


def bash_syntax_ok(script: str) -> None:
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_direct_script_forwards_usr2_to_torchrun_workers() -> None:
    args = SlurmArgs(nproc_per_node=2, time="1:00:00", partition="gpu", signal_seconds=90)
    script = render_script(args, TRAIN_ARGV, "job", "/logs")
    bash_syntax_ok(script)
    for line in (
        "#SBATCH --signal=B:USR2@90",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=/logs/%j.out",
        "#SBATCH --time=1:00:00",
        "#SBATCH --partition=gpu",
        "trap 'forward USR2' USR2",
        'pkill -"$1" -P "$child"',
    ):
        assert line in script.splitlines() or line in script, line
    assert "--nproc-per-node=2 -m bytelatent.train config=configs/entropy_debug.yaml" in script


def test_srun_script_for_several_nodes() -> None:
    args = SlurmArgs(nodes=4, nproc_per_node=8, gpus_per_node=8, requeue=False)
    script = render_script(args, [*TRAIN_ARGV, "name=it's"], "job", "/logs")
    bash_syntax_ok(script)
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --no-requeue" in script
    assert "srun --ntasks-per-node=1" in script and "--rdzv-backend=c10d" in script
    assert 'scancel --signal=USR2 "$SLURM_JOB_ID"' in script


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--nodes=two", *TRAIN_ARGV]) == 2
    assert capsys.readouterr().err.strip() == (
        "config error: --nodes: Input should be a valid integer, unable to parse string as an integer"
    )
    assert main(["--gpus=8", *TRAIN_ARGV]) == 2  # no abbreviation of --gpus-per-node
    assert "--gpus=8: not a launcher option" in capsys.readouterr().err
    assert (
        main(["--dry-run", "config=configs/entropy_debug.yaml", f"dump_dir={tmp_path}", "steps=0"])
        == 2
    )
    assert capsys.readouterr().err.startswith("config error: steps:")


def test_dry_run_writes_script_in_dump_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = [f"config={REPO_ROOT / 'configs/entropy_debug.yaml'}", f"dump_dir={tmp_path / 'run'}"]
    assert main(["--dry-run", f"--workdir={REPO_ROOT}", *argv]) == 0
    script = (tmp_path / "run" / "submit.slurm").read_text()
    assert f"#SBATCH --output={tmp_path / 'run' / 'slurm'}/%j.out" in script
    assert (tmp_path / "run" / "slurm").is_dir()
    assert "(not submitted)" in capsys.readouterr().out


def test_requeue_without_scontrol_returns_false(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol there
    assert requeue_slurm_job(is_rank0=True) is False
    assert requeue_slurm_job(is_rank0=False) is False


# Like SLURM on `scontrol requeue`: SIGTERM to every process of the job (its cgroup), here the
# batch shell (pid in job.pid) and everything below it.
FAKE_SCONTROL = """#!{python}
import os, signal, sys
from pathlib import Path

Path("{tmp}/requeue.txt").write_text(" ".join(sys.argv[1:]))
root = int(Path("{tmp}/job.pid").read_text())
parents = {{}}
for entry in Path("/proc").iterdir():
    if entry.name.isdigit():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
job, frontier = [root], [root]
while frontier:
    frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
    job += frontier
for pid in job:
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
"""


def test_requeue_under_the_batch_script_is_left_to_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With BYTELATENT_REQUEUE_FILE set, rank 0 writes the job id there and runs no scontrol."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("PATH", str(tmp_path))  # an scontrol call would fail: none here
    request = tmp_path / "requeue.77"
    monkeypatch.setenv("BYTELATENT_REQUEUE_FILE", str(request))
    assert requeue_slurm_job(is_rank0=False) is False and not request.exists()
    assert requeue_slurm_job(is_rank0=True) is True
    assert request.read_text().strip() == "70_7"
    script = render_script(SlurmArgs(nproc_per_node=2), TRAIN_ARGV, "job", "/logs")
    lines = script.splitlines()
    requeue_at = next(i for i, line in enumerate(lines) if "scontrol requeue" in line)
    assert requeue_at > lines.index(
        'echo "bytelatent: training exited with status $status '
        '(restart ${SLURM_RESTART_COUNT:-0})"'
    )
    assert 'export BYTELATENT_REQUEUE_FILE=/logs/requeue."$SLURM_JOB_ID"' in lines


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pkill") is None, reason="pkill (procps) not installed")
def test_script_forwards_usr2_without_slurm(runner, tmp_path: Path) -> None:
    """Run the generated batch script with bash (nproc 2): USR2 to the shell stops training cleanly."""
    dump_dir = tmp_path / "job"
    args = SlurmArgs(
        nproc_per_node=2, module="train_entry", python=sys.executable, workdir=str(REPO_ROOT)
    )
    script = render_script(
        args, runner.config(model_args("entropy", 2), dump_dir), "job", str(tmp_path)
    )
    env = child_env({"BYTELATENT_TEST_STEP_DELAY": "0.15", "SLURM_JOB_ID": "1"})
    env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), env["PATH"]])
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "scontrol"  # records the requeue request instead of a cluster
    fake.write_text(FAKE_SCONTROL.format(python=sys.executable, tmp=str(tmp_path)))
    fake.chmod(0o755)
    log = open(tmp_path / "job.log", "w")
    shell = subprocess.Popen(
        ["bash", "-c", script],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (tmp_path / "job.pid").write_text(str(shell.pid))
    try:
        deadline = time.monotonic() + hang_limit(240)
        while not (read_metrics(dump_dir) and read_metrics(dump_dir)[-1]["global_step"] >= 5):
            assert shell.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "timed out waiting for step 5"
            time.sleep(0.05)
        os.kill(shell.pid, signal.SIGUSR2)
        assert shell.wait(timeout=hang_limit(240)) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
        log.close()
    out = (tmp_path / "job.log").read_text()
    assert "SIGUSR2 received; forwarding it to the training processes" in out
    assert (tmp_path / "requeue.txt").read_text().split() == ["requeue", "1"]
    assert "bytelatent: requeued SLURM job 1" in out
    # a clean preemption is silent: no torchrun SignalException, no resource-tracker warnings
    for noise in ("Traceback", "SignalException", "leaked semaphore"):
        assert noise not in out, out[-4000:]
    stopped = read_metrics(dump_dir)[-1]["global_step"]
    assert 5 <= stopped < 20
    assert (dump_dir / "checkpoints" / f"{stopped:010d}" / ".complete").exists()
