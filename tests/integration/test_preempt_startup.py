"""A preemption signal at any moment of a run's start-up is a clean stop that requeues (issue 29).

Before, the handler was installed at the end of `Trainer.__init__`: a SLURM warning (USR2) or a
SIGTERM during the config phase, the model build or a checkpoint restore killed the run with
128 + signal and nothing requeued it. The flag is now installed on the entry's first line; the
trainer stops at its first boundary (saving only when it trained a step since the last save).
A fake SLURM job (`SLURM_JOB_ID` + the launcher's requeue file) shows the requeue request.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest
from harness import TrainRun, losses_by_step, model_args

from bytelatent.checkpoint.layout import MARKER_FILE

pytestmark = pytest.mark.slow


def _handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def _slurm_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    requeue = tmp_path / "requeue"
    return {"SLURM_JOB_ID": "4242", "BYTELATENT_REQUEUE_FILE": str(requeue)}, requeue


def _checkpoints(dump_dir: Path) -> list[str]:
    folder = dump_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / MARKER_FILE).exists())


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_signal_on_the_entry_first_lines_is_a_clean_requeue(runner, tmp_path, sig) -> None:
    """The real `python -m bytelatent.train`, signalled as soon as its handler exists: the config
    is still being read or torch imported; nothing was trained, so nothing is saved."""
    extra, requeue = _slurm_env(tmp_path)
    dump_dir = tmp_path / "run"
    command = [sys.executable, "-m", "bytelatent.train",
               *runner.config(model_args("entropy", 1), dump_dir)]  # fmt: skip
    run = TrainRun(command, dump_dir, 1, extra)
    runner.runs.append(run)
    run.wait_for(lambda: _handles(run.proc.pid, sig), "the preemption handler")
    run.proc.send_signal(sig)
    out = run.wait_ok()  # before: killed by the signal (exit 140 / 143)
    assert f"received {signal.Signals(sig).name}" in out
    assert "preemption at step 0: nothing new to save" in out
    assert "Traceback" not in out
    assert requeue.read_text().strip() == "4242", out
    assert _checkpoints(dump_dir) == []


def test_signal_during_checkpoint_restore_requeues_and_resumes_exactly(
    runner, references, tmp_path
) -> None:
    """SIGUSR2 while a resumed run restores step 10: it finishes the restore, saves nothing new
    (step 10 is on disk), asks for the requeue and exits 0; the requeued run matches the
    uninterrupted one bitwise."""
    reference = references.dump_dir("entropy", 1)
    expected = losses_by_step(reference)
    dump_dir = tmp_path / "run"  # the reference run as it was at step 10
    shutil.copytree(reference, dump_dir)
    shutil.rmtree(dump_dir / "checkpoints" / "0000000020")
    metrics = (dump_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dump_dir / "metrics.jsonl").write_text("".join(metrics[:10]))
    extra, requeue = _slurm_env(tmp_path)
    second = runner.start("run", model_args("entropy", 1),
                          env={**extra, "BYTELATENT_TEST_RESTORE_DELAY": "3"})  # fmt: skip
    second.wait_for(lambda: "train_entry: restoring" in second.output(), "the restore")
    second.proc.send_signal(signal.SIGUSR2)
    out = second.wait_ok()
    assert "preemption at step 10: nothing new to save" in out and "Traceback" not in out
    assert f"restoring step 10 from {dump_dir / 'checkpoints' / '0000000010'} ..." in out
    assert requeue.read_text().strip() == "4242"
    assert _checkpoints(dump_dir) == ["0000000010"]
    runner.start("run", model_args("entropy", 1)).wait_ok()
    assert losses_by_step(dump_dir) == expected
