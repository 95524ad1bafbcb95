"""Issue 38, items 5, 7, 8 and 9: what a resume does with `data.skip_bad_records` and init-only
keys, and one line (no traceback) for a damaged train state, a wrong `checkpoint.load_path` and
a saved read position that is negative, not an integer or in the middle of a line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import zstandard

from bytelatent.args import TrainArgs
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.verify import write_folder_manifest
from bytelatent.config import parse_args
from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.file import FileIteratorState, FileShard
from bytelatent.data.iterators.states import load_state
from bytelatent.data.readers import format_of as file_format_of
from bytelatent.errors import DataError
from bytelatent.train import main, parse_command
from bytelatent.trainer.resume_check import changes_line, check_resume
from bytelatent.trainer.resume_rules import apply_skip_bad_records, rule_of
from tests.trainer.test_cli import run_cli
from tests.trainer.test_resume_check import ARGV, DATA_STATE, fake_checkpoint, snapshot

LINES = [json.dumps({"text": f"row {i} lorem ipsum dolor sit amet"}) + "\n" for i in range(40)]


@pytest.fixture
def chdir_repo(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------- item 5: skip_bad_records
def test_skip_bad_records_may_change_on_resume_and_reaches_the_restored_readers(
    tmp_path, chdir_repo
):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "steps=300"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv), data_state=DATA_STATE)
    check = check_resume(parse_args(TrainArgs, [*argv, "data.skip_bad_records=true"]))
    assert check.rules["data.skip_bad_records"].decision == "applied"  # not a ConfigError
    assert "data.skip_bad_records false -> true (applied" in changes_line(check)

    # the restored iterators take the new value: a state saved before a bad row reads past it
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "s.chunk.00.jsonl").write_text("".join([*LINES[:3], "{bad\n", *LINES[3:]]))
    data = DataArgs(root_dir=str(tmp_path), sources={"s": 1.0}, batch_size=1, seq_len=16,
                    buffer_size=1, load_async=False, patcher_args={"patching_mode": "byte"})  # fmt: skip
    saved = json.loads(data.initial_state(0, 1).model_dump_json())
    with pytest.raises(DataError, match="row 3: malformed JSON"):
        for _ in load_state(saved).build():
            pass
    resumed = load_state(apply_skip_bad_records(saved, True)).build()
    assert sum(1 for _, _ in zip(range(30), resumed)) == 30  # past row 3: skipped and counted


# ---------------------------------------------------------------- item 7: init-only keys
@pytest.mark.parametrize(
    "key",
    ["model.seed", "model.init_base_std", "model.init_std_factor", "model.global_init.path",
     "entropy_model.seed", "entropy_model.init_base_std", "arch_args.seed",
     "arch_args.init_base_std", "arch_args.global_init.path"],
)  # fmt: skip
def test_init_only_keys_have_no_effect_on_a_resume(key):
    assert rule_of(key).decision == "no effect on a resume"
    assert rule_of(key.split(".")[0] + ".dim").decision == "applied"  # a shape key is not


def test_a_changed_init_seed_is_reported_as_having_no_effect(tmp_path, chdir_repo):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "steps=300"]
    fake_checkpoint(dump, 200, parse_args(TrainArgs, argv), data_state=DATA_STATE)
    check = check_resume(
        parse_args(TrainArgs, [*argv, "entropy_model.seed=7", "entropy_model.init_base_std=0.5"])
    )
    line = changes_line(check)
    assert "entropy_model.seed 42 -> 7 (no effect on a resume:" in line, line
    assert "entropy_model.init_base_std null -> 0.5 (no effect on a resume:" in line, line
    assert "(applied" not in line


# ---------------------------------------------------------------- item 8: one line, no traceback
@pytest.mark.parametrize("data_state", ["garbage", [1, 2], 3])
def test_a_data_state_of_the_wrong_type_is_one_line(
    tmp_path, chdir_repo, capsys, corpus_root, data_state
):
    dump = tmp_path / "run"
    argv = [*ARGV, f"dump_dir={dump}", "steps=300", f"data.root_dir={corpus_root}"]
    folder = fake_checkpoint(dump, 200, parse_args(TrainArgs, argv), data_state=data_state)
    before = snapshot(dump)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"checkpoint error: {folder}/train_state_00000.json: data_state: Input should be a "
        "valid dictionary"
    ), err
    assert "checkpoint.load_path" in err[0]
    assert snapshot(dump) == before


@pytest.mark.parametrize("kind", ["file", "missing"])
def test_a_load_path_that_is_not_a_folder_is_refused_before_anything(
    tmp_path, chdir_repo, capsys, kind
):
    target = tmp_path / "ckpt"
    if kind == "file":
        target.write_text("not a checkpoint\n")
    dump = tmp_path / "run"
    assert parse_command([*ARGV, f"dump_dir={dump}", f"checkpoint.load_path={target}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    what = "is a file, not a step folder" if kind == "file" else "does not exist"
    assert err == [
        f"checkpoint error: checkpoint.load_path {target}: {what}; point it at a step folder "
        "(e.g. runs/x/checkpoints/0000001000), or unset it to resume from dump_dir"
    ]
    assert not dump.exists()  # before torch, the model and the run lock


def _file_state(path: Path, position: dict) -> FileIteratorState:
    shard = FileShard(path=str(path), format=file_format_of(str(path)))
    return FileIteratorState(shards=[shard], position=position)


@pytest.mark.parametrize(
    ("position", "why"),
    [({"row": 2, "byte_offset": -5}, "byte_offset=-5 is negative"),
     ({"row": -1, "byte_offset": 0}, "row=-1 is negative"),
     ({"row": 2, "byte_offset": 1.5}, "byte_offset: Input should be a valid integer"),
     ({"row": 2, "byte_offset": "abc"}, "byte_offset: Input should be a valid integer")],
)  # fmt: skip
def test_a_negative_or_non_integer_read_position_is_one_line(tmp_path, position, why):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(LINES))
    with pytest.raises(DataError) as info:
        next(_file_state(path, position).build())
    message = str(info.value)
    assert message.startswith(f"{path}: the saved read position") and why in message, message
    assert "\n" not in message and "checkpoint.load_path" in message


def test_a_negative_stream_offset_is_one_line():
    state = {"type": "sequence", "args": {"seq_len": 8}, "doc_offset": -3,
             "source": {"type": "preprocess", "source": {"type": "file", "shards": []}}}  # fmt: skip
    with pytest.raises(DataError) as info:
        load_state(state)
    assert str(info.value).startswith(
        "data loader state is not valid: sequence.doc_offset: Input should be greater than or "
        "equal to 0"
    )
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- item 9: a position mid-line
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_a_position_in_the_middle_of_a_line_blames_the_position(tmp_path, suffix):
    path = tmp_path / f"a{suffix}"
    data = "".join(LINES).encode()
    path.write_bytes(zstandard.compress(data) if suffix.endswith(".zst") else data)
    start = len(LINES[0]) + len(LINES[1])  # row 2 starts here
    good = _file_state(path, {"row": 2, "byte_offset": start}).build()
    assert next(good).text == json.loads(LINES[2])["text"]  # the start of a line reads
    for offset in (start + 7, start - 1):
        with pytest.raises(DataError) as info:
            next(_file_state(path, {"row": 2, "byte_offset": offset}).build())
        assert str(info.value) == (
            f"{path}: the saved read position (row 2, byte {offset}) is not at the start of a "
            "line: the file changed since the checkpoint was saved, or the checkpoint's data "
            "state is damaged; restore the file, or resume from an earlier checkpoint "
            "(checkpoint.load_path)"
        )


# ---------------------------------------------------------------- end to end (the trainer)
def _tamper(src: Path, dst: Path, edit) -> Path:
    """A copy of the run whose newest train state `edit` changed, manifests rewritten (so the
    checkpoint verifies, as a deliberate edit would)."""
    shutil.copytree(src, dst)
    folder = sorted((dst / "checkpoints").iterdir())[-1]
    file = folder / "train_state_00000.json"
    state = json.loads(file.read_text())
    edit(state)
    file.write_text(json.dumps(state))
    write_folder_manifest(cfs.get_fs(str(folder)), str(folder), 1)
    return dst


def _file_states(state: dict) -> list[dict]:
    streams = state["data_state"]["source"]["streams"]
    return [s["sources"]["s"]["source"]["source"]["file_state"] for s in streams]


@pytest.mark.slow
def test_resumes_of_damaged_states_and_a_changed_skip_bad_records(tmp_path):
    """A run that stops at a bad row resumes with data.skip_bad_records=true (item 5); a damaged
    read position and a position moved mid-line are one data error line each (items 8, 9)."""
    root = tmp_path / "data" / "s"
    root.mkdir(parents=True)
    rows = [json.dumps({"text": f"row {i} " + "lorem ipsum dolor sit amet " * 2}) + "\n"
            for i in range(120)]  # fmt: skip
    rows[60] = '{"text": "cut off\n'
    (root / "s.chunk.00.jsonl").write_text("".join(rows))
    base = [*ARGV, f"data.root_dir={tmp_path / 'data'}", "data.sources={s: 1.0}",
            "data.batch_size=2", "data.buffer_size=2", "steps=20", "checkpoint.dump.every=3",
            "checkpoint.dump.keep=10", "logging.console=false"]  # fmt: skip
    run = tmp_path / "run"
    first = run_cli("bytelatent.train", [*base, f"dump_dir={run}"])
    assert first.returncode == 2, first.stderr[-3000:]
    assert "row 60: malformed JSON" in first.stderr and "skip_bad_records=true" in first.stderr
    assert "Traceback" not in first.stderr
    assert any((run / "checkpoints").iterdir()), "no checkpoint before the bad row"

    def resume(dump: Path, *extra: str):
        return run_cli("bytelatent.train", [*base, f"dump_dir={dump}", *extra])

    def shift(state: dict) -> None:
        _file_states(state)[1]["position"]["byte_offset"] += 7

    def negative(state: dict) -> None:
        _file_states(state)[0]["position"]["byte_offset"] = -5

    for name, edit, says in [
        ("mid", shift, "is not at the start of a line"),
        ("neg", negative, "byte_offset=-5 is negative"),
    ]:
        res = resume(_tamper(run, tmp_path / name, edit))
        assert res.returncode == 2, (name, res.stderr[-3000:])
        lines = [line for line in res.stderr.splitlines() if line.startswith("data error:")]
        assert len(lines) == 1 and says in lines[0], (name, res.stderr[-3000:])
        assert "Traceback" not in res.stderr and "malformed JSON" not in res.stderr, name

    again = resume(run, "data.skip_bad_records=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "data.skip_bad_records false -> true (applied" in again.stdout + again.stderr
    assert "skipping bad record" in (run / "train.log").read_text()
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["global_step"] == 20
