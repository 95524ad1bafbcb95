import json

import numpy as np
import pyarrow as pa
import pytest
from datagen import doc_text, write_arrow, write_jsonl

from bytelatent.data.iterators.file import (
    FileIteratorState,
    FileShard,
    LoopingIteratorState,
    assign_shards,
)
from bytelatent.data.iterators.states import load_state
from bytelatent.data.readers import BadFile, ReadOptions
from bytelatent.data.readers.table import ArrowPosition, ArrowReader
from bytelatent.errors import DataError


def shards_of(*paths):
    return [
        FileShard(path=str(p), format="arrow" if str(p).endswith(".arrow") else "json")
        for p in paths
    ]


def read_all(state):
    return [(d.sample_id, d.text) for d in state.build()]


def test_jsonl_fields_and_heuristics(tmp_path):
    path = tmp_path / "x.jsonl"
    rows = [
        {"text": "one", "id": 7},
        {"content": "two", "url": "http://u"},
        {"text": "three", "entropies": [0.5, 1.0]},
        {"text": "four"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # trailing blank line
    docs = list(FileIteratorState(shards=shards_of(path)).build())
    assert [d.text for d in docs] == ["one", "two", "three", "four"]
    assert [d.sample_id for d in docs] == ["7", "http://u", "x.jsonl:2", "x.jsonl:3"]
    assert docs[2].entropies.dtype == np.float32 and docs[2].entropies.tolist() == [
        0.5,
        1.0,
    ]
    assert docs[0].entropies is None and docs[3].row == 3


def test_arrow_fields_and_entropies(tmp_path):
    path = write_arrow(tmp_path / "x.arrow", "s", range(10), batch_rows=3)
    docs = list(FileIteratorState(shards=shards_of(path), arrow_batch_size=2).build())
    assert [d.text for d in docs] == [doc_text("s", i) for i in range(10)]
    assert [d.sample_id for d in docs] == [f"s-{i}" for i in range(10)]
    assert all(len(d.entropies) == len(d.text.encode()) + 2 for d in docs)
    stored = pa.ipc.open_file(str(path)).read_all().column("entropies").to_pylist()
    for doc, values in zip(docs, stored):
        assert np.array_equal(doc.entropies, np.asarray(values, dtype=np.float32))


@pytest.mark.parametrize("kind", ["jsonl", "arrow", "arrow_stream"])
def test_resume_at_every_row_without_replay(tmp_path, kind):
    files = []
    for i in range(2):
        ids = range(i * 11, i * 11 + 11)
        if kind == "jsonl":
            files.append(write_jsonl(tmp_path / f"f{i}.jsonl", "s", ids))
        else:
            files.append(
                write_arrow(
                    tmp_path / f"f{i}.arrow",
                    "s",
                    ids,
                    batch_rows=4,
                    stream=kind == "arrow_stream",
                )
            )
    state = FileIteratorState(shards=shards_of(*files), arrow_batch_size=3)
    expected = read_all(state)
    assert len(expected) == 22
    for k in range(len(expected) + 1):
        it = state.build()
        head = [(d.sample_id, d.text) for _, d in zip(range(k), it)]
        resumed = load_state(it.get_state().model_dump_json())
        assert head + read_all(resumed) == expected, k
    # the state points into the file: a mid-batch arrow position names its record batch
    it = state.build()
    for _ in range(6):
        next(it)
    mid = it.get_state()
    if kind == "jsonl":
        assert mid.position["byte_offset"] > 0
    else:
        assert mid.position == {"row": 6, "batch_index": 1, "batch_start_row": 4}


@pytest.mark.parametrize("n_files,world", [(3, 1), (3, 2), (3, 3), (2, 3), (1, 3), (5, 2), (4, 3)])
def test_sharding_disjoint_and_complete(tmp_path, n_files, world):
    files = [
        write_jsonl(tmp_path / f"c{i}.jsonl", "s", range(i * 5, i * 5 + 5)) for i in range(n_files)
    ]
    everything = []
    for rank in range(world):
        shards = assign_shards([str(f) for f in files], rank, world)
        ids = [d.sample_id for d in FileIteratorState(shards=shards).build()]
        assert ids, f"rank {rank} got nothing"
        everything.extend(ids)
    assert sorted(everything) == sorted(
        f"s-{i}" for i in range(n_files * 5)
    )  # each row exactly once


def test_assign_shards_rule():
    assert assign_shards(["a", "b", "c"], 1, 2) == [FileShard(path="b", format="json")]
    assert [s.path for s in assign_shards(["a", "b", "c"], 0, 2)] == ["a", "c"]
    two_on_a = assign_shards(["a", "b"], 2, 3)  # ranks 0 and 2 share file a
    assert two_on_a == [FileShard(path="a", format="json", stride=2, offset=1)]
    assert assign_shards(["a", "b"], 1, 3) == [
        FileShard(path="b", format="json", stride=1, offset=0)
    ]
    with pytest.raises(ValueError):
        assign_shards(["a"], 3, 3)


def test_looping_epochs_and_resume_across_epoch_boundary(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", "s", range(4))
    state = LoopingIteratorState(file_state=FileIteratorState(shards=shards_of(path)))
    it = state.build()
    seen = [next(it).sample_id for _ in range(10)]
    assert seen == [f"s-{i % 4}" for i in range(10)]
    assert it.get_state().epoch == 2 and it.get_state().file_state.position["row"] == 2
    for k in range(10):
        it = state.build()
        head = [next(it).sample_id for _ in range(k)]
        again = load_state(it.get_state().model_dump_json()).build()
        assert head + [next(again).sample_id for _ in range(10 - k)] == seen


def _write(path, lines: list[bytes]):
    path.write_bytes(b"".join(lines))
    return path


@pytest.mark.parametrize(
    "line,reason",
    [
        (b'{"text": "ok"\n', "malformed JSON"),
        (b'{"text": "caf\xe9"}\n', "invalid UTF-8"),
        (b'{"title": "no text"}\n', "no 'text'"),
        (b"[1, 2]\n", "expected a JSON object"),
        (b'{"text": 5}\n', "must be a string"),
    ],
)
def test_bad_jsonl_record_names_file_and_row(tmp_path, line, reason):
    path = _write(tmp_path / "bad.jsonl", [b'{"text": "fine"}\n', line, b'{"text": "after"}\n'])
    it = FileIteratorState(shards=shards_of(path)).build()
    assert next(it).text == "fine"
    with pytest.raises(DataError, match=rf"bad\.jsonl: row 1: .*{reason}"):
        next(it)
    skipping = FileIteratorState(shards=shards_of(path), skip_bad_records=True).build()
    assert [d.text for d in skipping] == ["fine", "after"]
    assert skipping.get_state().n_skipped == 1


def test_truncated_arrow_file_fails_at_open_or_skips(tmp_path):
    path = write_arrow(tmp_path / "t.arrow", "s", range(12), batch_rows=4)
    data = path.read_bytes()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    # The footer is gone: the iterator refuses it when built, before any record is yielded.
    with pytest.raises(DataError, match=r"cut\.arrow: truncated Arrow IPC file.*footer"):
        FileIteratorState(shards=shards_of(cut)).build()
    # Opening it (the check that also covers s3:// files) names the footer too.
    with pytest.raises(BadFile, match=r"truncated Arrow IPC file.*footer"):
        ArrowReader(FileShard(path=str(cut), format="arrow"), ArrowPosition(), ReadOptions())
    good = write_jsonl(tmp_path / "next.jsonl", "n", range(2))
    skipping = FileIteratorState(shards=shards_of(cut, good), skip_bad_records=True).build()
    ids = [d.sample_id for d in skipping]
    assert ids[-2:] == ["n-0", "n-1"] and skipping.get_state().n_skipped == 1


def test_not_arrow_at_all(tmp_path):
    path = tmp_path / "junk.arrow"
    path.write_bytes(b"this is not arrow data at all")
    with pytest.raises(DataError, match=r"junk\.arrow: row 0: not an Arrow"):
        next(FileIteratorState(shards=shards_of(path)).build())


def test_missing_file_and_empty_epoch_do_not_hang(tmp_path):
    with pytest.raises(DataError, match="missing.jsonl: file not found"):
        next(FileIteratorState(shards=shards_of(tmp_path / "missing.jsonl")).build())
    bad = _write(tmp_path / "allbad.jsonl", [b"{oops\n", b"{nope\n"])
    looping = LoopingIteratorState(
        file_state=FileIteratorState(shards=shards_of(bad), skip_bad_records=True)
    )
    with pytest.raises(DataError, match="no readable documents"):
        next(looping.build())


def test_state_json_is_strict(tmp_path):
    state = FileIteratorState(shards=shards_of(tmp_path / "a.jsonl"))
    data = json.loads(state.model_dump_json())
    data["surprise"] = 1
    with pytest.raises(DataError):
        load_state(json.dumps(data))


def test_truncated_arrow_among_shards_fails_before_the_first_document(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", "a", range(3))
    whole = write_arrow(tmp_path / "b.arrow", "b", range(12), batch_rows=4)
    cut = tmp_path / "c.arrow"
    cut.write_bytes(whole.read_bytes()[:-30])
    stream = write_arrow(tmp_path / "d.arrow", "d", range(4), stream=True)
    with pytest.raises(DataError, match=r"c\.arrow: truncated Arrow IPC file.*skip_bad_records"):
        FileIteratorState(shards=shards_of(good, whole, cut, stream)).build()
    fine = FileIteratorState(shards=shards_of(good, whole, stream)).build()
    assert len(list(fine)) == 3 + 12 + 4
