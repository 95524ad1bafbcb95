"""Where a `.zst` file stops being zstd data, found by walking its frame and block headers.

Training decompresses a file only as far as it reads, so bytes after the last frame (a file
concatenated with something else, a partial copy over a longer one) used to go unnoticed until
the reader reached them, hours into a run, or never in a short one; `data.check` found them.
The walk reads a few bytes per block (a 3-byte header per up to 128 KiB of data), so a reader
runs it on every local `.zst` file it opens and warns once per file (reading still stops at the
garbage: one error, or one counted skip with `data.skip_bad_records=true`).

Format (RFC 8878): a frame is magic 0xFD2FB528, a header (descriptor byte, window byte unless
single-segment, dictionary id, content size), blocks (3-byte header: last flag, type, size; an
RLE block holds one byte), and a 4-byte checksum when flagged. Skippable frames are magic
0x184D2A5? and a 4-byte length.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50
_DICT_ID_BYTES = (0, 1, 2, 4)
_warned: set[str] = set()


def _frame_end(fd: int, pos: int) -> int | None:
    """End offset of the zstd frame at `pos`; None if the bytes there are not a frame header.
    A frame that runs past the end of the file ends past it (the reader reports truncation)."""
    head = os.pread(fd, 8, pos)
    if len(head) < 4:
        return None
    magic = int.from_bytes(head[:4], "little")
    if magic & 0xFFFFFFF0 == _SKIPPABLE:
        return pos + 8 + int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if magic != ZSTD_MAGIC or len(head) < 5 or head[4] & 0x08:  # 0x08: a reserved bit
        return None
    descriptor = head[4]
    single_segment = (descriptor >> 5) & 1
    content_size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    pos += 5 + (1 - single_segment) + _DICT_ID_BYTES[descriptor & 3] + content_size_bytes
    while True:
        block = os.pread(fd, 3, pos)
        if len(block) < 3:
            return pos + 3  # past the end: truncated
        value = int.from_bytes(block, "little")
        kind, size = (value >> 1) & 3, value >> 3
        if kind == 3:
            return None  # reserved block type: not zstd data
        pos += 3 + (1 if kind == 1 else size)
        if value & 1:  # the last block
            return pos + (4 if descriptor & 0x04 else 0)


def garbage_offset(path: str) -> int | None:
    """The offset of the first byte after the last complete frame that is not zstd data; None
    when the file is frames to its end (or ends inside one: the reader reports a truncation)."""
    with open(path, "rb", buffering=0) as file:
        fd, size, pos = file.fileno(), os.fstat(file.fileno()).st_size, 0
        while pos < size:
            end = _frame_end(fd, pos)
            if end is None:
                return pos
            pos = end
    return None


def warn_trailing_garbage(path: str) -> None:
    """One warning line per local file (per process) that has bytes after its frames."""
    if path in _warned or "://" in path:
        return
    _warned.add(path)
    try:
        at = garbage_offset(path)
    except OSError:
        return  # the reader reports what is wrong with the file
    if at is not None:
        logger.warning(
            "%s: the bytes from %d on are not zstd data (after the last complete frame); the "
            "lines before them are read, then reading stops there with an error (one counted "
            "skip with data.skip_bad_records=true); recompress or truncate the file",
            path,
            at,
        )
