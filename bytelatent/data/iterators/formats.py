"""Readers for Parquet and compressed JSONL (`.jsonl.zst`, `.jsonl.gz`) with exact positions.

Parquet
    Read one row group at a time and only the columns training needs (the text column, the first
    sample-id column present, `entropies` when present). A position is (row group, row), so a
    resume opens the footer and seeks straight to its row group. A missing or corrupt footer is
    found when the file is opened.

Compressed JSONL
    zstd and gzip streams are decompressed sequentially; a position is the uncompressed byte
    offset of the next line plus the last *frame* (zstd frame, gzip member) boundary before it,
    as a (compressed offset, uncompressed offset) pair. A resume seeks to that boundary and
    decompresses from there, so its cost is bounded by the frame size: write shards as many
    frames (`zstd --long`-free, e.g. one frame per few MB) to keep resumes cheap; a single-frame
    file is decompressed from its start (measured in bench/RESULTS_data_formats.md).
    A stream that ends inside a frame, or does not decompress, is truncated or corrupt: the lines
    decompressed before the damage are returned first (they are trained on), then BadFile names
    the compressed byte where the frame that does not decompress starts. The file iterator makes
    it one DataError naming the file and the first line it could not read, or, with
    `data.skip_bad_records=true`, skips the file's rest as one counted bad record with one warning
    line (as for any damage that leaves the rest of a file unreadable).
"""

from __future__ import annotations

import zlib

import fsspec
import pyarrow as pa

from bytelatent.errors import DataError

READ_CHUNK = 1 << 20  # compressed bytes read at a time


class BadFile(Exception):
    """The file (or its rest) cannot be read; becomes a DataError or a counted skip."""


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
    """Lines of a zstd/gzip-compressed JSONL file, from a known frame boundary.

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


class ParquetReader:
    """Row groups of a Parquet file, reading only the columns that training uses."""

    def __init__(
        self,
        path: str,
        fs: fsspec.AbstractFileSystem,
        fs_path: str,
        text_keys: tuple[str, ...],
        id_keys: tuple[str, ...],
    ) -> None:
        import pyarrow.parquet as pq  # noqa: PLC0415 - only Parquet runs need it

        self.path = path
        self.file = fs.open(fs_path, "rb")
        try:
            self.parquet = pq.ParquetFile(self.file)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            self.file.close()
            raise BadFile(f"not a Parquet file or its footer is missing/corrupt ({exc})") from exc
        names = self.parquet.schema_arrow.names
        text = next((k for k in text_keys if k in names), None)
        if text is None:
            self.file.close()
            wanted = " or ".join(repr(k) for k in text_keys)
            raise DataError(f"{path}: no {wanted} column (columns: {names}); set data.text_field")
        self.columns = [text]
        sample_id = next((k for k in id_keys if k in names), None)
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
            table = self.parquet.read_row_group(index, columns=self.columns)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, EOFError) as exc:
            raise BadFile(f"row group {index}: truncated or corrupt Parquet data ({exc})") from exc
        batches = table.combine_chunks().to_batches()
        if not batches:
            return pa.RecordBatch.from_pylist([], schema=table.schema)
        return batches[0]

    def close(self) -> None:
        self.file.close()
