"""Data-loader throughput: packed bytes/s and batches/s, in one process and with the prefetcher.

Rows (each single-process and with the prefetching worker):
  bytes    JSONL corpus, byte packing (entropy-model training), rows of seq_len_bytes
  space    JSONL corpus, space patching, rows of max_encoder_seq_length bytes
  entropy  Arrow IPC shard with stored (random) entropies, entropy patching

"packed MB/s" counts every position of x (B x L, padding included: what the model consumes);
"target MB/s" counts unmasked targets only. The corpus is the default stdlib corpus
(`python -m bytelatent.data.prepare`), written to a temporary directory unless --data is given.

    python bench/data_loader.py
    python bench/data_loader.py --batches 200 --rows bytes:sync space:async
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

# run from a checkout without installing: the repository root holds the bytelatent package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bytelatent.data.args import DataArgs  # noqa: E402
from bytelatent.data.prepare import prepare  # noqa: E402
from bytelatent.tokenizers import BltTokenizer  # noqa: E402

ROWS = ("bytes:sync", "bytes:async", "space:sync", "space:async", "entropy:sync", "entropy:async")


def make_entropy_shard(jsonl_dir: Path, out_dir: Path) -> None:
    """An Arrow shard in the entropy-preprocessing schema with random entropies (float16)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, rng = BltTokenizer(), np.random.default_rng(0)
    ids, texts, entropies = [], [], []
    for path in sorted(jsonl_dir.glob("*.chunk.*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            ids.append(record["sample_id"])
            texts.append(record["text"])
            n = len(tokenizer.encode_array(record["text"]))
            entropies.append(rng.gamma(2.0, 0.7, size=n).astype(np.float16))
    schema = pa.schema(
        [("sample_id", pa.string()), ("text", pa.string()), ("entropies", pa.list_(pa.float16()))]
    )
    table = pa.Table.from_pydict(
        {"sample_id": ids, "text": texts, "entropies": entropies}, schema=schema
    )
    shard = out_dir / "stdlib.chunk.00.jsonl.shard_00.arrow"
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in table.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
    (out_dir / (shard.name + ".complete")).touch()


def data_args(
    kind: str, data_root: Path, preprocess_dir: Path, a: argparse.Namespace, load_async: bool
) -> DataArgs:
    common = {
        "batch_size": a.batch_size,
        "buffer_size": a.buffer_size,
        "load_async": load_async,
        "prefetch_size": a.prefetch_size,
        "seed": 0,
    }
    if kind == "bytes":
        return DataArgs(
            root_dir=str(data_root),
            sources={"stdlib": 1.0},
            seq_len=a.seq_len_bytes,
            add_patches=False,
            patcher_args={"patching_mode": "byte"},
            **common,
        )
    patch = {"seq_len": a.seq_len_patches, "max_encoder_seq_length": a.max_encoder_seq_length}
    if kind == "space":
        return DataArgs(
            root_dir=str(data_root),
            sources={"stdlib": 1.0},
            patcher_args={"patching_mode": "space"},
            **patch,
            **common,
        )
    return DataArgs(
        root_dir=str(data_root),
        sources={"stdlib": 1.0},
        preprocess_dir=str(preprocess_dir),
        entropy_model_name="random_entropies",
        patcher_args={"patching_mode": "entropy", "threshold": 2.0},
        **patch,
        **common,
    )


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of this process, or of process `pid` (from /proc)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: DataArgs, batches: int, warmup: int) -> dict:
    """Wall-clock rates as seen by the consumer, and bytes per CPU-second of the producing process
    (this one, or the prefetch worker): on a shared machine the latter is the stable number."""
    it = args.build_from_rank(0, 1)
    try:
        start = time.perf_counter()
        for _ in range(warmup):
            next(it)
        first = time.perf_counter() - start
        worker = getattr(it, "worker_pid", None)
        packed = targets = 0
        cpu_start, start = cpu_seconds(worker), time.perf_counter()
        for _ in range(batches):
            batch = next(it)
            packed += batch.x.size
            targets += int(batch.mask.sum())
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(worker) - cpu_start
        state_bytes = len(it.get_state().model_dump_json())
    finally:
        it.close()
    return {
        "batches_per_s": batches / elapsed,
        "packed_MB_per_s": packed / elapsed / 1e6,
        "target_MB_per_s": targets / elapsed / 1e6,
        "packed_MB_per_cpu_s": packed / cpu / 1e6,
        "warmup_s": first,
        "shape": list(batch.x.shape),
        "state_json_bytes": state_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, help="directory holding stdlib/ (default: a temporary one)"
    )
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len-bytes", type=int, default=8192)
    parser.add_argument("--seq-len-patches", type=int, default=2048)
    parser.add_argument("--max-encoder-seq-length", type=int, default=8192)
    parser.add_argument("--buffer-size", type=int, default=64)
    parser.add_argument("--prefetch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the results here")
    a = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data_root = a.data or Path(tmp) / "data"
        prepare(data_root / "stdlib")
        preprocess_dir = Path(tmp) / "preprocess"
        if any(row.startswith("entropy") for row in a.rows):
            make_entropy_shard(data_root / "stdlib", preprocess_dir / "stdlib" / "random_entropies")
        results = {}
        for row in a.rows:
            kind, mode = row.split(":")
            results[row] = measure(
                data_args(kind, data_root, preprocess_dir, a, mode == "async"), a.batches, a.warmup
            )
            r = results[row]
            print(
                f"{row:14s} {str(r['shape']):12s} {r['batches_per_s']:8.1f} batches/s "
                f"{r['packed_MB_per_s']:7.2f} packed MB/s {r['target_MB_per_s']:7.2f} target MB/s "
                f"{r['packed_MB_per_cpu_s']:7.2f} packed MB/cpu-s "
                f"(warmup {r['warmup_s']:.1f} s, state {r['state_json_bytes']} B)",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit.stdout.strip(),
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(meta))
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
