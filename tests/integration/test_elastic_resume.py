"""Elastic exact resume of a real training run (gloo, fp32, tiny BLT, prefetching loader on).

A 2-rank run (data.batch_size 2) saved at step 3 and resumed on 1 rank (grad_acc_steps 2, with
the prefetcher) and on 4 ranks (data.batch_size 1) trains on the same global batches as the
uninterrupted run: the per-step losses agree to 1e-4 (only the float reduction order differs).
A resume that would change the global batch is refused with one line and exit 2. (The rows of
every global step, with and without the prefetcher, are compared in tests/data/test_elastic.py.)
"""

from __future__ import annotations

import pytest
from harness import BLT_TINY, losses_by_step

TOLERANCE = 1e-4
RUN = [*BLT_TINY, "steps=6", "checkpoint.dump.every=3", "data.virtual_streams=4"]


def layout(nproc: int, batch_size: int, grad_acc_steps: int) -> list[str]:
    return [
        f"distributed.dp_shard={nproc}",
        f"data.batch_size={batch_size}",
        f"grad_acc_steps={grad_acc_steps}",
    ]


@pytest.mark.slow
def test_resume_on_1_and_4_ranks_continues_the_same_global_batches(runner) -> None:
    sync = "data.load_async=false"  # fewer processes; the 1-rank resume keeps the prefetcher
    ref = runner.start("ref", [*RUN, *layout(2, 2, 1), sync], nproc=2)
    ref.wait_ok()
    checkpoint = ref.dump_dir / "checkpoints" / "0000000003"
    load = f"checkpoint.load_path={checkpoint}"
    one = runner.start("to1", [*RUN, *layout(1, 2, 2), load], nproc=1)
    four = runner.start("to4", [*RUN, *layout(4, 1, 1), load, sync], nproc=4)
    refused = runner.start("refused", [*RUN, *layout(1, 2, 1), load, sync], nproc=1)
    expected = losses_by_step(ref.dump_dir)
    for run in (one, four):
        run.wait_ok()
        got = losses_by_step(run.dump_dir)
        assert sorted(got) == [4, 5, 6], run.describe()
        for step, loss in got.items():
            assert abs(loss - expected[step]) <= TOLERANCE, (run.dump_dir.name, step, loss)
    assert refused.wait() == 2
    errors = [line for line in refused.output().splitlines() if "config error:" in line]
    assert len(errors) == 1 and "global batch" in errors[0], refused.describe()
    assert "Traceback" not in refused.output()
