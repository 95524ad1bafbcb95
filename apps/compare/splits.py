"""The three evaluation splits every run validates on, none of them trained on:

- `tune.jsonl`: the even-numbered documents of the corpus's validation file (`*.val.jsonl`,
  documents the corpus preparation kept out of the training shards): the learning rate is chosen
  on it;
- `test.jsonl`: the odd-numbered ones: the reported held-out bpb;
- `ood.jsonl`: out-of-domain text (`ood_files`, by default licences in English prose when the
  corpus is Python code), one document per file, at most `ood_bytes`.

Written once into `out_dir/splits/`; a rerun whose inputs give other files is refused (the runs
already trained were validated on the old ones).
"""

from __future__ import annotations

import glob
import json
import sysconfig
from pathlib import Path

from apps.compare.args import CompareArgs
from bytelatent.errors import ConfigError, DataError

SPLITS = ("tune", "test", "ood")


def _val_documents(args: CompareArgs) -> list[str]:
    default = Path(args.data_root) / args.source / f"{args.source}.val.jsonl"
    path = Path(args.val_file) if args.val_file else default
    if not path.exists():
        raise DataError(f"{path}: no validation file (python -m bytelatent.data.prepare --out "
                        f"{default.parent}, or set val_file)")  # fmt: skip
    if path.suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        docs = [str(t) for t in pq.read_table(path, columns=["text"]).column("text").to_pylist()]
    else:
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    if len(docs) < 2:
        raise DataError(f"{path}: {len(docs)} document(s); the tune and test splits need two")
    return docs


def ood_paths(args: CompareArgs) -> list[Path]:
    python = sysconfig.get_paths()["stdlib"]
    found: list[Path] = []
    for pattern in args.ood_files:
        found += sorted(Path(p) for p in glob.glob(pattern.replace("{python}", python)))
    return [p for p in dict.fromkeys(found) if p.is_file()]


def _ood_documents(args: CompareArgs) -> list[str]:
    docs, used = [], 0
    for path in ood_paths(args):
        text = path.read_bytes()[: args.ood_bytes - used].decode("utf-8", errors="ignore")
        if text.strip():
            docs.append(text)
            used += len(text.encode())
        if used >= args.ood_bytes:
            break
    if not docs:
        raise ConfigError(
            f"ood_files={args.ood_files}: no readable file; list some out-of-domain text files"
        )
    return docs


def _jsonl(docs: list[str], prefix: str) -> str:
    return "".join(
        json.dumps({"sample_id": f"{prefix}/{i}", "text": d}, ensure_ascii=False) + "\n"
        for i, d in enumerate(docs)
    )


def write_splits(args: CompareArgs) -> dict[str, Path]:
    """{split: file}, written into out_dir/splits/ (or checked against what is there)."""
    folder = (Path(args.out_dir) / "splits").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    val = _val_documents(args)
    texts = {
        "tune": _jsonl(val[0::2], "tune"),
        "test": _jsonl(val[1::2], "test"),
        "ood": _jsonl(_ood_documents(args), "ood"),
    }
    paths = {}
    for split, text in texts.items():
        path = folder / f"{split}.jsonl"
        if path.exists() and path.read_text() != text:
            raise ConfigError(
                f"{path} differs from what this config gives (other data or ood_files); the "
                "runs in this out_dir were validated on it: choose another out_dir"
            )
        if not path.exists():
            path.write_text(text)
        paths[split] = path
    return paths
