"""A run with nothing to do says so and writes nothing; a changed config is reported, and a model
shape change is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.config.redact import redacted_dump
from bytelatent.errors import ConfigError
from bytelatent.train import main
from bytelatent.trainer.optim import lr_factor_fn
from bytelatent.trainer.resume_check import changes_line, check_resume, config_changes, flatten
from bytelatent.trainer.resume_rules import Saved, apply_source_weights, decide, rule_of
from tests.conftest import TINY_ENTROPY
from tests.tiny import TINY_BLT_MODEL
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


def test_a_model_shape_change_is_refused_naming_the_key(tmp_path, chdir_repo, capsys, corpus_root):
    dump = tmp_path / "run"  # real data: the config phase checks the sources first
    argv = [*ARGV, f"dump_dir={dump}", "steps=300", f"data.root_dir={corpus_root}"]
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


# ---------------------------------------------------------------- issue 29 item 4: every changed key
# A data state as train_state files hold it, reduced to what check_resume reads: its sources.
DATA_STATE = {"type": "packing", "source": {"type": "sampling", "weights": {"stdlib": 1.0}}}
BLT_ARGV = ["config=configs/debug.yaml", *TINY_BLT_MODEL, "data.seq_len=16", "steps=200"]


def refused_line(tmp_path, capsys, argv: list[str], change: list[str]) -> str:
    """The one stderr line of a resume with `change`, checked to exit 2 and write nothing."""
    dump = tmp_path / "run"
    argv = [*argv, f"dump_dir={dump}", "steps=300"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv), data_state=DATA_STATE)
    before = snapshot(dump)
    assert main([*argv, *change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert snapshot(dump) == before  # refused before the lock, train.log, config.yaml
    return err[0]


@pytest.mark.parametrize(
    "argv, change, key",
    [
        (ARGV, ["data.seq_len=64"], "data.seq_len=64 (checkpoint: 128)"),
        (BLT_ARGV, ["data.patcher_args.patching_mode=byte"],
         "data.patcher_args.patching_mode=byte (checkpoint: space)"),
        (ARGV, ["data.sources.more=1.0"], "data.sources.more=1.0 (checkpoint: null)"),
        (ARGV, ["seed=7"], "seed=7 (checkpoint: 42)"),
        (ARGV, ["data.root_dir=elsewhere"], "data.root_dir=elsewhere (checkpoint: data)"),
    ],
)  # fmt: skip
def test_a_key_the_restored_state_would_override_is_refused_naming_it(
    tmp_path, chdir_repo, capsys, argv, change, key
):
    line = refused_line(tmp_path, capsys, argv, change)
    assert line.startswith(f"config error: {key}: a resume cannot apply it"), line
    assert line.endswith("restore the value or use another dump_dir")


def test_a_new_source_is_refused_saying_the_data_state_lacks_it(tmp_path, chdir_repo, capsys):
    line = refused_line(tmp_path, capsys, ARGV, ["data.sources.more=1.0"])
    assert "no position in source 'more' (it reads ['stdlib'])" in line


def test_an_optimizer_group_added_at_resume_is_refused_naming_it(tmp_path, chdir_repo, capsys):
    line = refused_line(
        tmp_path, capsys, ARGV, ["optim.groups=[{params: 'layers.*', lr_scale: 0.5}]"]
    )
    assert line.startswith("config error: optim.groups=")
    assert "adds params='layers.*'" in line and "optimizer state has the groups []" in line


def test_applied_keys_say_what_applies_them_in_the_changes_line(tmp_path, chdir_repo):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "data.sources={stdlib: 1.0, other: 1.0}", "steps=300"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv), data_state={
        "type": "sampling", "weights": {"stdlib": 1.0, "other": 1.0},
    })  # fmt: skip
    changed = [*argv, "optim.lr=0.005", "data.sources={stdlib: 1.0}", "optim.weight_decay=0.0",
               "logging.freq=5"]  # fmt: skip
    check = check_resume(parse_args(TrainArgs, changed))  # no ConfigError
    line = changes_line(check)
    assert "optim.lr 0.003 -> 0.005 (applied: the lr schedule)" in line
    assert "data.sources.other 1.0 -> null (applied: the mixture weights" in line
    assert "optim.weight_decay 0.1 -> 0.0 (applied: AdamW hyperparameters)" in line
    assert "logging.freq 10 -> 5," in line or line.endswith("logging.freq 10 -> 5")


def test_every_key_of_train_args_has_a_resume_rule():
    """A new key must say what a resume does with it (the refusal of an unruled key is a guard
    for users, not a decision)."""
    keys = flatten(redacted_dump(parse_args(TrainArgs, [*BLT_ARGV, "dump_dir=x"])))
    keys |= flatten(redacted_dump(parse_args(TrainArgs, [*ARGV, "dump_dir=x"])))
    assert [k for k in keys if rule_of(k) is None] == []


def test_a_key_only_an_older_version_had_is_reported_not_refused():
    rule = decide("data.gone_key", 1, None, in_config=False, saved=Saved(data_sources={"a"}))
    assert rule.decision == "ignored"


def test_source_weights_apply_to_every_stream_and_a_new_source_is_refused():
    state = {"type": "packing", "source": {"type": "streams", "streams": [
        {"type": "sampling", "weights": {"a": 1.0, "b": 1.0}, "sources": {}},
        {"type": "sampling", "weights": {"a": 1.0, "b": 1.0}, "sources": {}},
    ]}}  # fmt: skip
    new, changed = apply_source_weights(state, {"a": 3.0})
    assert (
        changed and [s["weights"] for s in new["source"]["streams"]] == [{"a": 3.0, "b": 0.0}] * 2
    )
    assert apply_source_weights(new, {"a": 3.0}) == (new, False)
    with pytest.raises(ConfigError, match=r"data.sources.c: .* no position in source 'c'"):
        apply_source_weights(state, {"a": 1.0, "c": 1.0})


@pytest.mark.slow
def test_resume_applies_a_new_lr_schedule_and_new_mixture_weights(tmp_path, corpus_root):
    root = tmp_path / "data"
    root.mkdir()
    for name in ("stdlib", "other"):  # two sources (the same files) for a mixture
        (root / name).symlink_to(corpus_root / "stdlib")
    dump = tmp_path / "run"
    argv = ["config=configs/entropy_debug.yaml", *TINY_ENTROPY, f"dump_dir={dump}",
            f"data.root_dir={root}", "data.sources={stdlib: 1.0, other: 1.0}", "logging.freq=1"]  # fmt: skip
    first = run_cli("bytelatent.train", [*argv, "steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    changed = [*argv, "steps=4", "optim.lr=0.005", "data.sources={stdlib: 1.0}"]
    res = run_cli("bytelatent.train", changed)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "optim.lr 0.003 -> 0.005 (applied: the lr schedule)" in res.stdout
    assert "data.sources.other 1.0 -> null (applied: the mixture weights" in res.stdout
    args = parse_args(TrainArgs, changed)
    schedule = lr_factor_fn(args.optim, args.steps)
    lrs = {r["global_step"]: r["lr"] for r in metrics(dump)}
    assert [lrs[s] for s in (3, 4)] == pytest.approx([0.005 * schedule(s) for s in (3, 4)])
    state = json.loads((dump / "checkpoints" / f"{4:010d}" / "train_state_00000.json").read_text())
    assert sampling_weights(state["data_state"]) == [{"stdlib": 1.0, "other": 0.0}] * 2
    assert "lr: 0.005" in (dump / "config.yaml").read_text()  # what the run used


def sampling_weights(node) -> list[dict]:
    if isinstance(node, list):
        return [w for v in node for w in sampling_weights(v)]
    if not isinstance(node, dict):
        return []
    own = [node["weights"]] if node.get("type") == "sampling" else []
    return own + [w for v in node.values() for w in sampling_weights(v)]


def test_python_and_python3_of_one_venv_are_no_config_change(tmp_path):
    import os
    import sys

    bin_dir = os.path.dirname(sys.executable)
    python3 = os.path.join(bin_dir, "python3")
    if not os.path.exists(python3):
        pytest.skip("no python3 beside the interpreter")
    saved = {"eval": {"async_launch": {"python": python3}}}
    assert config_changes(saved, {"eval": {"async_launch": {"python": sys.executable}}}) == []
    other = str(tmp_path / "python")  # another folder: another venv
    assert config_changes(saved, {"eval": {"async_launch": {"python": other}}}) != []
