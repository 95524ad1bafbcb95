"""Files with no rows are left out of a stream's file list, each with one warning line.

A dataset with one empty shard (a Parquet file of 0 rows beside one of 200) used to give some
data streams nothing but that file, and their first read failed with "no readable documents for
this rank". An empty file holds nothing to train on, so it is dropped before the files are
assigned to streams; `python -m bytelatent.data.check` still reports it.

What counts as empty, cheaply: a file of 0 bytes (any format, local or remote, from its size);
for local files also a Parquet or Arrow file whose footer says 0 rows, and a small plain JSONL
file of blank lines only. Anything that cannot be told cheaply stays in (its reader decides).
"""

from __future__ import annotations

import logging
from typing import Any

from bytelatent.data.readers.base import open_fs

logger = logging.getLogger(__name__)

_SMALL_TEXT = 1 << 16  # a plain JSONL file this small is read to see whether it has a record


def _rows_zero(path: str, fmt: str) -> bool:
    """A local Parquet/Arrow file whose metadata says 0 rows, or a small blank JSONL file."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq  # noqa: PLC0415 - only when a parquet file is listed

            return pq.ParquetFile(path).metadata.num_rows == 0
        if fmt == "arrow":
            import pyarrow as pa  # noqa: PLC0415

            with pa.memory_map(path) as source:
                reader = pa.ipc.open_file(source)
                return all(
                    reader.get_batch(i).num_rows == 0 for i in range(reader.num_record_batches)
                )
        if fmt == "json":
            with open(path, "rb") as file:
                head = file.read(_SMALL_TEXT + 1)
            return len(head) <= _SMALL_TEXT and not head.strip()
    except (OSError, ValueError, ImportError):
        return False  # unreadable here: its reader says what is wrong
    return False


def is_empty(path: str, fmt: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether `path` (of format `fmt`) surely holds no rows (see the module docstring)."""
    fs, fs_path = open_fs(path, storage_options)
    try:
        if fs.size(fs_path) == 0:
            return True
    except OSError:
        return False  # missing or unreadable: the reader reports it
    return "://" not in path and _rows_zero(path, fmt)


def drop_empty(
    paths: list[str], formats: list[str], storage_options: dict[str, Any] | None = None
) -> tuple[list[str], list[str]]:
    """`paths` (and their formats) without the empty files; one warning line for each dropped."""
    kept: list[tuple[str, str]] = []
    for path, fmt in zip(paths, formats):
        if is_empty(path, fmt, storage_options):
            logger.warning("skipping %s: the file has no rows", path)
        else:
            kept.append((path, fmt))
    return [p for p, _ in kept], [f for _, f in kept]
