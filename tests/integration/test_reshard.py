"""Resume a checkpoint on a different number of data-parallel ranks (2 -> 1 and 1 -> 2 processes).

What is guaranteed when the data-parallel size changes, and tested here:

* model and optimizer state continue exactly (up to float reduction order, 1e-5): loading the
  step-10 checkpoint on the new layout and on the layout that wrote it, then taking one step on
  the same fixed global batch, gives the same loss before and after that step;
* the step counter and the LR schedule continue bitwise (same lr at every later step);
* the data loader continues the same global sequence of global batches (its virtual streams
  are handed to the new ranks, bytelatent/data/elastic.py), so every resumed step's loss equals
  the uninterrupted source run's loss at that step (to 1e-4: only the reduction order differs).

The global batch is the same on both layouts (`data.batch_size` is halved on 2 ranks).
"""

from __future__ import annotations

import pytest
from harness import GLOBAL_BATCH, model_args, read_metrics

TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("src", "dst"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_resume_on_other_dp_size(runner, references, src: int, dst: int) -> None:
    source = references.dump_dir("entropy", src)
    checkpoint = source / "checkpoints" / "0000000010"
    assert (checkpoint / ".complete").exists()

    resumed = runner.start(
        "resumed", [*model_args("entropy", dst), f"checkpoint.load_path={checkpoint}"], nproc=dst
    )
    resumed.wait_ok()
    records = read_metrics(resumed.dump_dir)
    assert [r["global_step"] for r in records] == list(range(11, 21))
    source_lr = {r["global_step"]: r["lr"] for r in read_metrics(source)}
    assert all(r["lr"] == source_lr[r["global_step"]] for r in records)

    # The batch a fresh `dst`-rank pipeline yields first, evaluated on both layouts.
    batch = {"batch_world": dst, "batch_size": GLOBAL_BATCH // dst}
    on_dst = runner.probe("probe-dst", model_args("entropy", dst), checkpoint, nproc=dst, **batch)
    on_src = runner.probe("probe-src", model_args("entropy", src), checkpoint, nproc=src, **batch)

    assert on_dst["step"] == on_src["step"] == 10
    assert on_dst["lr"] == on_src["lr"] == source_lr[10]
    source_loss = {r["global_step"]: r["loss"] for r in read_metrics(source)}
    for r in records:  # the same global batches as the uninterrupted run
        assert abs(r["loss"] - source_loss[r["global_step"]]) <= 1e-4, (r, source_loss)
    for key in ("loss_before", "loss_after"):
        assert abs(on_dst[key] - on_src[key]) <= TOLERANCE, (key, on_dst, on_src)
    # The probe's step must move the loss, or loss_after would not test the optimizer state.
    assert abs(on_src["loss_after"] - on_src["loss_before"]) > 100 * TOLERANCE
