"""Preempt with SIGUSR2, resume with the same command: the loss curve is bitwise the uninterrupted one.

Runs use the multiprocess data loader (data.load_async=true), fp32 and a loss logged every step.
Under torchrun the signal goes to rank 1 only: the ranks agree on it (all-reduced flag), so rank 0
saves and stops at the same step without ever receiving it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from harness import cmdline_of, descendants, losses_by_step, model_args, read_metrics

PREEMPT_AT = 7  # the signal is sent once metrics.jsonl shows this step
STEP_DELAY = {"BYTELATENT_TEST_STEP_DELAY": "0.2"}  # >= 2.6 s to signal before step 20


def checkpoint_steps(dump_dir) -> dict[int, dict | None]:
    """step -> contents of its `.complete` marker (None for a partial folder)."""
    out = {}
    for folder in sorted((dump_dir / "checkpoints").iterdir()):
        if folder.name.isdigit():
            marker = folder / ".complete"
            out[int(folder.name)] = json.loads(marker.read_text()) if marker.exists() else None
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "nproc"),
    [("entropy", 1), ("entropy", 2), ("blt", 1), ("blt", 2)],
    ids=["entropy-1proc", "entropy-fsdp2", "blt-1proc", "blt-fsdp2"],
)
def test_preempt_then_resume_is_bitwise(runner, references, model: str, nproc: int) -> None:
    expected = losses_by_step(references.dump_dir(model, nproc))
    assert sorted(expected) == list(range(1, 21))
    args = model_args(model, nproc)

    first = runner.start("run", args, nproc=nproc, env=STEP_DELAY)
    first.wait_for_step(PREEMPT_AT)
    first.signal_rank(nproc - 1)
    out = first.wait_ok()
    stopped = read_metrics(first.dump_dir)[-1]["global_step"]
    assert PREEMPT_AT <= stopped < 20, f"stopped at step {stopped}\n{first.describe()}"
    assert f"stopped at step {stopped}; run the same command again to resume" in out
    markers = checkpoint_steps(first.dump_dir)
    assert markers[stopped] is not None and "preempt" in markers[stopped]["kinds"], markers

    second = runner.start("run", args, nproc=nproc)
    out = second.wait_ok()
    assert (
        f"resumed from {first.dump_dir / 'checkpoints' / f'{stopped:010d}'} at step {stopped}"
        in out
    )

    got = losses_by_step(first.dump_dir)  # both runs append to the same metrics.jsonl
    assert sorted(got) == list(range(1, 21))
    mismatches = {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}
    assert not mismatches, f"losses differ from the uninterrupted run (got, expected): {mismatches}"
    assert checkpoint_steps(first.dump_dir)[20] is not None


@pytest.mark.slow
def test_data_loader_processes_ignore_preemption_signal(runner, references) -> None:
    """Under `srun`, SLURM signals every process of the step, data-loader processes included.

    Only the trainer may react (it saves the loader's exact state); a data-loader process killed
    by USR2 would make the next batch fail. Here only the loader processes get the signal, so the
    run must simply go on and match the uninterrupted run.
    """
    expected = losses_by_step(references.dump_dir("entropy", 1))
    run = runner.start("run", model_args("entropy", 1), env=STEP_DELAY)
    run.wait_for_step(3)
    loader = [pid for pid in descendants(run.proc.pid) if b"forkserver" in cmdline_of(pid)]
    assert loader, f"no data-loader process found\n{run.describe()}"
    for pid in loader:  # the fork server and the worker it forked
        os.kill(pid, signal.SIGUSR2)
    out = run.wait_ok()
    assert "preemption" not in out
    assert losses_by_step(run.dump_dir) == expected
