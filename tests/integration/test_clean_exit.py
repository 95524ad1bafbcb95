"""A finished 2-rank run is silent on the way out: no resource-tracker warnings, no tracebacks."""

from __future__ import annotations

import pytest
from harness import model_args, read_metrics

from tests.limits import hang_limit


@pytest.mark.slow
def test_two_rank_run_exits_cleanly(runner) -> None:
    # prefetching data loader on (COMMON), so each rank has a queue and events to release
    run = runner.start(
        "clean", [*model_args("blt", 2), "steps=6", "checkpoint.dump.every=0"], nproc=2
    )
    out = run.wait_ok(timeout=hang_limit(300))
    assert [r["global_step"] for r in read_metrics(run.dump_dir)] == list(range(1, 7))
    assert (run.dump_dir / "model-info.txt").exists()
    for noise in ("leaked semaphore", "resource_tracker", "Traceback", "Error"):
        assert noise not in out, f"{noise!r} in the output:\n{out[-4000:]}"
