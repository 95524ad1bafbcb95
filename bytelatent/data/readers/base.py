"""The reader protocol, its position model, and the registry that maps file suffixes to formats.

A *format* (`DataFormat`) is a name stored in every shard of a data state (`json`, `zst`, ...),
the file suffixes it claims, the pydantic model of its exact position in a file (`Position`), and
`open(shard, position, options) -> Reader`. A `Reader` yields one shard's documents from that
position and says where it is (`position()`); the file iterator (`iterators/file.py`) walks the
shards, interleaves them and saves each open reader's position, without knowing any format.

Errors a reader raises:
    BadRecord  one row is unusable (malformed, invalid UTF-8, no text); the reader has already
               moved past it, so the iterator either raises one DataError or counts a skip and
               reads on;
    BadFile    the file, or its rest, cannot be read (no footer, a corrupt compressed frame); the
               iterator raises one DataError or skips the file's rest as one counted record;
    DataError  a configuration problem that skipping cannot fix (no text column, file missing).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from bytelatent.data.chat import BadConversation, Turn, conversation_of
from bytelatent.errors import DataError

SAMPLE_ID_KEYS = ("sample_id", "title", "qid", "paper_id", "path", "url", "id")
TEXT_KEYS = ("text", "content")
DEFAULT_FORMAT = "json"  # a path with no registered suffix is read as JSONL
LEGACY_CURSOR = "legacy_cursor"  # key of a position saved by the one-cursor-for-all-formats state
# What one record may cost: a longer JSONL line (or table text) is a bad record, passed without
# being held whole. The longest real documents (books, code files) are a few MB, and 20x that
# with per-byte entropies stored in the line; tokens take 2 bytes per byte after reading.
DEFAULT_MAX_DOCUMENT_BYTES = 64 << 20


@dataclass
class Document:
    sample_id: str
    text: str
    entropies: np.ndarray | None
    path: str
    row: int
    turns: list[Turn] | None = None  # a chat record (data.chat): its turns; text is unused


class BadRecord(Exception):
    """Row `row` cannot be used; the reader has moved past it."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(reason)
        self.row, self.reason = row, reason


class BadFile(Exception):
    """The file (or its rest) cannot be read; becomes a DataError or a counted skip."""


class Position(BaseModel):
    """Exact position of a reader in one file: `row` is the next row to consider (every format
    counts rows: errors name them and a shard's row slice applies to them). A format adds the
    fields that let it seek there (byte offset, row group, frame, ...)."""

    model_config = ConfigDict(extra="forbid")

    row: int = 0

    @model_validator(mode="after")
    def _non_negative(self) -> Position:
        """Every field is a row, byte or frame count: a negative one is a damaged state."""
        for name, value in self:
            if isinstance(value, int) and value < 0:
                raise ValueError(f"{name}={value} is negative")
        return self

    @classmethod
    def load(cls, saved: dict[str, Any]):
        """The position saved as `saved` ({} = the start of the file)."""
        if LEGACY_CURSOR in saved:
            return cls.from_legacy(saved[LEGACY_CURSOR])
        return cls.model_validate(saved)

    @classmethod
    def from_legacy(cls, cursor: dict[str, int]):
        """From the fields of the old shared cursor (row, byte_offset, frame_offset, frame_start,
        batch_index, batch_start_row): by default the ones this model has, by name."""
        return cls.model_validate({k: v for k, v in cursor.items() if k in cls.model_fields})


@dataclass(frozen=True)
class ReadOptions:
    """What every reader of a stream is told besides its shard and position."""

    text_keys: tuple[str, ...] = TEXT_KEYS
    storage_options: dict[str, Any] | None = None
    arrow_batch_size: int = 20  # table formats: rows converted to Python at a time
    chat: bool = False  # records are conversations (data/chat.py), read whole
    max_document_bytes: int | None = None  # a longer record is a BadRecord (None: no limit)


class Shard(Protocol):
    """A file and the rows of it that this stream reads: rows r with r % stride == offset."""

    path: str
    stride: int
    offset: int


class Reader(Protocol):
    """One open file, read from a position."""

    def read(self) -> Document | None:
        """The next document of the shard's rows; None at the end of the file. Raises BadRecord
        (one row, already passed), BadFile (the rest of the file) or DataError."""

    def position(self) -> dict[str, Any]:
        """Where the next `read()` starts, as the fields of the format's Position (saved in the
        state; `open` gets `Position.load` of it at a resume). A dict, not the model: the state
        is taken before every document, and a pydantic model costs microseconds to build."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class DataFormat:
    """A registered format.

    name          stored in each shard of a state (keep it stable: states name it)
    suffixes      file-name endings it claims (`.jsonl.zst`); a path is matched on its longest
                  registered suffix, then on its last extension (`x.zst`)
    position      its Position model
    open          (shard, position, options) -> Reader, positioned at `position`
    listing_rank  a source folder resolves to the files of the lowest rank present; formats with
                  the same rank are listed together (zst and gz)
    variant_of    `data.file_format=<variant_of>` keeps this format (compression follows the
                  extension when JSONL is forced)
    preflight     local path -> a reason the file cannot be read, or None; cheap (run on every
                  shard when a stream is built)
    inspect       (path, options) -> problems that reading does not find (`data.check` only)
    """

    name: str
    suffixes: tuple[str, ...]
    position: type[Position]
    open: Callable[[Shard, Position, ReadOptions], Reader]
    listing_rank: int = 50
    variant_of: str | None = None
    preflight: Callable[[str], str | None] | None = None
    inspect: Callable[[str, ReadOptions], Iterator[str]] | None = None
    _lower: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lower", tuple(s.lower() for s in self.suffixes))


_FORMATS: dict[str, DataFormat] = {}


def register_format(fmt: DataFormat, *, replace: bool = False) -> DataFormat:
    """Add `fmt` to the registry (a second format of the same name needs replace=True)."""
    if fmt.name in ("auto", "jsonl"):
        raise ValueError(f"format name {fmt.name!r} is reserved for data.file_format")
    if fmt.name in _FORMATS and not replace:
        raise ValueError(f"data format {fmt.name!r} is already registered")
    for other in _FORMATS.values():
        taken = set(fmt._lower) & set(other._lower)
        if taken and other.name != fmt.name:
            raise ValueError(f"suffix {sorted(taken)[0]} already belongs to format {other.name!r}")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    _FORMATS.pop(name, None)


def formats() -> list[DataFormat]:
    """Every registered format, in listing order."""
    return sorted(_FORMATS.values(), key=lambda f: (f.listing_rank, f.name))


def get_format(name: str) -> DataFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(_FORMATS))
        raise DataError(
            f"unknown data format {name!r} (registered: {known}); import the module that "
            "registers it before building the data"
        ) from None


def format_of(path: str) -> str:
    """Name of the format that reads `path`: longest registered suffix, else last extension,
    else JSONL."""
    lower = path.lower()
    best, length = None, 0
    for fmt in _FORMATS.values():
        for suffix in fmt._lower:
            if len(suffix) > length and lower.endswith(suffix):
                best, length = fmt.name, len(suffix)
    if best is not None:
        return best
    ext = "." + lower.rsplit(".", 1)[-1]
    for fmt in _FORMATS.values():
        if any(s.rsplit(".", 1)[-1] == ext[1:] for s in fmt._lower):
            return fmt.name
    return DEFAULT_FORMAT


def forced_format(path: str, forced: str) -> str:
    """The format of `path` when `data.file_format` is `forced` (`auto`: from the suffix)."""
    found = format_of(path)
    if forced == "auto":
        return found
    forced = DEFAULT_FORMAT if forced == "jsonl" else forced
    return found if get_format(found).variant_of == forced else forced


def open_fs(
    path: str, storage_options: dict[str, Any] | None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and in-filesystem path for a local path or URL (s3://... uses s3fs)."""
    options = dict(storage_options or {}) if "://" in path else {}
    return fsspec.core.url_to_fs(path, **options)


@contextlib.contextmanager
def open_errors(path: str):
    """A file that cannot be opened (missing, a symlink loop, no permission) as one DataError."""
    try:
        yield
    except FileNotFoundError as exc:
        raise DataError(f"{path}: file not found") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot open ({exc.strerror or exc})") from exc


def changed_file_error(path: str, detail: str) -> DataError:
    """The one-line error for a saved position that does not fit the file any more."""
    return DataError(
        f"{path}: {detail}: the file changed since the data state was saved; restore it, or start "
        "a new run with checkpoint.init_ckpt_path=<the checkpoint> to read the data from its start"
    )


def text_keys(text_field: str) -> tuple[str, ...]:
    """Record keys that hold the text: `text` (or `content`), else exactly `text_field`."""
    return TEXT_KEYS if text_field == "text" else (text_field,)


class RecordError(ValueError):
    """A record that cannot be used (the reader turns it into BadRecord with its row)."""


def record_from_json(line: bytes) -> dict:
    """A JSON object from one line; RecordError says why not."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"invalid UTF-8 at byte {exc.start}") from exc
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"malformed JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    return record


def too_long(size: int, limit: int) -> str:
    """Why a record over the document limit is a bad record, and what to do."""
    return (
        f"a record of {size} bytes, more than data.max_document_bytes={limit} (raise it to "
        "train on such records)"
    )


def document(
    record: dict,
    path: str,
    row: int,
    keys: tuple[str, ...] = TEXT_KEYS,
    max_bytes: int | None = None,
    chat: bool = False,
) -> Document:
    """The Document of a record (text from `keys`, sample id, entropies; or, with `chat`, its
    conversation); RecordError if unusable (including a text of more than `max_bytes` UTF-8
    bytes)."""
    if chat:
        return chat_document(record, path, row)
    text = next((record[k] for k in keys if k in record), None)
    if text is None:
        raise RecordError(f"no {' or '.join(repr(k) for k in keys)} field (or it is null)")
    if not isinstance(text, str):
        raise RecordError(f"'text' must be a string, got {type(text).__name__}")
    if max_bytes is not None and len(text) * 4 > max_bytes:  # else it cannot exceed it
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise RecordError(too_long(size, max_bytes))
    sample_id = next((record[k] for k in SAMPLE_ID_KEYS if record.get(k) is not None), None)
    if sample_id is None:
        sample_id = f"{os.path.basename(path)}:{row}"
    entropies = record.get("entropies")
    if entropies is not None and not isinstance(entropies, np.ndarray):
        try:
            entropies = np.asarray(entropies, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"'entropies' is not a list of numbers ({exc})") from exc
    return Document(sample_id=str(sample_id), text=text, entropies=entropies, path=path, row=row)


def chat_document(record: dict, path: str, row: int) -> Document:
    """The Document of a chat record (any shape `conversation_of` reads); RecordError if not."""
    try:
        turns = conversation_of(record)
    except BadConversation as exc:
        raise RecordError(str(exc)) from exc
    sample_id = next((record[k] for k in SAMPLE_ID_KEYS if record.get(k) is not None), None)
    if sample_id is None:
        sample_id = f"{os.path.basename(path)}:{row}"
    return Document(str(sample_id), "", None, path, row, turns=turns)
