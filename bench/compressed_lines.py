"""Line reading from `.jsonl.zst` / `.jsonl.gz`: this tree's CompressedLines (bounded steps:
gzip output capped per call, zstd input fed in 256-byte slices) against another tree's (e.g.
main before issue 38: one decompress call per 1 MiB of input).

    python bench/compressed_lines.py [--other /path/to/other/checkout] [--mb 32]

Interleaves the variants, one warm-up pass each, and reports the median process CPU-seconds per
pass and the uncompressed MB/s (1 thread). Prints the load average (`os.getloadavg`).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import zstandard


def load_module(tree: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, tree / "bytelatent/data/readers/jsonl.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(tree))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def write_files(folder: Path, megabytes: int) -> dict[str, Path]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    lines = []
    size, i = 0, 0
    while size < megabytes << 20:
        text = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(50 + i % 400))
        line = json.dumps({"text": f"{i}: {text}"}).encode() + b"\n"
        lines.append(line)
        size += len(line)
        i += 1
    frames = [b"".join(lines[j : j + 2000]) for j in range(0, len(lines), 2000)]
    zst = folder / "b.jsonl.zst"
    compressor = zstandard.ZstdCompressor(level=3)
    zst.write_bytes(b"".join(compressor.compress(f) for f in frames))
    gz = folder / "b.jsonl.gz"
    gz.write_bytes(b"".join(gzip.compress(f, compresslevel=6) for f in frames))
    return {"zst": zst, "gz": gz}


def one_pass(module, path: Path, kind: str) -> tuple[float, int]:
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    start = time.process_time()
    lines = module.CompressedLines(str(path), kind, fs, fs_path)
    total = 0
    while line := lines.readline():
        total += len(line)
    lines.close()
    return time.process_time() - start, total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", type=Path, help="another checkout to compare with")
    parser.add_argument("--mb", type=int, default=32, help="uncompressed MB per file")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    variants = {"this tree": load_module(here, "lines_here")}
    if args.other:
        variants["other"] = load_module(args.other.resolve(), "lines_other")
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.mb)
        times: dict[tuple[str, str], list[float]] = {}
        sizes: dict[str, int] = {}
        for kind, path in files.items():
            for module in variants.values():
                one_pass(module, path, kind)  # warm-up
            for _ in range(args.repeats):
                for name, module in variants.items():
                    seconds, sizes[kind] = one_pass(module, path, kind)
                    times.setdefault((kind, name), []).append(seconds)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.mb} MB uncompressed per file")
    print(f"{'format':<6} {'variant':<10} {'CPU-s':>7} {'MB/s':>7}")
    for (kind, name), values in times.items():
        median = statistics.median(values)
        print(f"{kind:<6} {name:<10} {median:>7.3f} {sizes[kind] / median / 2**20:>7.0f}")


if __name__ == "__main__":
    main()
