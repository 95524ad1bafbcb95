"""Document readers for JSONL (plain, `.zst`, `.gz`), Arrow IPC and Parquet files on any fsspec
filesystem (local, s3://, ...). The compressed and Parquet readers are in `formats.py`.

Records
    text comes from `data.text_field` (default `text`, which also accepts `content`); sample_id from the first present of sample_id,
    title, qid, paper_id, path, url, id (else "<file name>:<row>"); `entropies` (a list of floats,
    one per token including BOS and EOS, as written by entropy preprocessing) when present.

Sharding across data-parallel ranks (`assign_shards`), for one source's sorted file list of n
files and a world of W ranks:
    * n >= W: rank r reads the whole files f with f % W == r;
    * n <  W: rank r reads file f = r % n; the k ranks that share file f (r = f, f + n, ...) split
      its rows by row index: the j-th of them (j = r // n) reads rows with row % k == j.
Every row is read by exactly one rank, for every world size; no row is dropped.

Position
    The state names the current file and the exact next row: a byte offset for JSONL (for
    compressed JSONL an uncompressed offset plus the last frame boundary before it) and a
    (record batch or Parquet row group, first row of it) pair for Arrow IPC and Parquet files, so
    resuming seeks straight there without replaying the file. Arrow *stream* files have no random access: resuming reads
    and discards the earlier record batches.

An Arrow IPC *file* (it starts with the `ARROW1` magic) must end with a valid footer: one that
does not was cut short (a failed copy, a full disk), so it is rejected when it is opened, not
days later when training reaches the damage.

Bad records (malformed JSON, invalid UTF-8 in a JSONL line or in an Arrow/Parquet text or id
string, missing/null text, unreadable Arrow data) raise DataError naming the file and row, or are
skipped and counted when `skip_bad_records` is true. A file whose rest cannot be read (a corrupt
or truncated `.zst`/`.gz` stream after its good frames) is read up to the damage, then raises one
DataError, or its rest is one counted skip.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.iterators.formats import BadFile, CompressedLines, ParquetReader
from bytelatent.errors import DataError

logger = logging.getLogger(__name__)

SAMPLE_ID_KEYS = ("sample_id", "title", "qid", "paper_id", "path", "url", "id")
TEXT_KEYS = ("text", "content")
FileFormat = Literal["json", "arrow", "parquet", "zst", "gz"]
LINE_FORMATS = ("json", "zst", "gz")  # JSONL, plain or compressed
_EXTENSIONS = {"arrow": "arrow", "arrows": "arrow", "ipc": "arrow", "feather": "arrow"}
_EXTENSIONS |= {"parquet": "parquet", "pq": "parquet", "zst": "zst", "zstd": "zst", "gz": "gz"}
IPC_MAGIC = b"ARROW1"  # first 6 (and last 6) bytes of an Arrow IPC file


@dataclass
class Document:
    sample_id: str
    text: str
    entropies: np.ndarray | None
    path: str
    row: int


class _BadRecord(Exception):
    """A record that cannot be used; becomes a DataError or a counted skip."""


class FileShard(BaseModel):
    """One file and which of its rows this rank reads: rows r with r % stride == offset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    format: FileFormat
    stride: int = Field(1, ge=1)
    offset: int = Field(0, ge=0)


def pack_shards(shards: list[FileShard]) -> dict:
    """The compact JSON form of a shard list: the common path prefix once, then each file's rest;
    the format and row slice once when every shard has the same. With thousands of files this
    keeps a state (saved per rank, and sent with every prefetched batch) several times smaller."""
    paths = [s.path for s in shards]
    prefix = os.path.commonprefix(paths) if len(paths) > 1 else ""
    packed: dict[str, Any] = {"prefix": prefix, "names": [p[len(prefix) :] for p in paths]}
    for key in ("format", "stride", "offset"):
        values = [getattr(s, key) for s in shards]
        packed[key] = values[0] if values and values.count(values[0]) == len(values) else values
    return packed


def unpack_shards(packed: dict) -> list[dict]:
    """The shard list of `pack_shards`' output."""
    names = packed["names"]
    columns = {
        key: v if isinstance(v, list) else [v] * len(names)
        for key, v in ((k, packed[k]) for k in ("format", "stride", "offset"))
    }
    return [
        {"path": packed["prefix"] + name, **{k: columns[k][i] for k in columns}}
        for i, name in enumerate(names)
    ]


def file_format_of(path: str) -> FileFormat:
    """`arrow` for *.arrow / *.arrows / *.ipc / *.feather, `parquet` for *.parquet / *.pq,
    `zst` / `gz` for zstd / gzip-compressed JSONL (*.jsonl.zst, *.jsonl.gz), else `json`."""
    return _EXTENSIONS.get(path.rsplit(".", 1)[-1].lower(), "json")


def text_keys(text_field: str) -> tuple[str, ...]:
    """Record keys that hold the text: `text` (or `content`), else exactly `text_field`."""
    return TEXT_KEYS if text_field == "text" else (text_field,)


def assign_shards(
    paths: list[str], rank: int, world: int, formats: list[FileFormat] | None = None
) -> list[FileShard]:
    """The part of `paths` that `rank` of `world` reads (rule in the module docstring)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    formats = formats or [file_format_of(p) for p in paths]
    n = len(paths)
    if n == 0:
        return []
    if n >= world:
        return [FileShard(path=paths[f], format=formats[f]) for f in range(rank, n, world)]
    f = rank % n
    sharers = len(range(f, world, n))
    return [FileShard(path=paths[f], format=formats[f], stride=sharers, offset=rank // n)]


def open_fs(
    path: str, storage_options: dict[str, Any] | None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and in-filesystem path for a local path or URL (s3://... uses s3fs)."""
    options = dict(storage_options or {}) if "://" in path else {}
    return fsspec.core.url_to_fs(path, **options)


def _record_from_json(line: bytes) -> dict:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadRecord(f"invalid UTF-8 at byte {exc.start}") from exc
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadRecord(f"malformed JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict):
        raise _BadRecord(f"expected a JSON object, got {type(record).__name__}")
    return record


def _document(record: dict, path: str, row: int, keys: tuple[str, ...] = TEXT_KEYS) -> Document:
    text = next((record[k] for k in keys if k in record), None)
    if text is None:
        raise _BadRecord(f"no {' or '.join(repr(k) for k in keys)} field (or it is null)")
    if not isinstance(text, str):
        raise _BadRecord(f"'text' must be a string, got {type(text).__name__}")
    sample_id = next((record[k] for k in SAMPLE_ID_KEYS if record.get(k) is not None), None)
    if sample_id is None:
        sample_id = f"{os.path.basename(path)}:{row}"
    entropies = record.get("entropies")
    if entropies is not None and not isinstance(entropies, np.ndarray):
        entropies = np.asarray(entropies, dtype=np.float32)
    return Document(sample_id=str(sample_id), text=text, entropies=entropies, path=path, row=row)


class _JsonReader:
    """Lines of a JSONL file from a byte offset."""

    def __init__(self, path: str, storage_options: dict | None, byte_offset: int) -> None:
        fs, fs_path = open_fs(path, storage_options)
        with open_errors(path):
            self.file = fs.open(fs_path, "rb")
        if byte_offset:
            self.file.seek(byte_offset)

    def readline(self) -> bytes:
        return self.file.readline()

    def close(self) -> None:
        self.file.close()


def arrow_footer_problem(path: str) -> str | None:
    """For a local file: why it is a truncated Arrow IPC file (IPC magic at the start, not at the
    end), else None. Two 6-byte reads, so every shard can be checked before training starts."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(IPC_MAGIC))
            if head != IPC_MAGIC:
                return None  # a stream (no footer by design) or not Arrow at all: found at open
            f.seek(0, os.SEEK_END)
            if f.tell() < 2 * len(IPC_MAGIC) + 8:
                return "truncated Arrow IPC file: shorter than its header and footer"
            f.seek(-len(IPC_MAGIC), os.SEEK_END)
            if f.read(len(IPC_MAGIC)) != IPC_MAGIC:
                return "truncated Arrow IPC file: it starts with the IPC magic but has no footer"
    except OSError:
        return None  # missing/unreadable: reported when the file is opened
    return None


@contextlib.contextmanager
def open_errors(path: str):
    """A file that cannot be opened (missing, a symlink loop, no permission) as one DataError."""
    try:
        yield
    except FileNotFoundError as exc:
        raise DataError(f"{path}: file not found") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot open ({exc.strerror or exc})") from exc


def open_reader(shard: FileShard, state: FileIteratorState):
    """The reader of `shard`, positioned at the state's row (JSONL) or ready for `batch()`."""
    path, options = shard.path, state.storage_options
    if shard.format == "json":
        return _JsonReader(path, options, state.byte_offset)
    if shard.format == "arrow":
        return _ArrowReader(path, options)
    fs, fs_path = open_fs(path, options)
    with open_errors(path):
        try:
            if shard.format == "parquet":
                keys = text_keys(state.text_field)
                return ParquetReader(path, fs, fs_path, keys, SAMPLE_ID_KEYS)
            return CompressedLines(
                path,
                shard.format,
                fs,
                fs_path,
                state.frame_offset,
                state.frame_start,
                state.byte_offset,
            )
        except BadFile as exc:
            raise _BadRecord(str(exc)) from exc


class _ArrowReader:
    """Record batches of an Arrow IPC file (random access) or stream (sequential)."""

    def __init__(self, path: str, storage_options: dict | None) -> None:
        self.path = path
        fs, fs_path = open_fs(path, storage_options)
        with open_errors(path):
            if isinstance(fs, LocalFileSystem):
                self.file = pa.memory_map(fs_path, "r")
            else:
                self.file = fs.open(fs_path, "rb")
        self.file_reader = None
        self.stream_reader = None
        self.stream_next = 0  # index of the batch the stream reader yields next
        try:
            self.file_reader = pa.ipc.open_file(self.file)
        except (pa.ArrowInvalid, OSError) as exc:
            self.file.seek(0)
            if self.file.read(6) == IPC_MAGIC:
                self.file.close()
                raise _BadRecord(
                    f"truncated Arrow IPC file: it starts with the IPC magic but has no valid "
                    f"footer ({exc})"
                ) from exc
            self._open_stream()

    def _open_stream(self) -> None:
        self.file.seek(0)
        try:
            self.stream_reader = pa.ipc.open_stream(self.file)
        except (pa.ArrowInvalid, OSError) as exc:
            self.file.close()
            raise _BadRecord(f"not an Arrow IPC file or stream ({exc})") from exc

    @property
    def schema(self) -> pa.Schema:
        return (self.file_reader or self.stream_reader).schema

    def batch(self, index: int) -> pa.RecordBatch | None:
        """Record batch `index`, or None past the end. Raises _BadRecord on corrupt data."""
        try:
            if self.file_reader is not None:
                if index >= self.file_reader.num_record_batches:
                    return None
                return self.file_reader.get_batch(index)
            while self.stream_next <= index:
                try:
                    batch = self.stream_reader.read_next_batch()
                except StopIteration:
                    return None
                self.stream_next += 1
            return batch
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, EOFError) as exc:
            raise _BadRecord(f"truncated or corrupt Arrow data ({exc})") from exc

    def close(self) -> None:
        self.file.close()


class _InvalidUtf8:
    """Stands for a string value that is not valid UTF-8 (Arrow does not check when it reads)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _python_values(column: pa.Array, name: str) -> list:
    """`column.to_pylist()`, except that a string that is not valid UTF-8 becomes an _InvalidUtf8
    for its row alone (to_pylist raises UnicodeDecodeError for the whole column)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    values: list = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except UnicodeDecodeError as exc:
            values.append(_InvalidUtf8(f"column {name!r}: invalid UTF-8 at byte {exc.start}"))
    return values


def _valid(value: Any) -> Any:
    if isinstance(value, _InvalidUtf8):
        raise _BadRecord(value.reason)
    return value


class _ArrowColumns:
    """Python values of `rows` consecutive rows of a record batch, converted once per chunk."""

    def __init__(
        self,
        batch: pa.RecordBatch,
        start: int,
        rows: int,
        path: str,
        keys: tuple[str, ...] = TEXT_KEYS,
    ) -> None:
        chunk = batch.slice(start, rows)
        names = chunk.schema.names
        text_key = next((k for k in keys if k in names), None)
        if text_key is None:
            wanted = " or ".join(repr(k) for k in keys)
            raise DataError(f"{path}: no {wanted} column (columns: {names}); set data.text_field")
        self.start, self.text_key = start, text_key
        self.texts = _python_values(chunk.column(text_key), text_key)
        id_key = next((k for k in SAMPLE_ID_KEYS if k in names), None)
        self.ids = _python_values(chunk.column(id_key), id_key) if id_key else None
        self.entropies = (
            self._entropies(chunk.column("entropies")) if "entropies" in names else None
        )

    @staticmethod
    def _entropies(column: pa.Array) -> list[np.ndarray | None]:
        # A sliced list array's offsets index its *whole* child array: convert only our span.
        offsets = column.offsets.to_numpy()
        start, end = int(offsets[0]), int(offsets[-1])
        values = column.values.slice(start, end - start).to_numpy(zero_copy_only=False)
        values = values.astype(np.float32, copy=False)
        offsets = offsets - start
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        return [
            values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(column))
        ]

    def record(self, local_row: int) -> dict:
        """The row as a record; raises _BadRecord for a text or id that is not valid UTF-8."""
        i = local_row - self.start
        record = {self.text_key: _valid(self.texts[i])}
        if self.ids is not None:
            record["sample_id"] = _valid(self.ids[i])
        if self.entropies is not None:
            record["entropies"] = self.entropies[i]
        return record


_POSITION = ("row", "byte_offset", "frame_offset", "frame_start", "batch_index", "batch_start_row")


class Cursor(BaseModel):
    """Exact position in one open file: which shard (index into the epoch's order) and row."""

    model_config = ConfigDict(extra="forbid")

    shard_index: int = 0
    row: int = 0  # next row of the file to consider (counts every row of the file)
    byte_offset: int = 0  # jsonl: (uncompressed) byte offset of `row`
    frame_offset: int = 0  # zst/gz: compressed offset of the last frame boundary before `row`
    frame_start: int = 0  # zst/gz: uncompressed offset of that boundary
    batch_index: int = 0  # arrow/parquet: the record batch / row group that holds `row`
    batch_start_row: int = 0  # arrow/parquet: the first row of that batch / row group


def shard_order(shards: list[FileShard], seed: int | None, epoch: int) -> list[int]:
    """The order in which an epoch visits `shards`: a permutation drawn from
    numpy.default_rng((seed, epoch, crc32 of the paths without their common prefix, with each
    shard's row slice)); identity when seed is None. Moving the files (local -> s3://) keeps it."""
    if seed is None or len(shards) < 2:
        return list(range(len(shards)))
    cut = len(os.path.commonprefix([s.path for s in shards]))
    names = (f"{s.path[cut:]}#{s.offset}/{s.stride}" for s in shards)
    digest = zlib.crc32("\n".join(names).encode())
    return np.random.default_rng((seed, epoch, digest)).permutation(len(shards)).tolist()


class FileIteratorState(IteratorState):
    """Position in this rank's list of file shards (exact row; see the module docstring).

    The flat position fields are the cursor of the file read next; `others` are the other open
    files (`open_files` > 1), taken in turn after it; `opened` counts the shards of this epoch's
    order opened so far (None in states written before interleaving: shard_index + 1)."""

    type: Literal["file"] = "file"
    shards: list[FileShard]
    shard_index: int = 0
    row: int = 0
    byte_offset: int = 0
    frame_offset: int = 0
    frame_start: int = 0
    batch_index: int = 0
    batch_start_row: int = 0
    others: list[Cursor] = Field(default_factory=list)
    opened: int | None = None
    open_files: int = Field(1, ge=1, description="files read in turn, one document each")
    order_seed: int | None = Field(None, description="None: files in list order")
    epoch: int = 0
    text_field: str = "text"
    storage_options: dict[str, Any] | None = None
    arrow_batch_size: int = Field(20, ge=1, description="Arrow rows converted to Python at a time")
    skip_bad_records: bool = False
    n_skipped: int = 0

    @field_validator("shards", mode="before")
    @classmethod
    def _unpack(cls, value: Any) -> Any:
        return unpack_shards(value) if isinstance(value, dict) else value

    @field_serializer("shards")
    def _pack(self, shards: list[FileShard]) -> dict:
        return pack_shards(shards)

    def build(self) -> FileIterator:
        return FileIterator(self)

    def cursor(self) -> Cursor:
        return Cursor(shard_index=self.shard_index, **{k: getattr(self, k) for k in _POSITION})

    def rewound(self, epoch: int | None = None) -> FileIteratorState:
        """The same shards from their first row (the start of epoch `epoch`)."""
        update = {**Cursor().model_dump(), "others": [], "opened": None}
        return self.model_copy(update={**update, "epoch": self.epoch if epoch is None else epoch})


class FileIterator(StatefulIterator[Document]):
    """Yields this rank's documents once: the shards in this epoch's order, `open_files` of them
    read in turn (one document from each)."""

    def __init__(self, state: FileIteratorState) -> None:
        self.state = state.model_copy()
        order = shard_order(state.shards, state.order_seed, state.epoch)
        self.shards = [state.shards[i] for i in order]
        self.current = state.cursor()
        self.others = [c.model_copy() for c in state.others]
        self.opened = state.shard_index + 1 if state.opened is None else state.opened
        self._fill_slots()
        if not state.skip_bad_records:
            self._check_arrow_footers()
        self._readers: dict[int, Any] = {}  # shard index -> open reader
        self._batches: dict[int, tuple[pa.RecordBatch, _ArrowColumns | None]] = {}

    def _fill_slots(self) -> None:
        while len(self.others) + 1 < self.state.open_files and self.opened < len(self.shards):
            self.others.append(Cursor(shard_index=self.opened))
            self.opened += 1

    def get_state(self) -> FileIteratorState:
        c = self.current
        return self.state.model_copy(
            update={
                **c.model_dump(),
                "others": [o.model_copy() for o in self.others],
                "opened": self.opened,
            }
        )

    def _check_arrow_footers(self) -> None:
        """Fail now, not when the loop reaches it, on a local Arrow file that lost its footer."""
        for shard in self.shards[self.current.shard_index :]:
            if shard.format == "arrow" and "://" not in shard.path:
                problem = arrow_footer_problem(shard.path)
                if problem:
                    raise DataError(
                        f"{shard.path}: {problem}; re-copy or regenerate it, or set "
                        "data.skip_bad_records=true to skip it"
                    )

    def __next__(self) -> Document:
        while self.current.shard_index < len(self.shards):
            c = self.current
            shard = self.shards[c.shard_index]
            try:
                if shard.format in LINE_FORMATS:
                    doc = self._next_line(shard, c)
                else:
                    doc = self._next_batch_row(shard, c)
            except _BadRecord as exc:  # the rest of this file is unreadable
                self._bad(shard.path, c.row, str(exc))
                doc = None
            if doc is not None:
                if self.others:  # next turn: the next open file
                    self.others.append(self.current)
                    self.current = self.others.pop(0)
                return doc
            self._close_reader(c.shard_index)
            self._advance()
        raise StopIteration

    def _advance(self) -> None:
        """The current file is done: open the next one of the order, else take an open one."""
        if self.opened < len(self.shards):
            self.current = Cursor(shard_index=self.opened)
            self.opened += 1
        elif self.others:
            self.current = self.others.pop(0)
        else:
            self.current = Cursor(shard_index=len(self.shards))

    def _bad(self, path: str, row: int, reason: str) -> None:
        if not self.state.skip_bad_records:
            raise DataError(
                f"{path}: row {row}: {reason}; fix the file or set data.skip_bad_records=true"
            )
        self.state.n_skipped += 1
        logger.warning("skipping bad record %s row %d: %s", path, row, reason)

    def _reader(self, shard: FileShard, c: Cursor):
        reader = self._readers.get(c.shard_index)
        if reader is None:
            position = self.state.model_copy(update=c.model_dump())
            reader = self._readers[c.shard_index] = open_reader(shard, position)
        return reader

    def _next_line(self, shard: FileShard, c: Cursor) -> Document | None:
        reader = self._reader(shard, c)
        keys = text_keys(self.state.text_field)
        while True:
            try:
                line = reader.readline()
            except BadFile as exc:
                raise _BadRecord(f"{exc}; the last good line is line {c.row}") from exc
            if not line:
                return None
            row = c.row
            c.row += 1
            c.byte_offset += len(line)
            if isinstance(reader, CompressedLines):
                c.frame_offset, c.frame_start = reader.boundary
            if row % shard.stride != shard.offset or not line.strip():
                continue
            try:
                return _document(_record_from_json(line), shard.path, row, keys)
            except _BadRecord as exc:
                self._bad(shard.path, row, str(exc))

    def _next_batch_row(self, shard: FileShard, c: Cursor) -> Document | None:
        reader = self._reader(shard, c)
        keys = text_keys(self.state.text_field)
        while True:
            batch, columns = self._batches.get(c.shard_index, (None, None))
            if batch is None:
                try:
                    batch = reader.batch(c.batch_index)
                except BadFile as exc:
                    raise _BadRecord(str(exc)) from exc
                if batch is None:
                    return None
                self._batches[c.shard_index] = (batch, None)
            local = c.row - c.batch_start_row
            if local >= batch.num_rows:
                c.batch_index += 1
                c.batch_start_row += batch.num_rows
                del self._batches[c.shard_index]
                continue
            row = c.row
            c.row += 1
            if row % shard.stride != shard.offset:
                continue
            if columns is None or not columns.start <= local < columns.start + len(columns.texts):
                size = self.state.arrow_batch_size
                columns = _ArrowColumns(batch, local, size, shard.path, keys)
                self._batches[c.shard_index] = (batch, columns)
            try:
                return _document(columns.record(local), shard.path, row, keys)
            except _BadRecord as exc:
                self._bad(shard.path, row, str(exc))

    def _close_reader(self, shard_index: int) -> None:
        reader = self._readers.pop(shard_index, None)
        self._batches.pop(shard_index, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        for index in list(self._readers):
            self._close_reader(index)


class LoopingIteratorState(IteratorState):
    """Reads the files again and again; `epoch` counts completed passes."""

    type: Literal["looping"] = "looping"
    file_state: FileIteratorState
    epoch: int = 0
    yielded_in_epoch: int = 0

    def build(self) -> LoopingIterator:
        return LoopingIterator(self)


class LoopingIterator(StatefulIterator[Document]):
    def __init__(self, state: LoopingIteratorState) -> None:
        self.epoch = state.epoch
        self.yielded_in_epoch = state.yielded_in_epoch
        self.files = state.file_state.build()

    def get_state(self) -> LoopingIteratorState:
        return LoopingIteratorState(
            file_state=self.files.get_state(),
            epoch=self.epoch,
            yielded_in_epoch=self.yielded_in_epoch,
        )

    def __next__(self) -> Document:
        try:
            doc = next(self.files)
        except StopIteration:
            state = self.files.get_state()
            if self.yielded_in_epoch == 0:
                # Looping over nothing would spin forever; fail instead.
                paths = [shard.path for shard in state.shards]
                raise DataError(
                    f"no readable documents for this rank in {paths or 'an empty file list'}; "
                    "check the files (or use fewer data-parallel ranks than rows)"
                ) from None
            self.files.close()
            self.epoch += 1
            self.yielded_in_epoch = 0
            self.files = state.rewound(self.epoch).build()
            doc = next(self.files)
        self.yielded_in_epoch += 1
        return doc

    def close(self) -> None:
        self.files.close()
