"""Table readers: Arrow IPC (`.arrow`, `.arrows`, `.ipc`, `.feather`) and Parquet (`.parquet`,
`.pq`), read one record batch (Arrow) or row group (Parquet) at a time.

A position is the batch / row group that holds the next row and that unit's first row, so a
resume seeks straight there (an Arrow *stream* file has no random access: resuming reads and
discards the earlier batches). Parquet reads only the columns training needs (the text column,
the first sample-id column present, `entropies` when present); a missing or corrupt footer is
found when the file is opened.

An Arrow IPC *file* (it starts with the `ARROW1` magic) must end with a valid footer: one that
does not was cut short (a failed copy, a full disk), so it is rejected before training starts
(`preflight`), not days later when training reaches the damage.

A text or sample-id string that is not valid UTF-8 (Arrow does not check when it reads) is one
BadRecord for its row alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from bytelatent.data.readers.base import (
    SAMPLE_ID_KEYS,
    BadFile,
    BadRecord,
    DataFormat,
    Document,
    Position,
    ReadOptions,
    RecordError,
    Shard,
    document,
    open_errors,
    open_fs,
)
from bytelatent.errors import DataError

IPC_MAGIC = b"ARROW1"  # first 6 (and last 6) bytes of an Arrow IPC file


class ArrowPosition(Position):
    batch_index: int = 0  # the record batch that holds `row`
    batch_start_row: int = 0  # its first row


class ParquetPosition(Position):
    row_group: int = 0  # the row group that holds `row`
    group_start_row: int = 0  # its first row

    @classmethod
    def from_legacy(cls, cursor: dict[str, int]) -> ParquetPosition:
        return cls(
            row=cursor.get("row", 0),
            row_group=cursor.get("batch_index", 0),
            group_start_row=cursor.get("batch_start_row", 0),
        )


class _InvalidUtf8:
    """Stands for a string value that is not valid UTF-8."""

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
        raise RecordError(value.reason)
    return value


def text_column(names: list[str], keys: tuple[str, ...], path: str) -> str:
    """The first of `keys` among the column `names`; a DataError naming them if none is."""
    key = next((k for k in keys if k in names), None)
    if key is None:
        wanted = " or ".join(repr(k) for k in keys)
        raise DataError(f"{path}: no {wanted} column (columns: {names}); set data.text_field")
    return key


class ArrowColumns:
    """Python values of `rows` consecutive rows of a record batch, converted once per chunk."""

    def __init__(
        self, batch: pa.RecordBatch, start: int, rows: int, path: str, keys: tuple[str, ...]
    ) -> None:
        chunk = batch.slice(start, rows)
        names = chunk.schema.names
        self.start = start
        self.text_key = text_column(names, keys, path)
        self.texts = _python_values(chunk.column(self.text_key), self.text_key)
        self.end = start + len(self.texts)
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
        """The row as a record; RecordError for a text or id that is not valid UTF-8."""
        i = local_row - self.start
        record = {self.text_key: _valid(self.texts[i])}
        if self.ids is not None:
            record["sample_id"] = _valid(self.ids[i])
        if self.entropies is not None:
            record["entropies"] = self.entropies[i]
        return record


class ChatRows:
    """Whole rows (every column: a chat record's shape decides which it needs) of `rows`
    consecutive rows of a record batch, converted once per chunk."""

    def __init__(
        self, batch: pa.RecordBatch, start: int, rows: int, path: str, keys: tuple[str, ...]
    ) -> None:
        chunk = batch.slice(start, rows)
        try:
            self.rows = chunk.to_pylist()
        except UnicodeDecodeError as exc:
            self.rows = [_InvalidUtf8(f"invalid UTF-8 at byte {exc.start}")] * chunk.num_rows
        self.start, self.end = start, start + chunk.num_rows

    def record(self, local_row: int) -> dict:
        return _valid(self.rows[local_row - self.start])


class _TableReader:
    """Rows of a file read in units (record batches, row groups); subclasses give `batch(i)`."""

    def __init__(self, shard: Shard, unit: int, unit_start: int, row: int, options: ReadOptions):
        self.path, self.stride, self.offset = shard.path, shard.stride, shard.offset
        self.keys, self.chunk_rows = options.text_keys, options.arrow_batch_size
        self.chat = options.chat
        self.max_bytes = options.max_document_bytes
        self.row, self.unit, self.unit_start = row, unit, unit_start
        self._batch: pa.RecordBatch | None = None
        self._columns: ArrowColumns | None = None

    def batch(self, index: int) -> pa.RecordBatch | None:
        raise NotImplementedError

    def read(self) -> Document | None:
        while True:
            batch = self._batch
            if batch is None:
                batch = self._batch = self.batch(self.unit)
                if batch is None:
                    return None
                self._columns = None
            local = self.row - self.unit_start
            if local >= batch.num_rows:
                self.unit += 1
                self.unit_start += batch.num_rows
                self._batch = None
                continue
            row = self.row
            self.row += 1
            if row % self.stride != self.offset:
                continue
            columns = self._columns
            if columns is None or not columns.start <= local < columns.end:
                make = ChatRows if self.chat else ArrowColumns
                columns = make(batch, local, self.chunk_rows, self.path, self.keys)
                self._columns = columns
            try:
                return document(
                    columns.record(local), self.path, row, self.keys, self.max_bytes, chat=self.chat
                )
            except RecordError as exc:
                raise BadRecord(row, str(exc)) from exc


class ArrowReader(_TableReader):
    """Record batches of an Arrow IPC file (random access) or stream (sequential)."""

    def __init__(self, shard: Shard, position: ArrowPosition, options: ReadOptions) -> None:
        p = position
        super().__init__(shard, p.batch_index, p.batch_start_row, p.row, options)
        fs, fs_path = open_fs(self.path, options.storage_options)
        with open_errors(self.path):
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
                raise BadFile(
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
            raise BadFile(f"not an Arrow IPC file or stream ({exc})") from exc

    @property
    def schema(self) -> pa.Schema:
        return (self.file_reader or self.stream_reader).schema

    def batch(self, index: int) -> pa.RecordBatch | None:
        """Record batch `index`, or None past the end. Raises BadFile on corrupt data."""
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
            raise BadFile(f"record batch {index}: truncated or corrupt Arrow data ({exc})") from exc

    def position(self) -> dict[str, int]:
        return {"row": self.row, "batch_index": self.unit, "batch_start_row": self.unit_start}

    def close(self) -> None:
        self.file.close()


class ParquetReader(_TableReader):
    """Row groups of a Parquet file, reading only the columns that training uses."""

    def __init__(self, shard: Shard, position: ParquetPosition, options: ReadOptions) -> None:
        import pyarrow.parquet as pq  # noqa: PLC0415 - only Parquet runs need it

        p = position
        super().__init__(shard, p.row_group, p.group_start_row, p.row, options)
        fs, fs_path = open_fs(self.path, options.storage_options)
        with open_errors(self.path):
            # A local file through Arrow's own I/O: buffers read from a Python file object are
            # Python-owned, and Arrow may free them on one of its threads, which cannot take the
            # GIL while the interpreter exits (abort: "terminate called without an active
            # exception", issue 38).
            if isinstance(fs, LocalFileSystem):
                self.file = pa.memory_map(fs_path, "r")
            else:
                self.file = fs.open(fs_path, "rb")
        try:
            self.parquet = pq.ParquetFile(self.file)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            self.file.close()
            raise BadFile(f"not a Parquet file or its footer is missing/corrupt ({exc})") from exc
        names = self.parquet.schema_arrow.names
        if options.chat:  # a chat record's shape decides which columns it needs: read them all
            self.columns = list(names)
            return
        try:
            self.columns = [text_column(names, self.keys, self.path)]
        except DataError:
            self.file.close()
            raise
        sample_id = next((k for k in SAMPLE_ID_KEYS if k in names), None)
        self.columns += [sample_id] if sample_id else []
        self.columns += ["entropies"] if "entropies" in names else []

    @property
    def schema(self) -> pa.Schema:
        """The schema of the columns read."""
        full = self.parquet.schema_arrow
        return pa.schema([full.field(name) for name in self.columns])

    @property
    def num_row_groups(self) -> int:
        return self.parquet.num_row_groups

    def batch(self, index: int) -> pa.RecordBatch | None:
        """Row group `index` as one record batch, or None past the end."""
        if index >= self.parquet.num_row_groups:
            return None
        try:
            # use_threads=False: the column readers live and die on this thread (see __init__);
            # one to three columns of one row group gain nothing from Arrow's pool
            table = self.parquet.read_row_group(index, columns=self.columns, use_threads=False)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, EOFError) as exc:
            raise BadFile(f"row group {index}: truncated or corrupt Parquet data ({exc})") from exc
        batches = table.combine_chunks().to_batches()
        if not batches:
            return pa.RecordBatch.from_pylist([], schema=table.schema)
        return batches[0]

    def position(self) -> dict[str, int]:
        return {"row": self.row, "row_group": self.unit, "group_start_row": self.unit_start}

    def close(self) -> None:
        # release the Parquet reader's buffers now, on this thread, not at interpreter exit
        self._batch = self._columns = None
        self.parquet.close()
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


class _WholeFile:
    path: str
    stride = 1
    offset = 0

    def __init__(self, path: str) -> None:
        self.path = path


def inspect_table(reader_cls, position_cls):
    """`data.check`'s deeper look at a table file: the text column is a string, and every batch
    is valid data (bad offsets, invalid UTF-8 in a column that reading does not convert)."""

    def inspect(path: str, options: ReadOptions) -> Iterator[str]:
        try:
            reader = reader_cls(_WholeFile(path), position_cls(), options)
        except (BadFile, DataError):
            return  # reading reports it
        try:
            schema = reader.schema
            key = next((k for k in options.text_keys if k in schema.names), None)
            if key is None:
                return
            kind = schema.field(key).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                yield f"column '{key}' is {kind}, not string"
                return
            id_key = next((k for k in SAMPLE_ID_KEYS if k in schema.names), None)
            read = [key] + ([id_key] if id_key else [])
            index, row = 0, 0
            while (batch := reader.batch(index)) is not None:
                problem = _invalid_data(batch, read)
                if problem:
                    yield f"record batch {index} (rows {row}-): invalid data ({problem})"
                row += batch.num_rows
                index += 1
        except BadFile:
            return  # reading reports it
        finally:
            reader.close()

    return inspect


def _invalid_data(batch: pa.RecordBatch, read: list[str]) -> str | None:
    """Why `batch` is not valid Arrow data, unless its only fault is invalid UTF-8 in the columns
    that reading converts (reading reports those rows one by one)."""
    try:
        batch.validate(full=True)
        return None
    except pa.ArrowInvalid as exc:
        problem = str(exc)
    as_bytes = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    names = batch.schema.names
    try:
        columns = [
            c.view(as_bytes[c.type]) if c.type in as_bytes and n in read else c
            for n, c in zip(names, batch.columns)
        ]
        pa.RecordBatch.from_arrays(columns, names=names).validate(full=True)
    except pa.ArrowException:
        return problem
    return None


ARROW = DataFormat(
    "arrow",
    (".arrow", ".arrows", ".ipc", ".feather"),
    ArrowPosition,
    ArrowReader,
    listing_rank=0,
    preflight=arrow_footer_problem,
    inspect=inspect_table(ArrowReader, ArrowPosition),
)
PARQUET = DataFormat(
    "parquet",
    (".parquet", ".pq"),
    ParquetPosition,
    ParquetReader,
    listing_rank=10,
    inspect=inspect_table(ParquetReader, ParquetPosition),
)
