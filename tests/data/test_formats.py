"""Parquet and compressed JSONL (.jsonl.zst / .jsonl.gz): reading, exact and cheap resume, clear
errors (corrupt footer, truncated stream, missing text column, symlink loop), shard order."""

import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from datagen import doc_text

from bytelatent.data.args import DataArgs
from bytelatent.data.check import main as check_main
from bytelatent.data.iterators.file import (
    FileIteratorState,
    FileShard,
    LoopingIteratorState,
    shard_order,
)
from bytelatent.data.readers import ReadOptions
from bytelatent.data.readers import format_of as file_format_of
from bytelatent.data.readers.table import ParquetPosition, ParquetReader
from bytelatent.data.sources import source_files
from bytelatent.errors import DataError


def records(source: str, ids) -> list[dict]:
    # FineWeb has both; the sample id is the url (first of SAMPLE_ID_KEYS present)
    return [{"id": f"urn:{i}", "text": doc_text(source, i), "url": f"{source}-{i}"} for i in ids]


def write_parquet(path, rows: list[dict], row_group_size: int = 4):
    """FineWeb-like: text, id, url, plus columns training never reads."""
    table = pa.Table.from_pylist(
        [{**r, "dump": "CC-MAIN", "score": 3.5, "blob": os.urandom(64)} for r in rows]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return path


def write_compressed(path, rows: list[dict], lines_per_frame: int | None = None):
    """DCLM-like JSONL, one zstd frame / gzip member per `lines_per_frame` lines (None: one)."""
    lines = [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows]
    step = lines_per_frame or len(lines)
    frames = [b"".join(lines[i : i + step]) for i in range(0, len(lines), step)]
    if str(path).endswith(".gz"):
        blob = b"".join(gzip.compress(f) for f in frames)
    else:
        blob = b"".join(zstandard.ZstdCompressor().compress(f) for f in frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return path


def make_corpus(root, kind: str) -> list[str]:
    """Three files of 9 rows; returns the expected sample ids."""
    for f in range(3):
        rows = records(kind, range(f * 9, f * 9 + 9))
        if kind == "parquet":
            write_parquet(root / kind / f"part-{f}.parquet", rows)
        else:
            write_compressed(root / kind / f"shard_{f}.jsonl.{kind}", rows, lines_per_frame=2)
    return [f"{kind}-{i}" for i in range(27)]


def state_for(paths, **kw) -> FileIteratorState:
    return FileIteratorState(
        shards=[FileShard(path=str(p), format=file_format_of(str(p))) for p in paths],
        arrow_batch_size=3,
        **kw,
    )


def ids(state) -> list[str]:
    return [d.sample_id for d in state.build()]


@pytest.mark.parametrize("kind", ["parquet", "zst", "gz"])
@pytest.mark.parametrize("open_files", [1, 2])
def test_reads_every_row_and_resumes_at_every_position(tmp_path, kind, open_files):
    expected = make_corpus(tmp_path, kind)
    files = source_files(kind, root_dir=str(tmp_path))
    assert len(files) == 3 and all(file_format_of(p) == kind for p in files)
    state = state_for(files, open_files=open_files, order_seed=7)
    straight = ids(state)
    assert sorted(straight) == sorted(expected)
    it = state.build()
    for position in range(len(straight)):
        saved = it.get_state()
        resumed = load_json(saved.model_dump_json())
        assert ids(resumed) == straight[position:], position
        next(it)


def load_json(text: str) -> FileIteratorState:
    return FileIteratorState.model_validate_json(text)


def unchecked(state: FileIteratorState) -> FileIteratorState:
    """`state` without its file's fingerprint: these tests damage what a resume must not read,
    which the fingerprint would rightly refuse as a changed file (tests/data/test_changed_files.py)."""
    return state.model_copy(update={"fingerprint": None})


def test_parquet_reads_only_needed_columns_and_seeks_to_the_row_group(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", records("p", range(20)), row_group_size=5)
    shard = FileShard(path=str(path), format="parquet")
    reader = ParquetReader(shard, ParquetPosition(), ReadOptions(text_keys=("text", "content")))
    assert reader.columns == ["text", "url"] and reader.num_row_groups == 4
    state = state_for([path])
    it = state.build()
    for _ in range(13):
        next(it)
    saved = it.get_state()
    assert saved.position == {"row": 13, "row_group": 2, "group_start_row": 10}
    # Damage every row group but the resumed one's: the resume must not read them.
    meta = pq.ParquetFile(str(path)).metadata
    blob = bytearray(path.read_bytes())
    for g in (0, 1):
        for c in range(meta.num_columns):
            column = meta.row_group(g).column(c)
            start = column.dictionary_page_offset or column.data_page_offset
            size = column.total_compressed_size
            blob[start : start + size] = bytes(size)
    path.write_bytes(bytes(blob))
    resumed = unchecked(saved).build()
    assert [next(resumed).sample_id for _ in range(2)] == ["p-13", "p-14"]


@pytest.mark.parametrize("suffix", ["zst", "gz"])
def test_compressed_resume_starts_at_the_last_frame(tmp_path, suffix):
    path = write_compressed(tmp_path / f"d.jsonl.{suffix}", records("z", range(40)), 4)
    it = state_for([path]).build()
    for _ in range(30):
        next(it)
    saved = it.get_state()
    at = saved.position
    assert at["row"] == 30 and 0 < at["frame_offset"] < path.stat().st_size
    assert at["frame_start"] <= at["byte_offset"]
    # Zero everything before that frame: a resume that decompressed from the start would fail.
    blob = bytearray(path.read_bytes())
    blob[: at["frame_offset"]] = bytes(at["frame_offset"])
    path.write_bytes(bytes(blob))
    assert ids(unchecked(saved)) == [f"z-{i}" for i in range(30, 40)]


def test_single_frame_file_resumes_exactly(tmp_path):
    path = write_compressed(tmp_path / "one.jsonl.zst", records("o", range(25)))
    it = state_for([path]).build()
    for _ in range(11):
        next(it)
    saved = it.get_state()
    assert saved.position["frame_offset"] == 0 and saved.position["byte_offset"] > 0
    assert ids(saved) == [f"o-{i}" for i in range(11, 25)]


def test_truncated_zst_names_file_and_last_good_line(tmp_path):
    path = write_compressed(tmp_path / "t.jsonl.zst", records("t", range(50)), 10)
    path.write_bytes(path.read_bytes()[:-40])  # cuts into the last frame (lines 41-50)
    with pytest.raises(DataError, match=r"t\.jsonl\.zst: .*truncated.*last good line is line 40;"):
        ids(state_for([path]))
    skipped = state_for([path], skip_bad_records=True).build()
    assert len(list(skipped)) == 40 and skipped.get_state().n_skipped == 1


def test_corrupt_parquet_footer_is_a_data_error_at_open(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", records("b", range(8)))
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match=r"bad\.parquet: .*footer is missing/corrupt"):
        ids(state_for([path]))


def test_parquet_without_text_column_is_a_data_error(tmp_path):
    path = tmp_path / "notext.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "x", "body": "hi"}]), str(path))
    with pytest.raises(DataError, match=r"notext\.parquet: no 'text' or 'content' column"):
        ids(state_for([path]))
    assert ids(state_for([path], text_field="body")) == ["x"]


def test_symlink_loop_is_one_data_error(tmp_path):
    loop = tmp_path / "loop.jsonl"
    os.symlink(loop, loop)
    with pytest.raises(DataError, match=r"loop\.jsonl: cannot open \(Too many levels"):
        ids(state_for([loop]))


def test_data_check_reports_each_broken_file(tmp_path, capsys):
    root = tmp_path / "src"
    good = records("g", range(6))
    write_parquet(root / "ok.parquet", good)
    bad = write_parquet(root / "bad.parquet", good)
    bad.write_bytes(bad.read_bytes()[:-12])
    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), str(root / "notext.parquet"))
    trunc = write_compressed(tmp_path / "t.jsonl.zst", good)
    trunc.write_bytes(trunc.read_bytes()[:-20])
    (tmp_path / "links").mkdir()
    os.symlink(tmp_path / "links" / "loop.jsonl", tmp_path / "links" / "loop.jsonl")
    files = [f"{root}/*.parquet", str(trunc), f"{tmp_path}/links/*.jsonl"]
    argv = [
        "config=configs/debug.yaml",
        "data.sources={}",
        f"data.dataset_files={json.dumps(files)}",
    ]
    assert check_main(argv) == 1
    out = capsys.readouterr().out
    line = {w: next(x for x in out.splitlines() if w in x) for w in ("bad.", "notext", "t.json")}
    assert "footer is missing/corrupt" in line["bad."]
    assert "no 'text' or 'content' column" in line["notext"]
    assert "truncated stream" in line["t.json"] and "last good line" in line["t.json"]
    assert "cannot open (Too many levels of symbolic links)" in out
    assert "ok.parquet" in out and "Traceback" not in out


def test_shard_order_is_seeded_per_epoch_and_interleaves_files(tmp_path):
    make_corpus(tmp_path, "parquet")
    files = source_files("parquet", root_dir=str(tmp_path))
    shards = [FileShard(path=p, format="parquet") for p in files]
    orders = {e: shard_order(shards, 42, e) for e in range(6)}
    assert orders[0] == shard_order(shards, 42, 0)  # a pure function
    assert len({tuple(o) for o in orders.values()}) > 1  # changes across epochs
    assert shard_order(shards, None, 3) == [0, 1, 2]
    looping = LoopingIteratorState(file_state=state_for(files, order_seed=42, open_files=2))
    it = looping.build()
    epoch0 = [next(it).sample_id for _ in range(27)]
    epoch1 = [next(it).sample_id for _ in range(27)]
    assert sorted(epoch0) == sorted(epoch1) and it.get_state().epoch == 1
    first = [files[i] for i in orders[0]]
    # two open files read in turn: the first documents alternate between the first two files
    assert [epoch0[0][8:], epoch0[1][8:]] == [
        f"{9 * int(first[0][-9])}",
        f"{9 * int(first[1][-9])}",
    ]


def test_training_reads_parquet_and_zst_folders(tmp_path):
    make_corpus(tmp_path, "parquet")
    make_corpus(tmp_path, "zst")
    data = DataArgs(
        root_dir=str(tmp_path),
        sources={"parquet": 1.0, "zst": 1.0},
        batch_size=2,
        seq_len=16,
        max_encoder_seq_length=64,
        buffer_size=2,
        load_async=False,
        patcher_args={"patching_mode": "space"},
    )
    it = data.build_from_rank(0, 1)
    for _ in range(30):
        next(it)
    for name, sequence in it.get_state().source.sources.items():
        files = sequence.source.source.file_state
        assert files.position.get("row", 0) > 0 or files.epoch > 0, name  # both sources were read


def test_state_stores_a_long_file_list_compactly():
    paths = [f"s3://bucket/fineweb-edu/data/CC-MAIN-2024-10/{i:05d}.parquet" for i in range(10_000)]
    state = state_for(paths)
    text = state.model_dump_json()
    naive = sum(len(s.model_dump_json()) for s in state.shards)
    assert len(text) < naive / 5 and len(text) < 20 * len(paths)  # prefix and format stored once
    assert FileIteratorState.model_validate_json(text) == state
    old_form = {**state.model_dump(), "shards": [s.model_dump() for s in state.shards]}
    assert FileIteratorState.model_validate(old_form) == state  # states of earlier versions load


def write_bad_utf8(path, n: int = 10, bad: int = 5, string_type: pa.DataType | None = None):
    """A Parquet or Arrow IPC file whose `text` column is declared string but holds one row of
    invalid UTF-8 (pyarrow writes the bytes of a binary column viewed as string unchecked)."""
    texts = [f"<u:{i}> {doc_text('u', i)}".encode() for i in range(n)]
    texts[bad] = b"caf\xe9 au lait"
    string_type = string_type or pa.string()
    binary = pa.large_binary() if string_type == pa.large_string() else pa.binary()
    table = pa.table(
        {"text": pa.array(texts, binary).view(string_type), "url": [f"u-{i}" for i in range(n)]}
    )
    if str(path).endswith(".parquet"):
        pq.write_table(table, str(path), row_group_size=4)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=4)
    return path


@pytest.mark.parametrize(
    ("name", "string_type"),
    [("bad.parquet", pa.string()), ("bad.arrow", pa.string()), ("big.arrow", pa.large_string())],
)
def test_invalid_utf8_row_is_one_data_error_or_a_counted_skip(tmp_path, name, string_type):
    path = write_bad_utf8(tmp_path / name, string_type=string_type)
    it = state_for([path]).build()
    assert [next(it).sample_id for _ in range(5)] == [f"u-{i}" for i in range(5)]
    with pytest.raises(DataError) as err:
        next(it)
    line = err.value.one_line()
    assert line == (
        f"data error: {path}: row 5: column 'text': invalid UTF-8 at byte 3; "
        "fix the file or set data.skip_bad_records=true"
    )
    state = state_for([path], skip_bad_records=True)
    straight = ids(state)
    assert straight == [f"u-{i}" for i in range(10) if i != 5]
    it = state.build()
    for position in range(len(straight)):  # exact resume on both sides of the skipped row
        resumed = load_json(it.get_state().model_dump_json())
        assert ids(resumed) == straight[position:], position
        next(it)
    assert it.get_state().n_skipped == 1


def test_invalid_utf8_sample_id_names_its_column(tmp_path):
    ids_ = pa.array([b"a", b"\xff"], pa.binary()).view(pa.string())
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"text": ["one", "two"], "url": ids_}), str(path))
    with pytest.raises(
        DataError, match=r"ids\.parquet: row 1: column 'url': invalid UTF-8 at byte 0"
    ):
        ids(state_for([path]))


def write_with_garbage(path, n_frames: int = 6, lines_per_frame: int = 3):
    """Six good frames (zstd frames / gzip members), then bytes that are not compressed data."""
    write_compressed(path, records("g", range(n_frames * lines_per_frame)), lines_per_frame)
    good = path.read_bytes()
    path.write_bytes(good + b"this is not compressed data\n" * 8)
    return len(good)


@pytest.mark.parametrize("suffix", ["zst", "gz"])
def test_garbage_after_good_frames_reads_them_then_one_data_error(tmp_path, suffix):
    path = tmp_path / f"g.jsonl.{suffix}"
    good_bytes = write_with_garbage(path)
    expected = [f"g-{i}" for i in range(18)]
    it = state_for([path]).build()
    assert [next(it).sample_id for _ in range(18)] == expected  # the good lines are trained on
    with pytest.raises(DataError) as err:
        next(it)
    line = err.value.one_line()
    assert line.startswith(f"data error: {path}: row 18: corrupt compressed data ")
    assert f"in the frame at byte {good_bytes} " in line and "last good line is line 18;" in line
    # a resume after some good lines reads the rest of them, then the same error
    it = state_for([path]).build()
    for _ in range(7):
        next(it)
    resumed = load_json(it.get_state().model_dump_json()).build()
    assert [next(resumed).sample_id for _ in range(11)] == expected[7:]
    with pytest.raises(
        DataError, match=f"row 18: corrupt compressed data in the frame at byte {good_bytes}"
    ):
        next(resumed)
    # skip_bad_records: the good lines, then the rest of the file is one counted skip
    skipped = state_for([path], skip_bad_records=True).build()
    assert [d.sample_id for d in skipped] == expected
    assert skipped.get_state().n_skipped == 1


def test_data_check_names_the_bad_utf8_row_and_the_garbage(tmp_path, capsys):
    bad = write_bad_utf8(tmp_path / "bad.parquet")
    garbage = tmp_path / "g.jsonl.zst"
    write_with_garbage(garbage)
    argv = [
        "config=configs/debug.yaml",
        "data.sources={}",
        f"data.dataset_files={json.dumps([str(bad), str(garbage)])}",
    ]
    assert check_main(argv) == 1
    out = capsys.readouterr().out
    rows = {w: next(x for x in out.splitlines() if w in x) for w in ("bad.parquet", "g.jsonl")}
    assert rows["bad.parquet"].endswith("  row 5: column 'text': invalid UTF-8 at byte 3")
    assert rows["bad.parquet"].split()[3:5] == ["10", "1"]  # all rows read, one bad
    assert rows["g.jsonl"].split()[3:5] == ["18", "1"]  # the good lines are read
    assert "corrupt compressed data in the frame at byte" in rows["g.jsonl"]
    assert "Traceback" not in out
