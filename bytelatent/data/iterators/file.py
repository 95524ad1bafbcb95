"""The iterator that walks a stream's files: which files, in which order, interleaved how, and
where it is in each. How a file is read is its format's reader (`bytelatent/data/readers/`):
this module knows no format, only the reader protocol and the registry.

Sharding across data-parallel ranks (`assign_shards`), for one source's sorted file list of n
files and a world of W ranks:
    * n >= W: rank r reads the whole files f with f % W == r;
    * n <  W: rank r reads file f = r % n; the k ranks that share file f (r = f, f + n, ...) split
      its rows by row index: the j-th of them (j = r // n) reads rows with row % k == j.
Every row is read by exactly one rank, for every world size; no row is dropped.

Position
    The state names the file read next (`shard_index` into this epoch's order) and that file's
    reader position (`position`, the format's own model as JSON: a byte offset, a row group and
    row, a frame boundary, ...), and the same pair for every other open file (`others`), so a
    resume seeks straight to the next row without replaying a file. States written before the
    readers had one set of position fields shared by all formats; they load unchanged
    (`_legacy_cursor`) and continue at the same row. Each cursor also holds its file's
    fingerprint (`data/fingerprint.py`), taken when the file enters the iterator: a resume opens
    a file only if it is unchanged (one DataError naming it otherwise); None (older states):
    nothing to compare.

Bad records (a reader's BadRecord) raise one DataError naming the file and row, or are skipped
and counted when `skip_bad_records` is true. A file whose rest cannot be read (BadFile: no
footer, a corrupt compressed frame after good ones) is read up to the damage, then raises one
DataError, or its rest is one counted skip.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from bytelatent.data.fingerprint import changed_file_error, describe_change, file_fingerprint
from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.readers import (
    BadFile,
    BadRecord,
    Document,
    Reader,
    ReadOptions,
    format_of,
    get_format,
    text_keys,
)
from bytelatent.data.readers.base import DEFAULT_MAX_DOCUMENT_BYTES, LEGACY_CURSOR
from bytelatent.errors import DataError

logger = logging.getLogger(__name__)

__all__ = ["Document", "FileIterator", "FileIteratorState", "FileShard", "LoopingIterator"]

# the position fields of the state written before readers had their own (one set for all formats)
_LEGACY_POSITION = (
    "row",
    "byte_offset",
    "frame_offset",
    "frame_start",
    "batch_index",
    "batch_start_row",
)


class FileShard(BaseModel):
    """One file, its format (a registered name) and which of its rows this stream reads: rows r
    with r % stride == offset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    format: str
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


def assign_shards(
    paths: list[str], rank: int, world: int, formats: list[str] | None = None
) -> list[FileShard]:
    """The part of `paths` that `rank` of `world` reads (rule in the module docstring)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    formats = formats or [format_of(p) for p in paths]
    n = len(paths)
    if n == 0:
        return []
    if n >= world:
        return [FileShard(path=paths[f], format=formats[f]) for f in range(rank, n, world)]
    f = rank % n
    sharers = len(range(f, world, n))
    return [FileShard(path=paths[f], format=formats[f], stride=sharers, offset=rank // n)]


class Cursor(BaseModel):
    """One open file: its index in the epoch's order and its reader's position ({}: its start)."""

    model_config = ConfigDict(extra="forbid")

    shard_index: int = 0
    position: dict[str, Any] = Field(default_factory=dict)
    fingerprint: str | None = None  # the file's when it was opened (None: not opened, or older)


def _legacy_cursor(fields: dict) -> dict:
    """A cursor of the old state (flat position fields shared by all formats) in the new form:
    the fields move under `position`, and the shard's format picks its own when it opens."""
    old = {k: fields.pop(k) for k in _LEGACY_POSITION if k in fields}
    if old:
        fields["position"] = {LEGACY_CURSOR: old}
    return fields


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
    """Position in this stream's list of file shards (exact row; see the module docstring).

    `shard_index` and `position` are the cursor of the file read next; `others` are the other
    open files (`open_files` > 1), taken in turn after it; `opened` counts the shards of this
    epoch's order opened so far (None in states written before interleaving: shard_index + 1)."""

    type: Literal["file"] = "file"
    shards: list[FileShard]
    shard_index: int = 0
    position: dict[str, Any] = Field(
        default_factory=dict, description="the reader's position in the current file"
    )
    fingerprint: str | None = Field(
        None, description="size and head CRC of the current file when opened (data/fingerprint.py)"
    )
    others: list[Cursor] = Field(default_factory=list)
    opened: int | None = None
    open_files: int = Field(1, ge=1, description="files read in turn, one document each")
    order_seed: int | None = Field(None, description="None: files in list order")
    epoch: int = 0
    text_field: str = "text"
    chat: bool = False  # records are conversations (data.chat_template)
    storage_options: dict[str, Any] | None = None
    arrow_batch_size: int = Field(20, ge=1, description="Arrow rows converted to Python at a time")
    skip_bad_records: bool = False
    max_document_bytes: int | None = Field(
        DEFAULT_MAX_DOCUMENT_BYTES, ge=1, description="a longer record is a bad record"
    )
    n_skipped: int = 0

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in data for k in _LEGACY_POSITION):
            return data
        data = _legacy_cursor(dict(data))
        others = data.get("others") or []
        data["others"] = [_legacy_cursor(dict(o)) if isinstance(o, dict) else o for o in others]
        return data

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
        return Cursor(
            shard_index=self.shard_index, position=dict(self.position), fingerprint=self.fingerprint
        )

    def rewound(self, epoch: int | None = None) -> FileIteratorState:
        """The same shards from their first row (the start of epoch `epoch`)."""
        update = {
            "shard_index": 0,
            "position": {},
            "fingerprint": None,
            "others": [],
            "opened": None,
        }
        return self.model_copy(update={**update, "epoch": self.epoch if epoch is None else epoch})


class _Slot:
    """An open file of the iterator: its cursor, and its reader once opened."""

    __slots__ = ("shard_index", "saved", "reader", "fingerprint", "verify")

    def __init__(
        self,
        shard_index: int,
        saved: dict[str, Any] | None = None,
        fingerprint: str | None = None,
        verify: bool = False,
    ) -> None:
        self.shard_index = shard_index
        self.saved = saved or {}  # position to open at (until the reader exists)
        self.reader: Reader | None = None
        self.fingerprint = fingerprint  # the file's when the slot was made (None: unknown)
        self.verify = verify  # the fingerprint comes from a saved state: compare it at the open

    def saved_position(self) -> dict[str, Any]:
        return dict(self.saved) if self.reader is None else self.reader.position()

    def cursor(self) -> Cursor:
        return Cursor(
            shard_index=self.shard_index,
            position=self.saved_position(),
            fingerprint=self.fingerprint,
        )


class FileIterator(StatefulIterator[Document]):
    """Yields this stream's documents once: the shards in this epoch's order, `open_files` of
    them read in turn (one document from each)."""

    def __init__(self, state: FileIteratorState) -> None:
        self.state = state.model_copy()
        order = shard_order(state.shards, state.order_seed, state.epoch)
        self.shards = [state.shards[i] for i in order]
        self.formats = {s.format: get_format(s.format) for s in self.shards}
        self.options = ReadOptions(
            text_keys=text_keys(state.text_field),
            storage_options=state.storage_options,
            arrow_batch_size=state.arrow_batch_size,
            chat=state.chat,
            max_document_bytes=state.max_document_bytes,
        )
        self.current = self._slot(state.shard_index, state.position, state.fingerprint)
        self.others = [self._slot(c.shard_index, c.position, c.fingerprint) for c in state.others]
        self.opened = state.shard_index + 1 if state.opened is None else state.opened
        self._fill_slots()
        if not state.skip_bad_records:
            self._preflight()

    def _slot(self, shard_index: int, saved: dict[str, Any], fingerprint: str | None) -> _Slot:
        """A saved cursor, its position checked (and an old state's cursor converted) by the
        format of its file."""
        if saved and shard_index < len(self.shards):
            shard = self.shards[shard_index]
            try:
                saved = self.formats[shard.format].position.load(saved).model_dump()
            except ValidationError as exc:
                err = exc.errors()[0]
                where = "".join(f"{p}: " for p in err["loc"])
                why = err["msg"].removeprefix("Value error, ")
                raise DataError(
                    f"{shard.path}: the saved read position {saved} is not valid ({where}{why}): "
                    "the checkpoint's data state is damaged; resume from an earlier checkpoint "
                    "(checkpoint.load_path)"
                ) from None
        if fingerprint is None:  # a fresh start, or a state of an older version: nothing to check
            return self._new_slot(shard_index, saved)
        return _Slot(shard_index, saved, fingerprint, verify=True)

    def _new_slot(self, shard_index: int, saved: dict[str, Any] | None = None) -> _Slot:
        """A slot for a file this run starts (or goes on) reading, with the file's fingerprint as
        it is now: every state taken from here on names it, including the states a sequence
        buffer replays from before the file is opened."""
        fingerprint = None
        if shard_index < len(self.shards):
            try:
                fingerprint = file_fingerprint(
                    self.shards[shard_index].path, self.options.storage_options
                )
            except DataError:
                pass  # missing or unreadable: opening it says so, where errors are expected
        return _Slot(shard_index, saved, fingerprint)

    def _fill_slots(self) -> None:
        while len(self.others) + 1 < self.state.open_files and self.opened < len(self.shards):
            self.others.append(self._new_slot(self.opened))
            self.opened += 1

    def get_state(self) -> FileIteratorState:
        return self.state.model_copy(
            update={
                "shard_index": self.current.shard_index,
                "position": self.current.saved_position(),
                "fingerprint": self.current.fingerprint,
                "others": [o.cursor() for o in self.others],
                "opened": self.opened,
            }
        )

    def _preflight(self) -> None:
        """Fail now, not when the loop reaches it, on a local file its format can tell is broken
        (an Arrow file that lost its footer)."""
        for shard in self.shards[self.current.shard_index :]:
            preflight = self.formats[shard.format].preflight
            if preflight is not None and "://" not in shard.path:
                problem = preflight(shard.path)
                if problem:
                    raise DataError(
                        f"{shard.path}: {problem}; re-copy or regenerate it, or set "
                        "data.skip_bad_records=true to skip it"
                    )

    def __next__(self) -> Document:
        while self.current.shard_index < len(self.shards):
            slot = self.current
            try:
                doc = self._read(slot)
            except BadFile as exc:  # the rest of this file is unreadable
                self._bad(self.shards[slot.shard_index].path, self._row(slot), str(exc))
                doc = None
            if doc is not None:
                if self.others:  # next turn: the next open file
                    self.others.append(slot)
                    self.current = self.others.pop(0)
                return doc
            self._close(slot)
            self._advance()
        raise StopIteration

    def _read(self, slot: _Slot) -> Document | None:
        reader = slot.reader
        if reader is None:
            shard = self.shards[slot.shard_index]
            self._check_unchanged(shard.path, slot)
            fmt = self.formats[shard.format]
            reader = slot.reader = fmt.open(shard, fmt.position.load(slot.saved), self.options)
        while True:
            try:
                return reader.read()
            except BadRecord as exc:
                self._bad(self.shards[slot.shard_index].path, exc.row, exc.reason)

    def _check_unchanged(self, path: str, slot: _Slot) -> None:
        """A state must be resumed in the files it was taken in: the position saved in a file,
        and the documents a sequence buffer replays, refer to their content. A changed file is
        not a bad record: no skipping it."""
        if not slot.verify:
            return
        now = file_fingerprint(path, self.options.storage_options)
        if slot.fingerprint != now:
            raise changed_file_error(path, describe_change(slot.fingerprint, now))
        slot.verify = False

    def _row(self, slot: _Slot) -> int:
        if slot.reader is not None:
            return slot.reader.position()["row"]
        fmt = self.formats[self.shards[slot.shard_index].format]
        return fmt.position.load(slot.saved).row

    def _advance(self) -> None:
        """The current file is done: open the next one of the order, else take an open one."""
        if self.opened < len(self.shards):
            self.current = self._new_slot(self.opened)
            self.opened += 1
        elif self.others:
            self.current = self.others.pop(0)
        else:
            self.current = _Slot(len(self.shards))  # the end: no file

    def _bad(self, path: str, row: int, reason: str) -> None:
        if not self.state.skip_bad_records:
            raise DataError(
                f"{path}: row {row}: {reason}; fix the file or set data.skip_bad_records=true"
            )
        self.state.n_skipped += 1
        logger.warning("skipping bad record %s row %d: %s", path, row, reason)

    def _close(self, slot: _Slot) -> None:
        if slot.reader is not None:
            slot.reader.close()
            slot.reader = None

    def close(self) -> None:
        for slot in [self.current, *self.others]:
            self._close(slot)


def nothing_to_read(state: FileIteratorState) -> str:
    """Why a pass over `state`'s shards found no document: the files hold none, or (only when
    the files do hold some) this stream's share of their rows is empty."""
    paths = [shard.path for shard in state.shards]
    if not paths:
        return "no data files for this data stream; check data.sources / data.dataset_files"
    shared = [s for s in state.shards if s.stride > 1]
    if shared:  # rows split between streams: do the whole files hold a document?
        whole = [s.model_copy(update={"stride": 1, "offset": 0}) for s in state.shards]
        everything = state.rewound().model_copy(update={"shards": whole, "skip_bad_records": True})
        files = everything.build()
        try:
            if next(files, None) is not None:
                s = shared[0]
                return (
                    f"{paths}: the rows this data stream reads (row % {s.stride} == {s.offset}) "
                    "hold no readable document; use fewer data-parallel ranks than the files "
                    "have rows"
                )
        finally:
            files.close()
    return f"{paths}: no readable documents (empty, or every record unusable); check the files"


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
                raise DataError(nothing_to_read(state)) from None
            self.files.close()
            self.epoch += 1
            self.yielded_in_epoch = 0
            self.files = state.rewound(self.epoch).build()
            doc = next(self.files)
        self.yielded_in_epoch += 1
        return doc

    def close(self) -> None:
        self.files.close()
