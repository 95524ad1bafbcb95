"""A run with nothing to do says so and writes nothing; a changed config is reported, and a model
shape change is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.config.redact import redacted_dump
from bytelatent.train import main
from bytelatent.trainer.resume_check import changes_line, check_resume, config_changes
from tests.conftest import TINY_ENTROPY
from tests.trainer.test_cli import REPO, metrics, run_cli

ARGV = ["config=configs/entropy_debug.yaml", *TINY_ENTROPY, "steps=200"]


def fake_checkpoint(dump: Path, step: int, args: TrainArgs, **state) -> Path:
    """The files a resume looks at first: marker, train state, params.json (no weights)."""
    folder = dump / "checkpoints" / f"{step:010d}"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text(json.dumps({"step": step, "kinds": ["final"], "dp_size": 1}))
    (folder / "train_state_00000.json").write_text(json.dumps({"step": step, **state}))
    (folder / "params.json").write_text(json.dumps(redacted_dump(args)))
    return folder


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture
def chdir_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_a_complete_run_says_so_in_one_line_and_writes_nothing(tmp_path, chdir_repo, capsys):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv))
    (dump / "config.yaml").write_text("the run that trained\n")
    before = snapshot(dump)
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.strip() == (
        f"{dump} is complete at step 200 (steps=200); raise steps or use another dump_dir"
    )
    assert out.err == ""
    assert snapshot(dump) == before  # no config.yaml, train.log, metrics.jsonl, lock


def test_max_steps_is_named_when_it_is_the_bound(tmp_path, chdir_repo, capsys):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "max_steps=150"]
    fake_checkpoint(dump, 150, parse_args(TrainArgs, argv))
    assert main(argv) == 0
    assert "complete at step 150 (max_steps=150); raise max_steps" in capsys.readouterr().out


def test_relative_steps_is_never_complete(tmp_path, chdir_repo):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "steps=400", "relative_steps=10"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv))
    check = check_resume(parse_args(TrainArgs, argv))
    assert (check.step, check.stop_step, check.complete) == (200, 210, False)


def test_a_model_shape_change_is_refused_naming_the_key(tmp_path, chdir_repo, capsys):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "steps=300"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv))
    before = snapshot(dump)
    assert main([*argv, "entropy_model.dim=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "config error: entropy_model.dim=64 (checkpoint: 32)"
    )
    assert "cannot be resumed" in err[0]
    assert snapshot(dump) == before


def test_changes_that_keep_the_shapes_are_listed_not_refused(tmp_path, chdir_repo):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "steps=300"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv))
    changed = parse_args(TrainArgs, [*argv, "optim.lr=0.005", "entropy_model.norm_eps=1e-6"])
    check = check_resume(changed)
    keys = [k for k, _, _ in check.changes]
    assert keys == ["entropy_model.norm_eps", "optim.lr"]
    line = changes_line(check)
    assert "optim.lr 0.003 -> 0.005" in line and "entropy_model.norm_eps" in line


def test_config_changes_flattens_nested_keys():
    saved = {"a": 1, "b": {"c": [1, 2], "d": None}, "gone": 3}
    now = {"a": 1, "b": {"c": [1, 3], "d": {"e": 1}}, "new": 4}
    assert config_changes(saved, now) == [
        ("b.c", [1, 2], [1, 3]), ("b.d.e", None, 1), ("gone", 3, None), ("new", None, 4),
    ]  # fmt: skip


@pytest.mark.slow
def test_resume_with_a_changed_lr_trains_and_reports_it(tmp_path, corpus_root):
    dump = tmp_path / "run"
    argv = ["config=configs/entropy_debug.yaml", *TINY_ENTROPY, f"dump_dir={dump}",
            f"data.root_dir={corpus_root}", "logging.freq=1"]  # fmt: skip
    assert run_cli("bytelatent.train", [*argv, "steps=2"]).returncode == 0
    again = run_cli("bytelatent.train", [*argv, "steps=2"])
    assert again.returncode == 0 and again.stdout.strip().endswith(
        "raise steps or use another dump_dir"
    )
    config = (dump / "config.yaml").read_text()
    res = run_cli("bytelatent.train", [*argv, "steps=3", "optim.lr=0.005"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "config differs from" in res.stdout
        and "optim.lr" in res.stdout
        and "steps 2 -> 3" in res.stdout
    )
    assert [r["global_step"] for r in metrics(dump)] == [1, 2, 3]
    assert (dump / "config.yaml").read_text() != config  # the run that trained wrote its config
