"""Write the default corpus as JSONL shards: `python -m bytelatent.data.prepare --out data/stdlib`.

Layout (the reference's `{root}/{source}/{source}.chunk.NN.jsonl` plus `{source}.val.jsonl`):

    DIR/stdlib.chunk.00.jsonl ... stdlib.chunk.{N-1}.jsonl   training documents, round-robin
    DIR/stdlib.val.jsonl                                     validation documents
    DIR/stdlib.complete                                      manifest, written last

so a config with `data.root_dir=data` and `data.sources={stdlib: 1.0}` reads it. Every file is
written to a temporary name and renamed; the manifest lists each file's size and is written last,
so a run that is interrupted leaves no manifest and the next run rebuilds. When a complete
manifest matches the files on disk, nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bytelatent.data.corpus import CorpusDocument, split_documents, stdlib_documents


def _write_jsonl(path: Path, docs: list[CorpusDocument]) -> int:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"sample_id": doc.sample_id, "text": doc.text}, ensure_ascii=False))
            f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def manifest_path(out: Path, name: str) -> Path:
    return out / f"{name}.complete"


def is_complete(out: Path, name: str) -> bool:
    """True when the manifest exists and every file it lists has the recorded size."""
    marker = manifest_path(out, name)
    if not marker.is_file():
        return False
    try:
        manifest = json.loads(marker.read_text())
        return all(
            (out / f).is_file() and (out / f).stat().st_size == size
            for f, size in manifest["files"].items()
        )
    except (ValueError, KeyError, OSError):
        return False


def prepare(
    out: Path,
    name: str = "stdlib",
    chunks: int = 4,
    max_mb: float = 8.0,
    val_fraction: float = 0.05,
) -> dict:
    """Write the shards unless already complete; returns the manifest."""
    if is_complete(out, name):
        return json.loads(manifest_path(out, name).read_text()) | {"already_prepared": True}
    out.mkdir(parents=True, exist_ok=True)
    manifest_path(out, name).unlink(missing_ok=True)
    docs = stdlib_documents(max_bytes=int(max_mb * 1_000_000))
    train, val = split_documents(docs, val_fraction)
    if len(train) < chunks or not val:
        raise SystemExit(
            f"prepare: only {len(train)} train / {len(val)} validation documents; raise --max-mb"
        )
    files = {}
    for chunk in range(chunks):
        filename = f"{name}.chunk.{chunk:02d}.jsonl"
        files[filename] = _write_jsonl(out / filename, train[chunk::chunks])
    files[f"{name}.val.jsonl"] = _write_jsonl(out / f"{name}.val.jsonl", val)
    manifest = {
        "files": files,
        "n_train_docs": len(train),
        "n_val_docs": len(val),
        "python": sys.version.split()[0],
    }
    tmp = manifest_path(out, name).with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path(out, name))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], prog="python -m bytelatent.data.prepare"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="output directory, e.g. data/stdlib"
    )
    parser.add_argument("--name", default="stdlib", help="file name prefix (the source name)")
    parser.add_argument("--chunks", type=int, default=4, help="number of training shards")
    parser.add_argument("--max-mb", type=float, default=8.0, help="corpus size budget in MB")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.chunks < 1 or not 0 < args.val_fraction < 1:
        parser.error("--chunks must be >= 1 and --val-fraction in (0, 1)")
    manifest = prepare(args.out, args.name, args.chunks, args.max_mb, args.val_fraction)
    total = sum(manifest["files"].values()) / 1e6
    if manifest.get("already_prepared"):
        print(
            f"{args.out}: already prepared ({len(manifest['files'])} files, {total:.1f} MB); nothing to do"
        )
    else:
        print(
            f"{args.out}: wrote {len(manifest['files'])} files, {total:.1f} MB "
            f"({manifest['n_train_docs']} train / {manifest['n_val_docs']} validation documents)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
