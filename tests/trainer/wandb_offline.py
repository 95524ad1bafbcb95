"""Read wandb's offline `.wandb` files: the LevelDB-log framing around wandb's own protobuf records.

wandb 0.31 ships no Python reader (the old `wandb.sdk.internal.datastore` is gone; its Go core
writes the files), so the framing (a 7-byte `:W&B` header, then 32 KiB blocks of records with a
7-byte header: CRC32, length, type FULL/FIRST/MIDDLE/LAST) is decoded here and each record is
parsed with `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path):
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, hex(magic), version)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the rest of a block too small for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0:
            break
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad CRC at {pos}"
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    start_time: float = 0.0
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exited: bool = False


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun(path)
    for raw in raw_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
            run.start_time = record.run.start_time.ToMicroseconds() / 1e6
            run.config.update(
                {_item_key(i): json.loads(i.value_json) for i in record.run.config.update}
            )
        elif kind == "config":
            run.config.update(
                {_item_key(i): json.loads(i.value_json) for i in record.config.update}
            )
        elif kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
            run.history.append(row)
        elif kind == "summary":
            run.summary.update(
                {_item_key(i): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "exit":
            run.exited = True
    return run


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run folder's `.wandb` file under `wandb_dir`, oldest first."""
    runs = [read_offline_run(p) for p in wandb_dir.glob("offline-run-*/run-*.wandb")]
    return sorted(runs, key=lambda r: r.start_time)
