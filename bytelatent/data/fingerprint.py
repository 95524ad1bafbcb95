"""A cheap fingerprint of a data file, kept in the data state beside a saved read position.

A saved position (a byte offset, a row group, a frame) only means something in the file it was
taken in. A file replaced, cut or regenerated between a save and a resume would otherwise be read
from a position that lands past its end or mid-record (issue 38: a resume past the end of a
shortened file spun forever). The fingerprint is the file's size and the CRC-32 of its last
`TAIL_BYTES` (a Parquet or Arrow footer, the last lines or frames of a JSONL file): one stat and
one small read per file opened, stable across copies (no mtime, which `cp` and a move to s3://
change), and it catches a file that got shorter or longer, or whose end was rewritten. The tail,
not the head: a resume reads nothing before its position, and its tests check that by damaging
that part of the file.
"""

from __future__ import annotations

import zlib
from typing import Any

from bytelatent.data.readers.base import changed_file_error, open_errors, open_fs

__all__ = [
    "TAIL_BYTES",
    "changed_file_error",
    "describe_change",
    "file_fingerprint",
]

TAIL_BYTES = 1 << 16


def file_fingerprint(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """`<size>:<crc32 of the last TAIL_BYTES, hex>` of a local path or URL; DataError if the file
    cannot be opened."""
    fs, fs_path = open_fs(path, storage_options)
    with open_errors(path):
        size = fs.size(fs_path)
        with fs.open(fs_path, "rb") as file:
            file.seek(max(0, size - TAIL_BYTES))
            tail = file.read(TAIL_BYTES)
    return f"{size}:{zlib.crc32(tail):08x}"


def describe_change(saved: str, now: str) -> str:
    """What changed between two fingerprints, in words."""
    saved_size, _, _ = saved.partition(":")
    now_size, _, _ = now.partition(":")
    if saved_size != now_size:
        return f"it has {now_size} bytes, {saved_size} when the position was saved"
    return f"its last {TAIL_BYTES} bytes differ (same size, {now_size} bytes)"
