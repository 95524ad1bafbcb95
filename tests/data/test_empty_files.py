"""A dataset with an empty shard trains, the empty file skipped with one line; the "no documents"
error blames ranks only when they are the cause (issue 38, item 4)."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datagen import write_jsonl

from bytelatent.data.args import DataArgs
from bytelatent.data.empty_files import drop_empty
from bytelatent.data.iterators.file import FileIteratorState, LoopingIteratorState
from bytelatent.errors import DataError


def _parquet(path, n_rows: int):
    texts = [f"row {i} of {path.stem}: some text to train on" for i in range(n_rows)]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path)
    return path


def _args(root, **kw) -> DataArgs:
    base = {
        "root_dir": str(root),
        "sources": {"pqzero2": 1.0},
        "batch_size": 2,
        "seq_len": 8,
        "max_encoder_seq_length": 32,
        "load_async": False,
        "patcher_args": {"patching_mode": "space"},
    }
    return DataArgs(**(base | kw))


def test_an_empty_parquet_shard_is_skipped_and_two_ranks_train(tmp_path, caplog):
    folder = tmp_path / "pqzero2"
    folder.mkdir()
    _parquet(folder / "a.parquet", 0)
    _parquet(folder / "b.parquet", 200)
    args = _args(tmp_path)
    with caplog.at_level(logging.WARNING):
        for rank in range(2):
            it = args.build_from_rank(rank, 2)
            for _ in range(5):
                assert next(it).mask.any()
            it.close()
    skipped = [r.getMessage() for r in caplog.records if "has no rows" in r.getMessage()]
    assert skipped and all("a.parquet" in m for m in skipped)


def test_every_file_empty_is_one_error_naming_the_source(tmp_path):
    folder = tmp_path / "pqzero2"
    folder.mkdir()
    _parquet(folder / "a.parquet", 0)
    _parquet(folder / "c.parquet", 0)
    with pytest.raises(DataError, match="data source 'pqzero2': none of its 2 file"):
        _args(tmp_path).build_from_rank(0, 1)


def test_drop_empty_keeps_files_with_rows(tmp_path):
    full = write_jsonl(tmp_path / "full.jsonl", "f", range(3))
    zero = tmp_path / "zero.jsonl"
    zero.write_bytes(b"")
    empty_pq = _parquet(tmp_path / "e.parquet", 0)
    rows_pq = _parquet(tmp_path / "r.parquet", 4)
    paths = [str(p) for p in (full, zero, empty_pq, rows_pq)]
    kept, formats = drop_empty(paths, ["json", "json", "parquet", "parquet"])
    assert kept == [str(full), str(rows_pq)] and formats == ["json", "parquet"]


def test_no_documents_names_the_files_not_the_ranks(tmp_path):
    bad = tmp_path / "allbad.jsonl"
    bad.write_bytes(b"{oops\n{nope\n")
    for stride, offset in ((1, 0), (2, 1)):
        shards = [{"path": str(bad), "format": "json", "stride": stride, "offset": offset}]
        looping = LoopingIteratorState(
            file_state=FileIteratorState(shards=shards, skip_bad_records=True)
        )
        with pytest.raises(DataError) as err:
            next(looping.build())
        assert "no readable documents" in str(err.value) and "rank" not in str(err.value)


def test_too_many_ranks_for_the_rows_says_so(tmp_path):
    three = write_jsonl(tmp_path / "three.jsonl", "t", range(3))
    shards = [{"path": str(three), "format": "json", "stride": 4, "offset": 3}]
    looping = LoopingIteratorState(file_state=FileIteratorState(shards=shards))
    with pytest.raises(DataError, match=r"row % 4 == 3\) hold no readable document; use fewer"):
        next(looping.build())
