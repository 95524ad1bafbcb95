"""Data states written before the reader protocol (one `Cursor` with every format's position
fields, main at 6bbf1a8) load into the per-reader positions and continue at exactly the same
record. The fixtures were written by that code: tests/data/fixtures/legacy_state/make.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bytelatent.data.elastic import build_train_data
from bytelatent.data.iterators.file import FileIteratorState
from bytelatent.data.iterators.states import load_state

FIXTURES = Path(__file__).parent / "fixtures" / "legacy_state"
LEGACY_FIELDS = ("row", "byte_offset", "frame_offset", "frame_start", "batch_index")


def _fixture() -> dict:
    text = (FIXTURES / "states.json").read_text().replace("@DIR@", str(FIXTURES))
    return json.loads(text)


FIXTURE = _fixture()


def _make():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_legacy", FIXTURES / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["name"])
def test_legacy_file_state_continues_at_the_same_record(case):
    assert FIXTURE["written_by"] == "6bbf1a8"
    assert any(k in case["state"] for k in LEGACY_FIELDS)  # the old flat cursor
    state = load_state(case["state"])
    assert isinstance(state, FileIteratorState)
    it = state.build()
    # each format took its own fields of the old cursor (Parquet renamed them), no replay
    position = it.get_state().position
    legacy_name = {"row_group": "batch_index", "group_start_row": "batch_start_row"}
    assert position and all(case["state"][legacy_name.get(k, k)] == v for k, v in position.items())
    first = [next(it).sample_id for _ in range(2)]
    assert first == case["next"][:2]
    # saved again, the state is in the new form and continues as the old one would have
    resaved = it.get_state()
    assert not any(k in resaved.model_dump() for k in LEGACY_FIELDS)
    assert "legacy_cursor" not in resaved.position
    rest = [d.sample_id for d in load_state(resaved.model_dump_json()).build()]
    assert first + rest == case["next"]


def test_legacy_train_data_state_continues_with_the_same_batches():
    """The data state of a train_state JSON (whole pipeline, two files interleaved per stream,
    shuffle buffer) written by the old code yields the same next batches, bitwise."""
    make = _make()
    files = [FIXTURES / name for name in FIXTURE["files"]]
    data_state = FIXTURE["train_state"]["data_state"]
    it = build_train_data(make.data_args(files), 0, 1, 1, data_state)
    try:
        digests = [make.batch_digest(next(it)) for _ in range(len(FIXTURE["next_batches"]))]
    finally:
        it.close()
    assert digests == FIXTURE["next_batches"]
