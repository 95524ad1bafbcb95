"""Training warns, once per file, about bytes after the last frame of a `.zst` file, as soon as
it opens the file, not only when (or if) it reaches them (issue 38, item 11)."""

from __future__ import annotations

import json
import logging

import pytest
import zstandard

from bytelatent.data.iterators.file import FileIteratorState
from bytelatent.data.readers import zstd_frames
from bytelatent.data.readers.zstd_frames import garbage_offset
from bytelatent.errors import DataError


def _lines(n: int, start: int = 0) -> bytes:
    return b"".join(
        json.dumps({"text": f"line {i} " * 10}).encode() + b"\n" for i in range(start, start + n)
    )


def _frames(**kw) -> bytes:
    compressor = zstandard.ZstdCompressor(**kw)
    return b"".join(compressor.compress(_lines(20, 20 * f)) for f in range(4))


@pytest.mark.parametrize(
    "options",
    [{}, {"write_checksum": True}, {"write_content_size": False}, {"level": 19}],
)
def test_well_formed_files_have_no_garbage(tmp_path, options):
    path = tmp_path / "ok.jsonl.zst"
    skippable = (0x184D2A50).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    path.write_bytes(_frames(**options) + skippable + _frames(**options))
    assert garbage_offset(str(path)) is None


@pytest.mark.parametrize("tail", [b"this is not compressed data\n", b"\0" * 16, b"x"])
def test_trailing_garbage_is_found_where_it_starts(tmp_path, tail):
    good = _frames()
    path = tmp_path / "g.jsonl.zst"
    path.write_bytes(good + tail)
    assert garbage_offset(str(path)) == len(good)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(zstd_frames, "_warned", set())


def test_opening_a_file_with_garbage_warns_once(tmp_path, caplog, fresh_warnings):
    good = _frames()
    path = tmp_path / "g.jsonl.zst"
    path.write_bytes(good + b"garbage after the frames\n")
    shards = [{"path": str(path), "format": "zst", "stride": 2, "offset": k} for k in (0, 1)]
    with caplog.at_level(logging.WARNING, logger="bytelatent.data.readers.zstd_frames"):
        for shard in shards:  # two streams reading halves of the file: one line
            it = FileIteratorState(shards=[shard]).build()
            assert next(it).text.startswith("line ")
            it.close()
    lines = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"the bytes from {len(good)} on are not zstd data" in lines[0]
    # reading still stops at the garbage with one error, as before
    with pytest.raises(DataError, match="corrupt compressed data"):
        list(FileIteratorState(shards=[{"path": str(path), "format": "zst"}]).build())


def test_a_clean_file_opens_without_a_warning(tmp_path, caplog, fresh_warnings):
    path = tmp_path / "ok.jsonl.zst"
    path.write_bytes(_frames())
    with caplog.at_level(logging.WARNING):
        assert (
            len(list(FileIteratorState(shards=[{"path": str(path), "format": "zst"}]).build()))
            == 80
        )
    assert not [r for r in caplog.records if "zstd" in r.getMessage()]
