"""One huge record costs bounded memory and gives one line (issue 38, item 3): a line longer than
`data.max_document_bytes` is a bad record, passed without being held whole; documents are kept
in the tokenizer's small dtype until the batch is built."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import numpy as np
import pytest
import zstandard
from datagen import write_jsonl

from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.file import FileIteratorState
from bytelatent.data.iterators.preprocess import PreprocessIteratorState
from bytelatent.errors import DataError

HUGE = 64 << 20  # bytes of the long line: a modest stand-in for the 3 GiB
LIMIT = 1 << 20


def _write_long_line_file(path, suffix: str) -> None:
    """A good line, one JSON line of HUGE bytes, a good line; compressed in pieces so that the
    test itself never holds the long line (nor its compressed form) whole."""
    head = json.dumps({"text": "before"}).encode() + b"\n"
    tail = b"\n" + json.dumps({"text": "after"}).encode() + b"\n"
    piece = b"a" * (1 << 20)
    if suffix == "gz":
        with gzip.open(path, "wb", compresslevel=1) as out:
            out.write(head + b'{"text": "')
            for _ in range(HUGE // len(piece)):
                out.write(piece)
            out.write(b'"}' + tail)
    elif suffix == "zst":
        with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as out:
            out.write(head + b'{"text": "')
            for _ in range(HUGE // len(piece)):
                out.write(piece)
            out.write(b'"}' + tail)
    else:
        with open(path, "wb") as out:
            out.write(head + b'{"text": "')
            for _ in range(HUGE // len(piece)):
                out.write(piece)
            out.write(b'"}' + tail)


def _state(path, suffix, **kw) -> FileIteratorState:
    fmt = {"jsonl": "json", "gz": "gz", "zst": "zst"}[suffix]
    return FileIteratorState(
        shards=[{"path": str(path), "format": fmt}], max_document_bytes=LIMIT, **kw
    )


@pytest.mark.parametrize("suffix", ["gz", "zst", "jsonl"])
def test_a_line_over_the_limit_is_one_error_read_in_bounded_memory(tmp_path, suffix):
    path = tmp_path / f"long.jsonl.{suffix}" if suffix != "jsonl" else tmp_path / "long.jsonl"
    _write_long_line_file(path, suffix)
    it = _state(path, suffix).build()
    assert next(it).text == "before"
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:
            next(it)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    line = err.value.one_line()
    assert line.startswith(f"data error: {path}: row 1: a record of {HUGE + 13} bytes, more than ")
    assert "data.max_document_bytes=1048576" in line and "\n" not in line
    # the reader held a bounded piece of the 64 MiB line, never all of it (the limit, one
    # decompression step, the compressed chunk and the buffer's growth)
    assert peak < 24 << 20, f"peak {peak / 2**20:.1f} MiB while passing a 64 MiB line"


@pytest.mark.parametrize("suffix", ["gz", "jsonl"])
def test_skip_bad_records_passes_the_long_line_and_counts_it(tmp_path, suffix):
    path = tmp_path / f"long.jsonl.{suffix}" if suffix != "jsonl" else tmp_path / "long.jsonl"
    _write_long_line_file(path, suffix)
    it = _state(path, suffix, skip_bad_records=True).build()
    assert [d.text for d in it] == ["before", "after"]
    assert it.get_state().n_skipped == 1


def test_a_resume_after_the_long_line_continues_exactly(tmp_path):
    path = tmp_path / "long.jsonl.gz"
    _write_long_line_file(path, "gz")
    it = _state(path, "gz", skip_bad_records=True).build()
    assert next(it).text == "before"
    assert next(it).text == "after"
    saved = it.get_state()
    assert saved.position["row"] == 3
    with pytest.raises(StopIteration):
        next(saved.build())


def test_table_text_over_the_limit_is_a_bad_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["short", "é" * 600, "fine"]}), path)
    state = FileIteratorState(shards=[{"path": str(path), "format": "parquet"}])
    assert len(list(state.build())) == 3  # the default limit (64 MiB) takes them all
    small = state.model_copy(update={"max_document_bytes": 1000})
    with pytest.raises(DataError, match=r"row 1: a record of 1200 bytes, more than .*=1000"):
        list(small.build())


def test_documents_are_held_in_a_small_dtype_and_batches_are_unchanged(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", "d", range(30))
    files = FileIteratorState(shards=[{"path": str(path), "format": "json"}])
    doc = next(PreprocessIteratorState(source=files).build())
    assert doc.tokens.dtype == np.int16  # 2 bytes per byte, not 8
    args = DataArgs(
        dataset_files=[str(path)],
        batch_size=2,
        seq_len=8,
        max_encoder_seq_length=32,
        load_async=False,
        patcher_args={"patching_mode": "space"},
    )
    batch = next(args.build_from_rank(0, 1))
    assert batch.x.dtype == np.int64 and batch.y.dtype == np.int64
    assert batch.patch_lengths.dtype == np.int64


def test_the_limit_is_a_data_key_with_a_default():
    assert DataArgs(dataset_files=["x.jsonl"]).max_document_bytes == 64 << 20
    with pytest.raises(ValueError):
        DataArgs(dataset_files=["x.jsonl"], max_document_bytes=0)
