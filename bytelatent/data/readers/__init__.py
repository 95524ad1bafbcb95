"""Data formats: one reader per format behind one protocol, found by file suffix.

    from bytelatent.data.readers import DataFormat, register_format, format_of, get_format

`base.py` has the protocol (`Reader`, `Position`, `DataFormat`) and the registry; `jsonl.py` and
`table.py` register the built-in formats (JSONL, `.jsonl.zst`, `.jsonl.gz`, Arrow IPC, Parquet).
How to add one: docs/data.md, "Adding a data format".
"""

from bytelatent.data.readers.base import (
    DEFAULT_FORMAT,
    SAMPLE_ID_KEYS,
    TEXT_KEYS,
    BadFile,
    BadRecord,
    DataFormat,
    Document,
    Position,
    Reader,
    ReadOptions,
    RecordError,
    Shard,
    document,
    forced_format,
    format_of,
    formats,
    get_format,
    open_errors,
    open_fs,
    record_from_json,
    register_format,
    text_keys,
    unregister_format,
)
from bytelatent.data.readers.jsonl import GZ, JSONL, ZST
from bytelatent.data.readers.table import ARROW, PARQUET

for _fmt in (JSONL, ZST, GZ, ARROW, PARQUET):
    register_format(_fmt, replace=True)

__all__ = [
    "DEFAULT_FORMAT",
    "SAMPLE_ID_KEYS",
    "TEXT_KEYS",
    "BadFile",
    "BadRecord",
    "DataFormat",
    "Document",
    "Position",
    "ReadOptions",
    "Reader",
    "RecordError",
    "Shard",
    "document",
    "forced_format",
    "format_of",
    "formats",
    "get_format",
    "open_errors",
    "open_fs",
    "record_from_json",
    "register_format",
    "text_keys",
    "unregister_format",
]
