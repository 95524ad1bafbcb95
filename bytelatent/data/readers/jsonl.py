"""JSONL readers: plain (`.jsonl`) and compressed (`.jsonl.zst`, `.jsonl.gz`), one line a record.

Plain JSONL
    A position is the byte offset of the next line: a resume seeks straight there.

Compressed JSONL
    zstd and gzip streams are decompressed sequentially; a position is the uncompressed byte
    offset of the next line plus the last *frame* (zstd frame, gzip member) boundary before it,
    as a (compressed offset, uncompressed offset) pair. A resume seeks to that boundary and
    decompresses from there, so its cost is bounded by the frame size: write shards as many
    frames (`zstd --long`-free, e.g. one frame per few MB) to keep resumes cheap; a single-frame
    file is decompressed from its start (measured in bench/RESULTS_data_formats.md).
    A stream that ends inside a frame, or does not decompress, is truncated or corrupt: the lines
    decompressed before the damage are returned first (they are trained on), then BadFile names
    the compressed byte where the frame that does not decompress starts and the last good line.
"""

from __future__ import annotations

import zlib

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from bytelatent.data.readers.base import (
    BadFile,
    BadRecord,
    DataFormat,
    Document,
    Position,
    ReadOptions,
    RecordError,
    Shard,
    changed_file_error,
    document,
    open_errors,
    open_fs,
    record_from_json,
    too_long,
)
from bytelatent.data.readers.zstd_frames import warn_trailing_garbage
from bytelatent.errors import DataError

READ_CHUNK = 1 << 20  # compressed bytes read at a time
# Output bounds of one decompression call, so that a line is never held past the document limit
# plus one such step: gzip takes a maximum output length; zstd does not, so its input is fed in
# slices (a zstd block expands at most ~32768x: a 256-byte slice gives at most 8 MiB).
GZ_MAX_OUT = 4 << 20
ZSTD_SLICE = 1 << 8
FILL_STEP = 1 << 18  # decompressed bytes one fill aims for (zstd: several slices)


class LongLine(Exception):
    """A line longer than the document limit; the reader has moved past it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size  # bytes of the whole line, newline included


class JsonlPosition(Position):
    byte_offset: int = 0  # byte offset of `row`


class CompressedPosition(Position):
    byte_offset: int = 0  # uncompressed byte offset of `row`
    frame_offset: int = 0  # compressed offset of the last frame boundary before `row`
    frame_start: int = 0  # uncompressed offset of that boundary


def mid_line(path: str, position: Position) -> DataError:
    """A saved position must be the start of a line (the offset after a newline): one that is not
    says the position is wrong, not the file (a JSON error there would blame a good file)."""
    return DataError(
        f"{path}: the saved read position (row {position.row}, byte "
        f"{getattr(position, 'byte_offset', 0)}) is not at the start of a line: the file changed "
        "since the checkpoint was saved, or the checkpoint's data state is damaged; restore the "
        "file, or resume from an earlier checkpoint (checkpoint.load_path)"
    )


class _LineReader:
    """Records of a line-per-record file; subclasses give `_readline()` and track the offset."""

    def __init__(self, shard: Shard, position: Position, options: ReadOptions) -> None:
        self.path, self.stride, self.offset = shard.path, shard.stride, shard.offset
        self.keys, self.chat = options.text_keys, options.chat
        self.limit = options.max_document_bytes
        self.row = position.row
        self.byte_offset = getattr(position, "byte_offset", 0)

    def _readline(self) -> bytes:
        """The next line; LongLine (after passing it) if it has more than `self.limit` bytes
        before its newline."""
        raise NotImplementedError

    def read(self) -> Document | None:
        while True:
            try:
                line = self._readline()
            except BadFile as exc:  # the lines before the damage were returned
                raise BadFile(f"{exc}; the last good line is line {self.row}") from exc
            except LongLine as long:
                row = self.row
                self.row += 1
                self.byte_offset += long.size
                if row % self.stride == self.offset:
                    raise BadRecord(row, too_long(long.size, self.limit)) from None
                continue
            if not line:
                return None
            row = self.row
            self.row += 1
            self.byte_offset += len(line)
            if row % self.stride != self.offset or not line.strip():
                continue
            try:
                return document(record_from_json(line), self.path, row, self.keys, chat=self.chat)
            except RecordError as exc:
                raise BadRecord(row, str(exc)) from exc


class JsonlReader(_LineReader):
    """Lines of a JSONL file from a byte offset."""

    def __init__(self, shard: Shard, position: JsonlPosition, options: ReadOptions) -> None:
        super().__init__(shard, position, options)
        fs, fs_path = open_fs(self.path, options.storage_options)
        with open_errors(self.path):
            self.file = fs.open(fs_path, "rb")
            size = fs.size(fs_path) if position.byte_offset else 0
        if position.byte_offset > size:
            self.file.close()
            raise changed_file_error(
                self.path, f"{size} bytes, but the saved position is byte {position.byte_offset}"
            )
        if position.byte_offset:
            self.file.seek(position.byte_offset - 1)
            before = self.file.read(1)  # b"" past the end of the file
            if before and before != b"\n":
                self.file.close()
                raise mid_line(self.path, position)

    def _readline(self) -> bytes:
        if self.limit is None:
            return self.file.readline()
        line = self._readline_upto(self.limit + 1)
        if len(line) <= self.limit or line.endswith(b"\n"):
            return line
        size = len(line)
        while line and not line.endswith(b"\n"):  # pass the rest of it, a bounded piece at a time
            line = self._readline_upto(READ_CHUNK)
            size += len(line)
        raise LongLine(size)

    def _readline_upto(self, size: int) -> bytes:
        """The next line, or its first `size` bytes. Local files take the bound themselves;
        fsspec's remote files read until the newline, so they are read and sought back."""
        if not isinstance(self.file, AbstractBufferedFile):
            return self.file.readline(size)
        start, parts, got = self.file.tell(), [], 0
        while got < size and (chunk := self.file.read(min(READ_CHUNK, size - got))):
            end = chunk.find(b"\n")
            if end >= 0:
                parts.append(chunk[: end + 1])
                got += end + 1
                self.file.seek(start + got)
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def position(self) -> dict[str, int]:
        return {"row": self.row, "byte_offset": self.byte_offset}

    def close(self) -> None:
        self.file.close()


def _decompressor(kind: str):
    if kind == "gz":
        return zlib.decompressobj(wbits=31)  # one gzip member
    import zstandard  # noqa: PLC0415 - a dependency, imported where needed

    return zstandard.ZstdDecompressor().decompressobj()


def _decompress_errors(kind: str) -> tuple[type[BaseException], ...]:
    if kind == "gz":
        return (zlib.error,)
    import zstandard  # noqa: PLC0415

    return (zstandard.ZstdError,)


class CompressedLines:
    """Lines of a zstd/gzip-compressed file, from a known frame boundary.

    `frame_offset`/`frame_start`: compressed and uncompressed offsets of a frame boundary at or
    before `byte_offset` (the uncompressed offset of the first line to return)."""

    def __init__(
        self,
        path: str,
        kind: str,
        fs: fsspec.AbstractFileSystem,
        fs_path: str,
        frame_offset: int = 0,
        frame_start: int = 0,
        byte_offset: int = 0,
    ) -> None:
        self.path, self.kind = path, kind
        self.file = fs.open(fs_path, "rb")
        self.file.seek(frame_offset)
        self.in_pos = frame_offset  # compressed offset of input[used]
        self.input = b""  # compressed bytes read; input[used:] not yet decompressed
        self.used = 0
        self.held = False  # gzip may hold output for input it took (its last call hit the bound)
        self.dec = _decompressor(kind)
        self.fed = False  # the current decompressor has been given input
        self.buf = bytearray()  # decompressed bytes; buf[pos:] not yet returned
        self.pos = 0
        self.buf_start = frame_start  # uncompressed offset of buf[0]
        self.boundary = (frame_offset, frame_start)  # last frame boundary <= the next line
        self.pending: list[tuple[int, int]] = []  # boundaries after the next line's start
        self._errors = _decompress_errors(kind)
        self.frame_at = frame_offset  # compressed offset where the current frame starts
        self.damage: BadFile | None = None  # found after buf's data: raised once buf is used
        while self.buf_start + len(self.buf) < byte_offset:
            self._consume(len(self.buf) - self.pos)  # skip what lies before the offset
            if not self._fill():
                self.file.close()
                raise changed_file_error(
                    path,
                    f"{self.offset} bytes uncompressed, but the saved position is byte {byte_offset}",
                )
        self._consume(byte_offset - self.buf_start - self.pos)

    @property
    def offset(self) -> int:
        """Uncompressed offset of the next byte to return."""
        return self.buf_start + self.pos

    def _fill(self) -> bool:
        """Decompress a bounded step more into buf; False at a clean end of file. Damage raises
        BadFile once the data decompressed before it has been returned."""
        if self.damage is not None:
            raise self.damage
        if self.used == len(self.input) and not self.held:
            self.input, self.used = self.file.read(READ_CHUNK), 0
            if not self.input:
                if self.fed and not self.dec.eof:
                    raise BadFile("truncated stream: the file ends inside a compressed frame")
                return False
        if self.pos >= len(self.buf) // 2:  # drop what was returned (amortised: rarely copies)
            del self.buf[: self.pos]
            self.buf_start, self.pos = self.buf_start + self.pos, 0
        produced = 0
        view = memoryview(self.input)
        while (self.used < len(self.input) or self.held) and produced < FILL_STEP:
            if not self.fed:
                self.frame_at = self.in_pos
            try:
                if self.kind == "gz":
                    fed = view[self.used :]
                    out = self.dec.decompress(fed, GZ_MAX_OUT)
                else:
                    fed = view[self.used : self.used + ZSTD_SLICE]
                    out = self.dec.decompress(fed)
            except self._errors as exc:
                self.damage = BadFile(
                    f"corrupt compressed data in the frame at byte {self.frame_at} ({exc})"
                )
                self.damage.__cause__ = exc
                return True  # the lines before the damage first; the next _fill raises
            self.fed = True
            self.held = self.kind == "gz" and len(out) == GZ_MAX_OUT and not self.dec.eof
            self.buf += out
            produced += len(out)
            tail = len(self.dec.unconsumed_tail) + (
                len(self.dec.unused_data) if self.dec.eof else 0
            )
            consumed = len(fed) - tail
            self.used += consumed
            self.in_pos += consumed
            if self.dec.eof:  # a frame ends here: the next one starts a new decompressor
                self.pending.append((self.in_pos, self.buf_start + len(self.buf)))
                self.dec, self.fed = _decompressor(self.kind), False
        return True

    def _consume(self, n: int) -> None:
        self.pos += n
        while self.pending and self.pending[0][1] <= self.offset:
            self.boundary = self.pending.pop(0)

    def readline(self, limit: int | None = None) -> bytes:
        """The next line (with its newline; the last may lack it), b"" at the end; LongLine
        (once past it) for a line of more than `limit` bytes, never holding much more of it."""
        scanned = 0  # bytes after pos known to hold no newline
        while (end := self.buf.find(b"\n", self.pos + scanned)) < 0:
            scanned = len(self.buf) - self.pos
            if limit is not None and scanned > limit:
                raise LongLine(self._pass_line())
            if not self._fill():
                end = len(self.buf) - 1
                break
        line = bytes(self.buf[self.pos : end + 1])
        self._consume(len(line))
        return line

    def _pass_line(self) -> int:
        """Drop the rest of the current line, one bounded step at a time; its size."""
        start = self.offset
        while (end := self.buf.find(b"\n", self.pos)) < 0:
            self._consume(len(self.buf) - self.pos)
            if not self._fill():
                return self.offset - start
        self._consume(end + 1 - self.pos)
        return self.offset - start

    def close(self) -> None:
        self.file.close()


class CompressedJsonlReader(_LineReader):
    """JSONL lines of a zstd (`kind="zst"`) or gzip (`"gz"`) stream, from a frame boundary."""

    def __init__(
        self, shard: Shard, position: CompressedPosition, options: ReadOptions, kind: str
    ) -> None:
        super().__init__(shard, position, options)
        fs, fs_path = open_fs(self.path, options.storage_options)
        p = position
        if kind == "zst" and isinstance(fs, LocalFileSystem):
            warn_trailing_garbage(fs_path)
        with open_errors(self.path):
            self.lines = CompressedLines(
                self.path, kind, fs, fs_path, p.frame_offset, p.frame_start, p.byte_offset
            )
        lines = self.lines  # the byte before the offset, when it is in the decompressed buffer
        if p.byte_offset and lines.pos > 0 and lines.buf[lines.pos - 1 : lines.pos] != b"\n":
            lines.close()
            raise mid_line(self.path, p)

    def _readline(self) -> bytes:
        return self.lines.readline(self.limit)

    def position(self) -> dict[str, int]:
        frame_offset, frame_start = self.lines.boundary
        return {
            "row": self.row,
            "byte_offset": self.byte_offset,
            "frame_offset": frame_offset,
            "frame_start": frame_start,
        }

    def close(self) -> None:
        self.lines.close()


JSONL = DataFormat("json", (".jsonl",), JsonlPosition, JsonlReader, listing_rank=30)
ZST = DataFormat(
    "zst",
    (".jsonl.zst", ".jsonl.zstd"),
    CompressedPosition,
    lambda shard, position, options: CompressedJsonlReader(shard, position, options, "zst"),
    listing_rank=20,
    variant_of="json",
)
GZ = DataFormat(
    "gz",
    (".jsonl.gz",),
    CompressedPosition,
    lambda shard, position, options: CompressedJsonlReader(shard, position, options, "gz"),
    listing_rank=20,
    variant_of="json",
)
