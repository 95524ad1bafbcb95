"""Loader throughput per file format, resume cost per format and file size, elastic re-shard cost.

1. Throughput: the stdlib corpus written as .jsonl, .jsonl.zst (1 MB frames), Parquet (row groups
   of 64 rows) and Arrow IPC, read by one process (no prefetcher) in byte and space-patching
   modes; packed MB per CPU-second of that process (the per-worker figure), and the raw reader
   rate (documents only, MB of text per CPU-second).
2. Resume cost: time to the first document after resuming at 90% of one file of --resume-mb
   uncompressed MB, per format (zst as one frame and as 1 MB frames; above --all-formats-mb
   only the two zst files are written).
3. Elastic: time from a checkpoint's data states to the first batch on every rank (4 -> 2 and
   2 -> 4 ranks, in one process), against a same-size resume.

    OMP_NUM_THREADS=1 python bench/data_formats.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsspec.implementations.local import LocalFileSystem  # noqa: E402

from bytelatent.data.args import DataArgs  # noqa: E402
from bytelatent.data.elastic import build_train_data, resume_data_state  # noqa: E402
from bytelatent.data.iterators.file import (  # noqa: E402
    FileIteratorState,
    FileShard,
)
from bytelatent.data.prepare import prepare  # noqa: E402
from bytelatent.data.readers import format_of as file_format_of  # noqa: E402

FRAME = 1 << 20


def corpus_records(stdlib: Path) -> list[dict]:
    out = []
    for path in sorted(stdlib.glob("*.chunk.*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def write_zst(path: Path, lines: list[bytes], frame_bytes: int | None) -> list[tuple[int, int]]:
    """Frames of about `frame_bytes` uncompressed bytes (None: one frame for the whole file);
    returns the (compressed, uncompressed) offset of every frame start."""
    compressor = zstandard.ZstdCompressor(level=3)
    starts, out, size = [], 0, 0
    with open(path, "wb") as f:
        if frame_bytes is None:
            with compressor.stream_writer(f, closefd=False) as w:
                for line in lines:
                    w.write(line)
            return [(0, 0)]
        frame: list[bytes] = []
        pending = 0
        for line in lines:
            frame.append(line)
            pending += len(line)
            if pending >= frame_bytes:
                starts.append((out, size))
                out += f.write(compressor.compress(b"".join(frame)))
                size += pending
                frame, pending = [], 0
        if frame:
            starts.append((out, size))
            f.write(compressor.compress(b"".join(frame)))
    return starts


def write_formats(records: list[dict], folder: Path, frame_bytes: int | None = FRAME) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records]
    paths = {
        "jsonl": folder / "d.jsonl",
        "zst": folder / "d.jsonl.zst",
        "parquet": folder / "d.parquet",
        "arrow": folder / "d.arrow",
    }
    paths["jsonl"].write_bytes(b"".join(lines))
    write_zst(paths["zst"], lines, frame_bytes)
    table = pa.Table.from_pylist(
        [{"sample_id": r["sample_id"], "text": r["text"]} for r in records]
    )
    pq.write_table(table, str(paths["parquet"]), row_group_size=64)
    with pa.OSFile(str(paths["arrow"]), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=64):
            w.write_batch(batch)
    return paths


def data_args(path: Path, mode: str) -> DataArgs:
    common = dict(dataset_files=[str(path)], batch_size=4, buffer_size=64, load_async=False)
    if mode == "bytes":
        return DataArgs(
            **common, seq_len=8192, add_patches=False, patcher_args={"patching_mode": "byte"}
        )
    return DataArgs(
        **common, seq_len=2048, max_encoder_seq_length=8192, patcher_args={"patching_mode": "space"}
    )


def loader_rate(path: Path, mode: str, batches: int) -> float:
    it = data_args(path, mode).build_from_rank(0, 1)
    next(it)
    packed, cpu = 0, time.process_time()
    for _ in range(batches):
        packed += next(it).x.size
    rate = packed / (time.process_time() - cpu) / 1e6
    it.close()
    return rate


def reader_rate(path: Path, passes: int) -> float:
    state = FileIteratorState(shards=[FileShard(path=str(path), format=file_format_of(str(path)))])
    text, cpu = 0, time.process_time()
    for _ in range(passes):
        text += sum(len(d.text.encode()) for d in state.build())
    return text / (time.process_time() - cpu) / 1e6


def scaled_records(records: list[dict], megabytes: int) -> list[dict]:
    out, size, i = [], 0, 0
    while size < megabytes * 1e6:
        r = records[i % len(records)]
        out.append({"sample_id": f"{r['sample_id']}#{i}", "text": r["text"]})
        size += len(r["text"]) + 40
        i += 1
    return out


def resume_state(path: Path, lines: list[bytes], frames: list[tuple[int, int]] | None):
    """The exact state at 90% of the file's rows, built directly (as a checkpoint would hold)."""
    fmt = file_format_of(str(path))
    row = int(0.9 * len(lines))
    state = FileIteratorState(shards=[FileShard(path=str(path), format=fmt)])
    if fmt in ("json", "zst"):
        offset = sum(map(len, lines[:row]))
        frame = max((f for f in frames or [(0, 0)] if f[1] <= offset), key=lambda f: f[1])
        position = {"row": row, "byte_offset": offset}
        position |= {"frame_offset": frame[0], "frame_start": frame[1]} if fmt == "zst" else {}
        return state.model_copy(update={"position": position})
    if fmt == "parquet":
        meta = pq.ParquetFile(str(path)).metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    else:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        sizes = [reader.get_batch(b).num_rows for b in range(reader.num_record_batches)]
    start = batch = 0
    while start + sizes[batch] <= row:
        start += sizes[batch]
        batch += 1
    if fmt == "parquet":
        position = {"row": row, "row_group": batch, "group_start_row": start}
    else:
        position = {"row": row, "batch_index": batch, "batch_start_row": start}
    return state.model_copy(update={"position": position})


def resume_seconds(state: FileIteratorState) -> float:
    """Seconds from a resumed state to its first document."""
    start = time.perf_counter()
    it = state.build()
    next(it)
    seconds = time.perf_counter() - start
    it.close()
    return seconds


def elastic_seconds(root: Path, src: int, dst: int, steps: int = 3) -> tuple[float, float]:
    """(re-shard + first batch on every new rank, same-size resume) in seconds, global batch 16."""

    def data(bs: int) -> DataArgs:
        return DataArgs(
            root_dir=str(root), sources={"stdlib": 1.0}, batch_size=bs, seq_len=2048,
            max_encoder_seq_length=8192, patcher_args={"patching_mode": "space"}, load_async=False,
        )  # fmt: skip

    folder = root / f"ckpt_{src}_{dst}"
    folder.mkdir()
    its = [build_train_data(data(16 // src), r, src, 1, None) for r in range(src)]
    for _ in range(steps):
        for it in its:
            next(it)
    for r, it in enumerate(its):
        state = {"data_state": it.get_state().model_dump(mode="json")}
        (folder / f"train_state_{r:05d}.json").write_text(json.dumps(state))
        it.close()
    out = []
    for size in (dst, src):
        ckpt = SimpleNamespace(fs=LocalFileSystem(), last_load=SimpleNamespace(saved_dp_size=src))
        start = time.perf_counter()
        for r in range(size):
            own = json.loads((folder / f"train_state_{r if r < src else 0:05d}.json").read_text())
            state = resume_data_state(
                data(16 // size), ckpt, str(folder), own["data_state"], r, size, 1
            )
            it = build_train_data(data(16 // size), r, size, 1, state)
            next(it)
            it.close()
        out.append(time.perf_counter() - start)
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--resume-mb", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--all-formats-mb", type=int, default=256, help="larger: zst only")
    a = parser.parse_args()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "loadavg": os.getloadavg(),
    }  # fmt: skip
    print(json.dumps(meta), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare(tmp / "data" / "stdlib")
        records = corpus_records(tmp / "data" / "stdlib")
        paths = write_formats(records, tmp / "formats")
        print("format   file MB  reader MB/cpu-s  bytes packed MB/cpu-s  space packed MB/cpu-s")
        for name, path in paths.items():
            mb = path.stat().st_size / 1e6
            rates = [loader_rate(path, m, a.batches) for m in ("bytes", "space")]
            print(f"{name:8s} {mb:7.2f} {reader_rate(path, 3):16.1f} {rates[0]:22.1f} {rates[1]:21.1f}",
                  flush=True)  # fmt: skip
        print("\nresume at 90% of one file: seconds to the first document")
        for megabytes in a.resume_mb:
            folder = tmp / f"resume{megabytes}"
            folder.mkdir()
            big = scaled_records(records, megabytes)
            lines = [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in big]
            paths = {
                "zst 1 MB frames": folder / "d.jsonl.zst",
                "zst one frame": folder / "s.jsonl.zst",
            }
            frames = write_zst(paths["zst 1 MB frames"], lines, FRAME)
            write_zst(paths["zst one frame"], lines, None)
            if megabytes <= a.all_formats_mb:
                paths |= {k: v for k, v in write_formats(big, folder / "all").items() if k != "zst"}
            del big
            row = {}
            for name, path in paths.items():
                state = resume_state(path, lines, frames if name == "zst 1 MB frames" else None)
                row[name] = resume_seconds(state)
                path.unlink()
            print(f"{megabytes:5d} MB uncompressed: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()), flush=True)  # fmt: skip
        print("\nelastic re-shard (space patching, global batch 16 rows, 3 steps in)")
        for src, dst in ((4, 2), (2, 4)):
            moved, same = elastic_seconds(tmp / "data", src, dst)
            print(f"{src} -> {dst} ranks: {moved:.2f} s for all ranks' first batch "
                  f"(same-size resume at {src}: {same:.2f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
