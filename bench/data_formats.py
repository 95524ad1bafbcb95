"""Loader throughput per file format, resume cost per format and file size, elastic re-shard cost.

1. Throughput: the stdlib corpus written as .jsonl, .jsonl.zst (1 MB frames), Parquet (row groups
   of 64 rows) and Arrow IPC, read by one process (no prefetcher) in byte and space-patching
   modes; packed MB per CPU-second of that process (the per-worker figure), and the raw reader
   rate (documents only, MB of text per CPU-second).
2. Resume cost: time to the first document after resuming at 90% of one file of --resume-mb
   uncompressed MB, per format (zst as one frame and as 1 MB frames).
3. Elastic: time from a checkpoint's data states to the first batch on every rank (4 -> 2 and
   2 -> 4 ranks, in one process), against a same-size resume.

    OMP_NUM_THREADS=1 python bench/data_formats.py --resume-mb 64 256 1024
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
    file_format_of,  # noqa: E402
)
from bytelatent.data.prepare import prepare  # noqa: E402

FRAME = 1 << 20


def corpus_records(stdlib: Path) -> list[dict]:
    out = []
    for path in sorted(stdlib.glob("*.chunk.*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def write_zst(path: Path, lines: list[bytes], frame_bytes: int | None) -> None:
    """Frames of about `frame_bytes` uncompressed bytes (None: one frame for the whole file)."""
    compressor = zstandard.ZstdCompressor(level=3)
    with open(path, "wb") as f:
        if frame_bytes is None:
            with compressor.stream_writer(f, closefd=False) as w:
                for line in lines:
                    w.write(line)
            return
        frame: list[bytes] = []
        size = 0
        for line in lines:
            frame.append(line)
            size += len(line)
            if size >= frame_bytes:
                f.write(compressor.compress(b"".join(frame)))
                frame, size = [], 0
        if frame:
            f.write(compressor.compress(b"".join(frame)))


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


def resume_seconds(path: Path) -> tuple[float, int]:
    """Seconds to the first document after a resume at 90% of the file's rows."""
    state = FileIteratorState(shards=[FileShard(path=str(path), format=file_format_of(str(path)))])
    if path.name.endswith(".parquet"):
        rows = pq.ParquetFile(str(path)).metadata.num_rows
    else:
        rows = None
    it = state.build()
    target = int(0.9 * (rows or 10**12))
    n = 0
    if rows is None:  # count by reading (not timed)
        n_total = sum(1 for _ in state.build())
        target = int(0.9 * n_total)
    for _ in range(target):
        next(it)
        n += 1
    saved = it.get_state()
    it.close()
    start = time.perf_counter()
    resumed = saved.build()
    next(resumed)
    seconds = time.perf_counter() - start
    resumed.close()
    return seconds, saved.frame_offset


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
    parser.add_argument("--resume-mb", type=int, nargs="*", default=[64, 256])
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
            big = scaled_records(records, megabytes)
            paths = write_formats(big, folder)
            single = folder / "single.jsonl.zst"
            write_zst(single, [json.dumps(r).encode() + b"\n" for r in big], None)
            del big
            row = {name: resume_seconds(p)[0] for name, p in paths.items()}
            row["zst one frame"] = resume_seconds(single)[0]
            print(f"{megabytes:5d} MB uncompressed: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()), flush=True)  # fmt: skip
            for p in [*paths.values(), single]:
                p.unlink()
        print("\nelastic re-shard (space patching, global batch 16 rows, 3 steps in)")
        for src, dst in ((4, 2), (2, 4)):
            moved, same = elastic_seconds(tmp / "data", src, dst)
            print(f"{src} -> {dst} ranks: {moved:.2f} s for all ranks' first batch "
                  f"(same-size resume at {src}: {same:.2f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
