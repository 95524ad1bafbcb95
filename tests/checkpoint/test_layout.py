"""Checkpoint folders without a model or DCP: names, markers, listing, leases; retention."""

from __future__ import annotations

import json
import os

import pytest

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.layout import (
    MARKER_FILE,
    FolderStore,
    StepFolder,
    marker_problem,
    normalize_kinds,
    parse_step,
    read_marker,
    step_folder_name,
    write_marker,
)
from bytelatent.checkpoint.retention import Retention, retention_plan


def _store(tmp_path) -> FolderStore:
    path = str(tmp_path / "ck")
    return FolderStore(cfs.get_fs(path), path)


def _folder(
    store: FolderStore, step: int, kinds: list[str] | None, marker: str | None = None
) -> str:
    """A step folder with a data file and, unless kinds is None, a marker (or raw `marker` text)."""
    folder = store.step_folder(step)
    os.makedirs(folder)
    open(os.path.join(folder, "__0_0.distcp"), "wb").write(b"x" * 8)
    if marker is not None:
        open(os.path.join(folder, MARKER_FILE), "w").write(marker)
    elif kinds is not None:
        write_marker(store.fs, folder, {"step": step, "kinds": kinds})
    return folder


def _steps(store: FolderStore) -> list[int]:
    return [entry.step for entry in store.scan()]


def test_names_and_kinds():
    assert step_folder_name(42) == "0000000042"
    assert parse_step("s3://b/ck/0000000042/") == 42
    assert parse_step("0000000042.corrupt-20260101T000000") is None
    assert normalize_kinds(["eval", "dump", "eval"]) == ["dump", "eval"]
    with pytest.raises(ValueError, match="checkpoint kind"):
        normalize_kinds("weekly")


def test_scan_lists_step_folders_oldest_first_with_markers(tmp_path):
    store = _store(tmp_path)
    _folder(store, 20, ["dump"])
    _folder(store, 3, None)  # partial
    os.makedirs(os.path.join(store.path, "0000000010.corrupt-x"))
    entries = store.scan()
    assert [(e.step, e.complete, e.kinds) for e in entries] == [
        (3, False, []),
        (20, True, ["dump"]),
    ]
    assert [e.step for e in store.complete()] == [20]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"kinds": "dump"}', "\xff"])
def test_damaged_marker_does_not_count_as_complete(tmp_path, text):
    store = _store(tmp_path)
    folder = _folder(store, 5, None, marker=text)
    assert read_marker(store.fs, folder) is None
    assert "damaged marker" in marker_problem(store.fs, folder)
    _folder(store, 6, ["dump"])
    # A damaged marker is not an exemption: the folder goes like any stale partial save.
    assert Retention(store, dump_keep=1, eval_keep=0).apply(6) == [folder]
    assert _steps(store) == [6]


def test_retention_plan_groups_kinds_and_keeps_newest_and_step_saves():
    def entry(step, *kinds):
        return StepFolder(step, f"/ck/{step}", {"kinds": list(kinds)})

    folders = [
        entry(1, "dump"),
        entry(2, "eval"),
        entry(3, "dump", "eval"),
        entry(4, "step"),
        entry(5, "dump"),
        StepFolder(6, "/ck/6", None),  # partial, newer than the save just made: may be in flight
        entry(7, "eval"),
    ]
    plan = retention_plan(folders, just_saved=5, dump_keep=1, eval_keep=1)
    # dumps keep 5; evals keep 7; 3 is retired by both groups; 4 is a `step` save; 7 is newest.
    assert [e.step for e in plan] == [1, 2, 3]
    assert retention_plan(folders, just_saved=7, dump_keep=0, eval_keep=0) == [folders[5]]


def test_leases_and_holds_keep_folders(tmp_path):
    store = _store(tmp_path)
    for step in (1, 2, 3, 4):
        _folder(store, step, ["eval"])
    open(os.path.join(store.step_folder(1), ".lease.eval"), "w").write("{}")
    held = []

    def hold(step, folder, kinds):
        held.append((step, kinds))
        return "its eval is owed" if step == 2 else None

    deleted = Retention(store, dump_keep=0, eval_keep=1, hold=hold).apply(4)
    assert deleted == [store.step_folder(3)]
    assert _steps(store) == [1, 2, 4]
    assert held == [(2, ["eval"]), (3, ["eval"])]  # the leased folder never reaches the hold


def test_delete_removes_marker_first_and_set_aside_renames(tmp_path):
    store = _store(tmp_path)
    folder = _folder(store, 1, ["dump"])
    aside = store.set_aside(folder)
    assert aside.startswith(folder + ".corrupt-") and os.path.isdir(aside)
    assert store.scan() == []
    again = store.set_aside(_folder(store, 1, ["dump"]))
    assert again != aside and os.path.isdir(again)  # a second set-aside gets its own name
    folder = _folder(store, 2, ["dump"])
    store.delete(folder)
    assert not os.path.exists(folder)
    assert json.loads(open(os.path.join(aside, MARKER_FILE)).read())["kinds"] == ["dump"]
