"""Actions: early stopping decides on the metric it is given; the loop stops, saves and exits 0."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from bytelatent.trainer.actions import ActionArgs, Actions, EarlyStop, EarlyStopArgs
from tests.trainer.test_cli import TINY_ENTROPY, metrics, run_cli


def test_early_stop_counts_reports_without_improvement():
    stop = EarlyStop(EarlyStopArgs(metric="val/bpb", patience=2, min_delta=0.01))
    assert stop.run(1, {"val/bpb": 3.0}) is None
    assert stop.run(2, {"val/bpb": 2.5}) is None  # improved
    assert stop.run(3, {"val/bpb": 2.495}) is None  # within min_delta: 1 bad report
    assert stop.run(4, {"loss": 1.0}) is None  # metric absent: not a report
    result = stop.run(5, {"val/bpb": 2.6})
    assert result is not None and result.exit_code == 0 and result.save
    assert "step 2" in result.reason and "val/bpb" in result.reason


def test_early_stop_max_mode_and_state_round_trip():
    actions = Actions.build([EarlyStopArgs(metric="acc", mode="max", patience=2)])
    assert actions.run(1, {"acc": 0.5}) is None
    assert actions.run(2, {"acc": 0.4}) is None
    resumed = Actions.build([EarlyStopArgs(metric="acc", mode="max", patience=2)])
    resumed.load_state_dict(json.loads(json.dumps(actions.state_dict())))
    assert resumed.run(3, {"acc": 0.45}) is not None  # patience carried over the "resume"


def test_unknown_action_kind_is_a_config_error():
    with pytest.raises(ValidationError):
        TypeAdapter(ActionArgs).validate_python({"kind": "explode"})


@pytest.mark.slow
def test_run_stops_early_saves_and_exits_zero(tmp_path, corpus_root):
    # bpb falls during training, so "max" never improves after the first log step: stop at step 3.
    dump = tmp_path / "run"
    argv = [
        *TINY_ENTROPY,
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "steps=30",
        "actions=[{kind: early_stop, metric: bpb, mode: max, patience: 2}]",
    ]
    res = run_cli("bytelatent.train", argv)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "early stop at step 3" in res.stdout
    assert [r["global_step"] for r in metrics(dump)] == [1, 2, 3]
    assert (dump / "checkpoints" / f"{3:010d}" / ".complete").exists()
    state = json.loads((dump / "checkpoints" / f"{3:010d}" / "train_state_00000.json").read_text())
    assert state["actions"]["0:early_stop"]["bad_reports"] == 2


@pytest.mark.slow
def test_early_stop_state_survives_a_resume_in_the_middle(tmp_path, corpus_root):
    # bpb falls, so with mode=max every report after step 1 is a bad one: patience 3 stops at 4.
    # The first run ends at max_steps=2 (1 bad report saved); if the resume forgot it, step 3
    # would become the new best and the run would stop at 6 instead.
    dump = tmp_path / "run"
    argv = [
        *TINY_ENTROPY,
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "steps=30",
        "checkpoint.dump.every=0",
        "actions=[{kind: early_stop, metric: bpb, mode: max, patience: 3}]",
    ]
    first = run_cli("bytelatent.train", [*argv, "max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "early stop" not in first.stdout
    second = run_cli("bytelatent.train", argv)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "early stop at step 4" in second.stdout
    assert [r["global_step"] for r in metrics(dump)] == [1, 2, 3, 4]
    state = json.loads((dump / "checkpoints" / f"{4:010d}" / "train_state_00000.json").read_text())
    assert state["actions"]["0:early_stop"] == {
        "best": metrics(dump)[0]["bpb"],
        "best_step": 1,
        "bad_reports": 3,
    }
