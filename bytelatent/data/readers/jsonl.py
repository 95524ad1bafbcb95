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

from bytelatent.data.readers.base import (
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
    record_from_json,
)

READ_CHUNK = 1 << 20  # compressed bytes read at a time


class JsonlPosition(Position):
    byte_offset: int = 0  # byte offset of `row`


class CompressedPosition(Position):
    byte_offset: int = 0  # uncompressed byte offset of `row`
    frame_offset: int = 0  # compressed offset of the last frame boundary before `row`
    frame_start: int = 0  # uncompressed offset of that boundary


class _LineReader:
    """Records of a line-per-record file; subclasses give `_readline()` and track the offset."""

    def __init__(self, shard: Shard, position: Position, options: ReadOptions) -> None:
        self.path, self.stride, self.offset = shard.path, shard.stride, shard.offset
        self.keys, self.chat = options.text_keys, options.chat
        self.row = position.row
        self.byte_offset = getattr(position, "byte_offset", 0)

    def _readline(self) -> bytes:
        raise NotImplementedError

    def read(self) -> Document | None:
        while True:
            try:
                line = self._readline()
            except BadFile as exc:  # the lines before the damage were returned
                raise BadFile(f"{exc}; the last good line is line {self.row}") from exc
            if not line:
                return None
            row = self.row
            self.row += 1
            self.byte_offset += len(line)
            if row % self.stride != self.offset or not line.strip():
                continue
            try:
                return document(record_from_json(line), self.path, row, self.keys, self.chat)
            except RecordError as exc:
                raise BadRecord(row, str(exc)) from exc


class JsonlReader(_LineReader):
    """Lines of a JSONL file from a byte offset."""

    def __init__(self, shard: Shard, position: JsonlPosition, options: ReadOptions) -> None:
        super().__init__(shard, position, options)
        fs, fs_path = open_fs(self.path, options.storage_options)
        with open_errors(self.path):
            self.file = fs.open(fs_path, "rb")
        if position.byte_offset:
            self.file.seek(position.byte_offset)
        self._readline = self.file.readline

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
        self.in_pos = frame_offset  # compressed offset of the next read
        self.dec = _decompressor(kind)
        self.fed = False  # the current decompressor has been given input
        self.buf = b""  # decompressed bytes; buf[pos:] not yet returned
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
                raise BadFile(f"ends before the resume offset {byte_offset} (file changed?)")
        self._consume(byte_offset - self.buf_start - self.pos)

    @property
    def offset(self) -> int:
        """Uncompressed offset of the next byte to return."""
        return self.buf_start + self.pos

    def _fill(self) -> bool:
        """Decompress the next chunk into buf; False at a clean end of file. Damage raises BadFile
        once the data decompressed before it has been returned."""
        if self.damage is not None:
            raise self.damage
        chunk = self.file.read(READ_CHUNK)
        if not chunk:
            if self.fed and not self.dec.eof:
                raise BadFile("truncated stream: the file ends inside a compressed frame")
            return False
        self.buf, self.buf_start, self.pos = self.buf[self.pos :], self.offset, 0
        start = self.in_pos
        self.in_pos += len(chunk)
        data = chunk
        while data:
            if not self.fed:
                self.frame_at = start + len(chunk) - len(data)
            try:
                self.buf += self.dec.decompress(data)
            except self._errors as exc:
                self.damage = BadFile(
                    f"corrupt compressed data in the frame at byte {self.frame_at} ({exc})"
                )
                self.damage.__cause__ = exc
                return True  # the lines before the damage first; the next _fill raises
            self.fed = True
            if not self.dec.eof:
                break
            unused = self.dec.unused_data
            self.pending.append((start + len(chunk) - len(unused), self.buf_start + len(self.buf)))
            self.dec, self.fed, data = _decompressor(self.kind), False, unused
        return True

    def _consume(self, n: int) -> None:
        self.pos += n
        while self.pending and self.pending[0][1] <= self.offset:
            self.boundary = self.pending.pop(0)

    def readline(self) -> bytes:
        """The next line (with its newline; the last may lack it), b"" at the end."""
        while (end := self.buf.find(b"\n", self.pos)) < 0:
            if not self._fill():
                end = len(self.buf) - 1
                break
        line = self.buf[self.pos : end + 1]
        self._consume(len(line))
        return line

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
        with open_errors(self.path):
            self.lines = CompressedLines(
                self.path, kind, fs, fs_path, p.frame_offset, p.frame_start, p.byte_offset
            )
        self._readline = self.lines.readline

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
