"""kill -9 in the middle of a checkpoint save: the previous checkpoint is used and the curve is exact.

The run is killed (SIGKILL to the whole process group: launcher, ranks, data-loader processes)
after step 10's DCP files are written but before its `.complete` marker: the most dangerous
moment, when the folder holds `.metadata` and every shard and only the marker says it is partial.
The same command then resumes from step 5, saves step 10 again, and reproduces the uninterrupted
loss curve bitwise.
"""

from __future__ import annotations

import pytest
from harness import model_args, read_metrics
from test_resume import checkpoint_steps

SLOW_SAVE = {
    "BYTELATENT_TEST_MARKER_DELAY": "120",  # never reached: the run is killed first
    "BYTELATENT_TEST_MARKER_DELAY_FROM_STEP": "10",
    "BYTELATENT_TEST_STEP_DELAY": "0.05",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "async_save"),
    [(1, False), (2, True)],
    ids=["1proc-sync-save", "fsdp2-async-save"],
)
def test_kill_during_save_resumes_from_previous(
    runner, references, nproc: int, async_save: bool
) -> None:
    expected = {
        r["global_step"]: r["loss"] for r in read_metrics(references.dump_dir("entropy", nproc))
    }
    args = [
        *model_args("entropy", nproc),
        "checkpoint.dump.every=5",
        "checkpoint.dump.keep=0",  # keep every step folder to check step 10 was saved again
        f"checkpoint.async_save={str(async_save).lower()}",
    ]
    first = runner.start("run", args, nproc=nproc, env=SLOW_SAVE)
    folder = first.dump_dir / "checkpoints" / "0000000010"
    first.wait_for(
        lambda: f"data of {folder} written" in first.output(), "step 10's data to be written"
    )
    first.kill()
    markers = checkpoint_steps(first.dump_dir)
    assert markers.get(5) is not None, markers
    assert markers.get(10, "missing") is None, f"step 10 should be partial: {markers}"
    assert (folder / ".metadata").exists()  # all DCP data is there; only the marker is missing
    killed_steps = [r["global_step"] for r in read_metrics(first.dump_dir)]

    second = runner.start("run", args, nproc=nproc)
    out = second.wait_ok()
    assert f"resumed from {first.dump_dir / 'checkpoints' / '0000000005'} at step 5" in out

    # one record per step: the killed run's records after step 5 were moved aside at the resume
    records = read_metrics(first.dump_dir)
    assert [r["global_step"] for r in records] == list(range(1, 21))
    assert max(killed_steps) >= 10, killed_steps
    for r in records:
        assert (
            r["loss"] == expected[r["global_step"]]
        ), f"step {r['global_step']}: {r['loss']} != {expected[r['global_step']]}"
    final = checkpoint_steps(first.dump_dir)
    assert all(final[s] is not None for s in (5, 10, 15, 20)), final
