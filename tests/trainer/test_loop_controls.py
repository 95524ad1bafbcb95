"""relative_steps: N more steps from the resumed step, without growing on every requeue."""

from __future__ import annotations

import pytest

from bytelatent.args import TrainArgs
from bytelatent.errors import ConfigError
from bytelatent.trainer.loop_controls import resolve_stop_step
from bytelatent.trainer.state import TrainState


def args(**kw) -> TrainArgs:
    return TrainArgs(dump_dir="x", steps=100, **kw)


def test_without_relative_steps_the_loop_ends_at_max_steps_or_steps():
    assert resolve_stop_step(args(), TrainState(step=7)) == 100
    assert resolve_stop_step(args(max_steps=40), TrainState(step=7)) == 40


def test_relative_target_is_kept_by_a_requeue_and_renewed_after_it_is_reached():
    state = TrainState(step=10)
    assert resolve_stop_step(args(relative_steps=5), state) == 15
    # Preempted at 12 and requeued with the same command: still 15, not 17.
    requeued = TrainState.model_validate({**state.model_dump(), "step": 12})
    assert resolve_stop_step(args(relative_steps=5), requeued) == 15
    # Finished at 15; launching again asks for 5 more.
    finished = TrainState.model_validate({**state.model_dump(), "step": 15})
    assert resolve_stop_step(args(relative_steps=5), finished) == 20
    assert finished.relative_target == {"relative_steps": 5, "stop_step": 20}
    # Another N is a new request.
    assert resolve_stop_step(args(relative_steps=2), requeued) == 14


def test_relative_target_past_the_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="relative_steps=30.*step 80.*stop at 110.*steps=100"):
        resolve_stop_step(args(relative_steps=30), TrainState(step=80))


def test_max_steps_and_relative_steps_exclude_each_other():
    with pytest.raises(ValueError, match="at most one"):
        args(max_steps=5, relative_steps=5)


@pytest.mark.slow
def test_relative_steps_run_trains_n_more_steps_from_the_resumed_step(tmp_path, corpus_root):
    from tests.trainer.test_cli import TINY_ENTROPY, metrics, run_cli

    dump = tmp_path / "run"
    argv = [
        *TINY_ENTROPY,
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "steps=30",
        "relative_steps=3",
        "checkpoint.dump.every=0",
    ]
    for _ in range(2):
        res = run_cli("bytelatent.train", argv)
        assert res.returncode == 0, res.stderr[-3000:]
    assert [r["global_step"] for r in metrics(dump)] == [1, 2, 3, 4, 5, 6]
    assert (dump / "checkpoints" / f"{6:010d}" / ".complete").exists()
