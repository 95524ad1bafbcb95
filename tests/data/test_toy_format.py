"""A format registered from outside the package (no edit under bytelatent/): a toy `.tsv` reader
(`sample_id<TAB>text` per line) read and resumed through the normal file iterator, the
`data.sources` config, `data.file_format` and `python -m bytelatent.data.check`."""

from __future__ import annotations

import numpy as np
import pytest

from bytelatent.data.args import DataArgs
from bytelatent.data.check import FileReport, check_file
from bytelatent.data.iterators.file import FileIteratorState, FileShard, assign_shards
from bytelatent.data.iterators.states import load_state
from bytelatent.data.readers import (
    BadRecord,
    DataFormat,
    Document,
    Position,
    ReadOptions,
    Shard,
    format_of,
    open_errors,
    open_fs,
    register_format,
    unregister_format,
)
from bytelatent.data.sources import source_files
from bytelatent.errors import DataError
from bytelatent.tokenizers import BltTokenizer


class TsvPosition(Position):
    byte_offset: int = 0  # of `row`


class TsvReader:
    """`sample_id<TAB>text` lines; `\\n` in the text stands for a newline."""

    def __init__(self, shard: Shard, position: TsvPosition, options: ReadOptions) -> None:
        self.path, self.stride, self.offset = shard.path, shard.stride, shard.offset
        self.row, self.byte_offset = position.row, position.byte_offset
        fs, fs_path = open_fs(shard.path, options.storage_options)
        with open_errors(shard.path):
            self.file = fs.open(fs_path, "rb")
        self.file.seek(self.byte_offset)

    def read(self) -> Document | None:
        while line := self.file.readline():
            row = self.row
            self.row += 1
            self.byte_offset += len(line)
            if row % self.stride != self.offset:
                continue
            fields = line.rstrip(b"\n").split(b"\t")
            if len(fields) != 2:
                raise BadRecord(row, f"expected 2 tab-separated fields, got {len(fields)}")
            sample_id, text = (f.decode() for f in fields)
            text = text.replace("\\n", "\n")
            return Document(sample_id, text, entropies=None, path=self.path, row=row)
        return None

    def position(self) -> dict[str, int]:  # the fields of TsvPosition
        return {"row": self.row, "byte_offset": self.byte_offset}

    def close(self) -> None:
        self.file.close()


TSV = DataFormat("tsv", (".tsv",), TsvPosition, TsvReader, listing_rank=40)


@pytest.fixture(autouse=True)
def tsv_format():
    register_format(TSV)
    yield
    unregister_format("tsv")


def write_tsv(path, prefix: str, n: int, bad_rows: tuple[int, ...] = ()):
    lines = []
    for i in range(n):
        text = f"{prefix} line {i}\\n" + "words and more words " * (i % 4 + 1)
        lines.append(f"{prefix}-{i}" + ("" if i in bad_rows else "\t" + text))
    path.write_text("\n".join(lines) + "\n")
    return path


def shards(*paths) -> list[FileShard]:
    return [FileShard(path=str(p), format=format_of(str(p))) for p in paths]


def test_the_registry_finds_the_format(tmp_path):
    folder = tmp_path / "toy"
    folder.mkdir()
    write_tsv(folder / "b.tsv", "b", 3)
    write_tsv(folder / "a.tsv", "a", 3)
    assert format_of(str(folder / "a.tsv")) == "tsv"
    assert source_files("toy", root_dir=str(tmp_path)) == [
        str(folder / n) for n in ("a.tsv", "b.tsv")
    ]
    (folder / "c.jsonl").write_text('{"text": "x"}\n')  # JSONL ranks first (30 < 40)
    assert source_files("toy", root_dir=str(tmp_path)) == [str(folder / "c.jsonl")]
    found = source_files("toy", root_dir=str(tmp_path), file_format="tsv")
    assert [p.rsplit("/", 1)[1] for p in found] == ["a.tsv", "b.tsv"]
    with pytest.raises(ValueError, match="already"):
        register_format(TSV)


@pytest.mark.parametrize("open_files", [1, 2])
def test_reads_and_resumes_at_every_position(tmp_path, open_files):
    paths = [write_tsv(tmp_path / f"t{i}.tsv", f"t{i}", 5 + i) for i in range(3)]
    state = FileIteratorState(shards=shards(*paths), open_files=open_files, order_seed=1)
    expected = [d.sample_id for d in state.build()]
    assert sorted(expected) == sorted(f"t{i}-{j}" for i in range(3) for j in range(5 + i))
    for k in range(len(expected) + 1):
        it = state.build()
        head = [next(it).sample_id for _ in range(k)]
        saved = it.get_state().model_dump_json()
        assert head + [d.sample_id for d in load_state(saved).build()] == expected, k
    it = state.build()
    next(it)
    saved = it.get_state()
    positions = [saved.position, *(o.position for o in saved.others)]
    assert {"row", "byte_offset"} in [set(p) for p in positions]  # the reader's own model


def test_rows_are_split_among_ranks_that_share_a_file(tmp_path):
    path = write_tsv(tmp_path / "one.tsv", "o", 10)
    seen = []
    for rank in range(3):
        state = FileIteratorState(shards=assign_shards([str(path)], rank, 3))
        seen += [d.sample_id for d in state.build()]
    assert sorted(seen) == sorted(f"o-{i}" for i in range(10))


def test_bad_record_is_one_data_error_or_a_counted_skip(tmp_path):
    path = write_tsv(tmp_path / "bad.tsv", "b", 4, bad_rows=(2,))
    with pytest.raises(DataError, match=r"bad\.tsv: row 2: expected 2 tab-separated fields"):
        list(FileIteratorState(shards=shards(path)).build())
    it = FileIteratorState(shards=shards(path), skip_bad_records=True).build()
    assert [d.sample_id for d in it] == ["b-0", "b-1", "b-3"]
    assert it.get_state().n_skipped == 1
    report = check_file(FileReport("train:toy", str(path), "tsv"), None, BltTokenizer())
    assert report.records == 4 and report.examples == [
        "row 2: expected 2 tab-separated fields, got 1"
    ]


def test_training_config_reads_and_resumes_a_tsv_source(tmp_path):
    (tmp_path / "toy").mkdir()
    for i in range(2):
        write_tsv(tmp_path / "toy" / f"s{i}.tsv", f"s{i}", 12)
    data = DataArgs(
        root_dir=str(tmp_path),
        sources={"toy": 1.0},
        batch_size=2,
        seq_len=32,
        add_patches=False,
        patcher_args={"patching_mode": "byte"},
        buffer_size=4,
        load_async=False,
    )
    it = data.build_from_rank(0, 1)
    for _ in range(5):
        next(it)
    saved = it.get_state().model_dump_json()
    expected = [next(it).x for _ in range(8)]
    it.close()
    assert "tsv" in saved
    resumed = data.build_from_rank(0, 1, state=saved)
    try:
        for want in expected:
            np.testing.assert_array_equal(next(resumed).x, want)
    finally:
        resumed.close()
    assert DataArgs(file_format="tsv").file_format == "tsv"
    with pytest.raises(ValueError, match="unknown format 'csv'"):
        DataArgs(file_format="csv")
