"""Document readers for JSONL and Arrow IPC files on any fsspec filesystem (local, s3://, ...).

Records
    text comes from `text` (else `content`); sample_id from the first present of sample_id,
    title, qid, paper_id, path, url, id (else "<file name>:<row>"); `entropies` (a list of floats,
    one per token including BOS and EOS, as written by entropy preprocessing) when present.

Sharding across data-parallel ranks (`assign_shards`), for one source's sorted file list of n
files and a world of W ranks:
    * n >= W: rank r reads the whole files f with f % W == r;
    * n <  W: rank r reads file f = r % n; the k ranks that share file f (r = f, f + n, ...) split
      its rows by row index: the j-th of them (j = r // n) reads rows with row % k == j.
Every row is read by exactly one rank, for every world size; no row is dropped.

Position
    The state names the current file and the exact next row: a byte offset for JSONL and a
    (record batch, first row of that batch) pair for Arrow IPC files, so resuming seeks straight
    there without replaying the file. Arrow *stream* files have no random access: resuming reads
    and discards the earlier record batches.

An Arrow IPC *file* (it starts with the `ARROW1` magic) must end with a valid footer: one that
does not was cut short (a failed copy, a full disk), so it is rejected when it is opened, not
days later when training reaches the damage.

Bad records (malformed JSON, invalid UTF-8, missing/null text, unreadable Arrow data) raise
DataError naming the file and row, or are skipped and counted when `skip_bad_records` is true.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import numpy as np
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field

from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.errors import DataError

logger = logging.getLogger(__name__)

SAMPLE_ID_KEYS = ("sample_id", "title", "qid", "paper_id", "path", "url", "id")
TEXT_KEYS = ("text", "content")
FileFormat = Literal["json", "arrow"]
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


def file_format_of(path: str) -> FileFormat:
    """`arrow` for *.arrow / *.arrows / *.ipc / *.feather, else `json`."""
    return (
        "arrow"
        if path.rsplit(".", 1)[-1].lower() in ("arrow", "arrows", "ipc", "feather")
        else "json"
    )


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


def _document(record: dict, path: str, row: int) -> Document:
    text = next((record[k] for k in TEXT_KEYS if k in record), None)
    if text is None:
        raise _BadRecord("no 'text' or 'content' field (or it is null)")
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
        try:
            self.file = fs.open(fs_path, "rb")
        except FileNotFoundError as exc:
            raise DataError(f"{path}: file not found") from exc
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


class _ArrowReader:
    """Record batches of an Arrow IPC file (random access) or stream (sequential)."""

    def __init__(self, path: str, storage_options: dict | None) -> None:
        self.path = path
        fs, fs_path = open_fs(path, storage_options)
        try:
            if isinstance(fs, LocalFileSystem):
                self.file = pa.memory_map(fs_path, "r")
            else:
                self.file = fs.open(fs_path, "rb")
        except FileNotFoundError as exc:
            raise DataError(f"{path}: file not found") from exc
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


class _ArrowColumns:
    """Python values of `rows` consecutive rows of a record batch, converted once per chunk."""

    def __init__(self, batch: pa.RecordBatch, start: int, rows: int, path: str) -> None:
        chunk = batch.slice(start, rows)
        names = chunk.schema.names
        text_key = next((k for k in TEXT_KEYS if k in names), None)
        if text_key is None:
            raise DataError(f"{path}: no 'text' or 'content' column (columns: {names})")
        self.start = start
        self.texts = chunk.column(text_key).to_pylist()
        id_key = next((k for k in SAMPLE_ID_KEYS if k in names), None)
        self.ids = chunk.column(id_key).to_pylist() if id_key else None
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
        i = local_row - self.start
        record = {"text": self.texts[i]}
        if self.ids is not None:
            record["sample_id"] = self.ids[i]
        if self.entropies is not None:
            record["entropies"] = self.entropies[i]
        return record


class FileIteratorState(IteratorState):
    """Position in this rank's list of file shards (exact row; see the module docstring)."""

    type: Literal["file"] = "file"
    shards: list[FileShard]
    shard_index: int = 0
    row: int = 0  # next row of the current file to consider (counts every row of the file)
    byte_offset: int = 0  # json: byte offset of `row`
    batch_index: int = 0  # arrow: the record batch that holds `row`
    batch_start_row: int = 0  # arrow: the first row of that record batch
    storage_options: dict[str, Any] | None = None
    arrow_batch_size: int = Field(20, ge=1, description="Arrow rows converted to Python at a time")
    skip_bad_records: bool = False
    n_skipped: int = 0

    def build(self) -> FileIterator:
        return FileIterator(self)

    def rewound(self) -> FileIteratorState:
        """The same shards from their first row (the start of an epoch)."""
        return self.model_copy(
            update={
                "shard_index": 0,
                "row": 0,
                "byte_offset": 0,
                "batch_index": 0,
                "batch_start_row": 0,
            }
        )


class FileIterator(StatefulIterator[Document]):
    """Yields this rank's documents once, file after file."""

    def __init__(self, state: FileIteratorState) -> None:
        self.state = state.model_copy()
        if not state.skip_bad_records:
            self._check_arrow_footers()
        self._json: _JsonReader | None = None
        self._arrow: _ArrowReader | None = None
        self._batch: pa.RecordBatch | None = None
        self._columns: _ArrowColumns | None = None

    def get_state(self) -> FileIteratorState:
        return self.state.model_copy()

    def _check_arrow_footers(self) -> None:
        """Fail now, not when the loop reaches it, on a local Arrow file that lost its footer."""
        for shard in self.state.shards[self.state.shard_index :]:
            if shard.format == "arrow" and "://" not in shard.path:
                problem = arrow_footer_problem(shard.path)
                if problem:
                    raise DataError(
                        f"{shard.path}: {problem}; re-copy or regenerate it, or set "
                        "data.skip_bad_records=true to skip it"
                    )

    def __next__(self) -> Document:
        s = self.state
        while s.shard_index < len(s.shards):
            shard = s.shards[s.shard_index]
            try:
                doc = self._next_json(shard) if shard.format == "json" else self._next_arrow(shard)
            except _BadRecord as exc:  # the rest of this file is unreadable
                self._bad(shard.path, s.row, str(exc))
                doc = None
            if doc is not None:
                return doc
            self.close()
            s.shard_index += 1
            s.row = s.byte_offset = s.batch_index = s.batch_start_row = 0
        raise StopIteration

    def _bad(self, path: str, row: int, reason: str) -> None:
        if not self.state.skip_bad_records:
            raise DataError(
                f"{path}: row {row}: {reason}; fix the file or set data.skip_bad_records=true"
            )
        self.state.n_skipped += 1
        logger.warning("skipping bad record %s row %d: %s", path, row, reason)

    def _next_json(self, shard: FileShard) -> Document | None:
        s = self.state
        if self._json is None:
            self._json = _JsonReader(shard.path, s.storage_options, s.byte_offset)
        while True:
            line = self._json.readline()
            if not line:
                return None
            row = s.row
            s.row += 1
            s.byte_offset += len(line)
            if row % shard.stride != shard.offset or not line.strip():
                continue
            try:
                return _document(_record_from_json(line), shard.path, row)
            except _BadRecord as exc:
                self._bad(shard.path, row, str(exc))

    def _next_arrow(self, shard: FileShard) -> Document | None:
        s = self.state
        if self._arrow is None:
            self._arrow = _ArrowReader(shard.path, s.storage_options)
        while True:
            if self._batch is None:
                self._batch = self._arrow.batch(s.batch_index)
                self._columns = None
                if self._batch is None:
                    return None
            local = s.row - s.batch_start_row
            if local >= self._batch.num_rows:
                s.batch_index += 1
                s.batch_start_row += self._batch.num_rows
                self._batch = None
                continue
            row = s.row
            s.row += 1
            if row % shard.stride != shard.offset:
                continue
            columns = self._columns
            if columns is None or not columns.start <= local < columns.start + len(columns.texts):
                columns = self._columns = _ArrowColumns(
                    self._batch, local, s.arrow_batch_size, shard.path
                )
            try:
                return _document(columns.record(local), shard.path, row)
            except _BadRecord as exc:
                self._bad(shard.path, row, str(exc))

    def close(self) -> None:
        for reader in (self._json, self._arrow):
            if reader is not None:
                reader.close()
        self._json = self._arrow = self._batch = self._columns = None


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
            self.files = state.rewound().build()
            doc = next(self.files)
        self.yielded_in_epoch += 1
        return doc

    def close(self) -> None:
        self.files.close()
