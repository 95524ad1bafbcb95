"""Precompute next-byte entropies with a trained entropy model (what entropy patching reads).

    python -m apps.preprocess_entropies --input DATA/ds.chunk.*.jsonl --output-dir PREPROCESS \\
        --entropy-model CKPT_DIR [--entropy-model-name transformer_100m] [--device auto|cpu|cuda]
        [--batch-size 32] [--rank R --world-size W] [--dataset NAME] [--overwrite]

Inputs are JSONL (optionally compressed: ``.jsonl.zst``, ``.jsonl.gz``), Parquet or Arrow IPC
files, local or any fsspec URL (``s3://...``); a directory means the ``*.jsonl*`` / ``*.arrow`` /
``*.parquet`` files in it. Parquet and compressed JSONL are read with the training loader's readers
(only the needed columns; a corrupt footer or a truncated stream is one data error). Each
input file becomes one output shard (layout of the reference, §1.6)::

    {output_dir}/{dataset}/{entropy_model_name}/{input name}.arrow        Arrow IPC *file*
    {output_dir}/{dataset}/{entropy_model_name}/{input name}.arrow.complete

with columns ``sample_id`` (string, non-null), ``text`` (string) and ``entropies``
(list<float16>, one value per token of ``BltTokenizer`` with BOS and EOS, in nats). ``dataset``
is ``--dataset`` or, as in the reference, the part of the name before ``.chunk.NN.jsonl`` (else
the input's folder name); an input named ``ds.chunk.00.jsonl.shard_03`` therefore lands where
the reference data loader looks for it. ``sample_id`` is the first of sample_id, title, qid,
paper_id, path, url, id that a row has, else ``{input name}:{row number}``; text is ``text`` or
``content``.

Rules:

- Entropies are computed per document: documents batched together never see each other, and a
  document longer than the model's window (``max_seqlen``, or ``--max-length``) is cut into
  consecutive windows whose context restarts at each boundary, exactly as the reference does.
- Resumable: a shard whose ``.complete`` marker exists is skipped. A shard is written to
  ``{name}.arrow.partial``, renamed to ``{name}.arrow`` when complete, then marked; an
  interrupted shard never has a marker and is redone on the next run.
- Splittable: inputs are sorted and input ``i`` goes to rank ``i % world_size``. ``--rank`` and
  ``--world-size`` default to RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS, else 0/1, so the
  same command can run under torchrun, srun or a job array (pass them explicitly there).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import posixpath
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import torch
from torch import nn

from bytelatent.checkpoint.pretrained import load_entropy_model
from bytelatent.data.entropy import (
    document_entropies,
    model_max_length,
    resolve_device,
)
from bytelatent.data.iterators.file import FileIteratorState, FileShard
from bytelatent.data.readers import format_of as file_format_of
from bytelatent.errors import ConfigError, DataError, UserError
from bytelatent.progress import PROGRESS_MODES, Progress
from bytelatent.tokenizers.blt import BltTokenizer

logger = logging.getLogger("preprocess_entropies")

SAMPLE_ID_KEYS = ("sample_id", "title", "qid", "paper_id", "path", "url", "id")
TEXT_KEYS = ("text", "content")
INPUT_SUFFIXES = (
    ".jsonl", ".json", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".arrow", ".parquet"
)  # fmt: skip
LOADER_FORMATS = ("parquet", "zst", "gz")  # read with the training loader's readers
SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("entropies", pa.list_(pa.float16())),
    ]
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Document:
    sample_id: str
    text: str


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m apps.preprocess_entropies",
        description="Write Arrow shards of per-byte entropies for entropy patching.",
    )
    parser.add_argument("--input", nargs="+", required=True, help="files, dirs or globs")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--entropy-model", required=True, help="checkpoint directory")
    parser.add_argument(
        "--entropy-model-name",
        default="transformer_100m",
        help="output subfolder; must match data.entropy_model_name (default as there)",
    )
    parser.add_argument("--dataset", default=None, help="override the dataset folder name")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--batch-size", type=int, default=32, help="windows per forward")
    parser.add_argument("--max-length", type=int, default=None, help="window length")
    parser.add_argument(
        "--docs-per-chunk",
        type=int,
        default=1000,
        help="documents per Arrow record batch",
    )
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--overwrite", action="store_true", help="redo complete shards")
    parser.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="a progress bar per shard: auto (only on a terminal), on, off",
    )
    parser.add_argument("--no-progress", action="store_true", help="same as --progress off")
    args = parser.parse_args(argv)
    if args.no_progress:
        args.progress = "off"
    for name in ("batch_size", "docs_per_chunk", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} must be >= 1")
    args.rank, args.world_size = _rank_and_world(args.rank, args.world_size)
    return args


def _rank_and_world(rank: int | None, world: int | None) -> tuple[int, int]:
    env = os.environ
    if world is None:
        world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
    if rank is None:
        rank = int(env.get("RANK") or env.get("SLURM_PROCID") or 0)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"--rank={rank} must be in [0, --world-size={world})")
    return rank, world


def _is_input_file(name: str) -> bool:
    return name.endswith(INPUT_SUFFIXES) or re.search(r"\.jsonl\.shard_\d+$", name) is not None


def discover_inputs(patterns: Sequence[str]) -> list[str]:
    """Expand files, directories and globs to a sorted list of URLs (protocol kept)."""
    found: set[str] = set()
    for pattern in patterns:
        fs, path = fsspec.core.url_to_fs(pattern)
        protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
        if fs.isdir(path):
            names = [p for p in fs.ls(path, detail=False) if _is_input_file(p)]
        elif any(ch in path for ch in "*?["):
            names = fs.glob(path)
        elif fs.exists(path):
            names = [path]
        else:
            raise DataError(f"{pattern}: input not found")
        if not names:
            raise DataError(f"{pattern}: no .jsonl or .arrow inputs there")
        found.update(protocol + name if protocol else name for name in names)
    return sorted(found)


def input_name(path: str) -> str:
    name = posixpath.basename(path.rstrip("/"))
    return name.removesuffix(".arrow")


def dataset_name(path: str) -> str:
    """Reference rule: the part before .chunk.NN.jsonl; else the input's folder name."""
    match = re.match(r"(.+)\.chunk\.\d+\.jsonl", posixpath.basename(path))
    if match:
        return match.group(1)
    return posixpath.basename(posixpath.dirname(path.rstrip("/"))) or "dataset"


def output_path(output_dir: str, dataset: str, model_name: str, path: str) -> str:
    return posixpath.join(output_dir.rstrip("/"), dataset, model_name, input_name(path) + ".arrow")


def _document(row: dict, where: str, fallback_id: str) -> Document:
    text = next((row[key] for key in TEXT_KEYS if key in row), None)
    if not isinstance(text, str):
        raise DataError(f"{where}: no string 'text' or 'content' field (keys: {sorted(row)[:8]})")
    sample_id = next((row[key] for key in SAMPLE_ID_KEYS if row.get(key) is not None), fallback_id)
    return Document(sample_id=str(sample_id), text=text)


def read_jsonl(path: str) -> Iterator[Document]:
    name = input_name(path)
    with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield _document(row, where, f"{name}:{line_number}")


def read_arrow(path: str) -> Iterator[Document]:
    name = input_name(path)
    with fsspec.open(path, "rb") as handle:
        try:
            reader = pa.ipc.open_file(handle)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            handle.seek(0)
            try:
                batches = iter(pa.ipc.open_stream(handle))
            except pa.ArrowInvalid as exc:
                raise DataError(f"{path}: not an Arrow IPC file or stream ({exc})") from None
        row_number = 0
        for batch in batches:
            for row in batch.to_pylist():
                row_number += 1
                yield _document(row, f"{path}: row {row_number}", f"{name}:{row_number}")


def read_with_loader(path: str) -> Iterator[Document]:
    """Parquet and compressed JSONL, through the training loader's readers (same columns, same
    sample ids, same one-line errors for a corrupt footer or a truncated stream)."""
    shard = FileShard(path=path, format=file_format_of(path))
    with FileIteratorState(shards=[shard]).build() as documents:
        for doc in documents:
            yield Document(sample_id=doc.sample_id, text=doc.text)


def read_documents(path: str) -> Iterator[Document]:
    if file_format_of(path) in LOADER_FORMATS:
        return read_with_loader(path)
    return read_arrow(path) if path.endswith(".arrow") else read_jsonl(path)


def _chunks(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def entropies_batch(
    docs: list[Document],
    model: nn.Module,
    tokenizer: BltTokenizer,
    batch_size: int,
    max_length: int | None,
) -> pa.RecordBatch:
    """One Arrow record batch of the schema above for ``docs``."""
    tokens = [torch.from_numpy(tokenizer.encode_array(doc.text)) for doc in docs]
    values = document_entropies(tokens, model, batch_size, max_length=max_length)
    flat = np.concatenate([v.numpy() for v in values]).astype(np.float16)
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([v.numel() for v in values], out=offsets[1:])
    entropies = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.float16()))
    return pa.RecordBatch.from_arrays(
        [
            pa.array([doc.sample_id for doc in docs], type=pa.string()),
            pa.array([doc.text for doc in docs], type=pa.string()),
            entropies,
        ],
        schema=SCHEMA,
    )


def process_shard(
    path: str,
    out: str,
    model: nn.Module,
    tokenizer: BltTokenizer,
    args: argparse.Namespace,
) -> int:
    """Write ``out`` (via ``out.partial``) and its ``.complete`` marker; returns #documents."""
    fs, out_local = fsspec.core.url_to_fs(out)
    partial = out_local + ".partial"
    marker = out_local + ".complete"
    fs.makedirs(posixpath.dirname(out_local), exist_ok=True)
    if fs.exists(marker):  # --overwrite: drop the marker first so a crash leaves none
        fs.rm(marker)
    progress = Progress(input_name(path), unit="doc", mode=args.progress)
    n_docs = 0
    try:
        with (
            fs.open(partial, "wb") as handle,
            pa.ipc.new_file(handle, SCHEMA) as writer,
        ):
            for chunk in _chunks(read_documents(path), args.docs_per_chunk):
                batch = entropies_batch(chunk, model, tokenizer, args.batch_size, args.max_length)
                writer.write_batch(batch)
                n_docs += len(chunk)
                progress.update(len(chunk))
        fs.mv(partial, out_local)
        fs.touch(marker)
    except BaseException:
        if fs.exists(partial):
            fs.rm(partial)
        raise
    finally:
        progress.close()
    return n_docs


def _model_device(name: str) -> torch.device:
    return resolve_device(name)  # cuda without an index: this rank's GPU (LOCAL_RANK)


def run(args: argparse.Namespace) -> dict[str, int]:
    """Process this rank's inputs; returns counts of shards written / skipped and docs."""
    inputs = discover_inputs(args.input)
    mine = [path for i, path in enumerate(inputs) if i % args.world_size == args.rank]
    todo: list[tuple[str, str]] = []
    skipped = 0
    for path in mine:
        dataset = args.dataset or dataset_name(path)
        out = output_path(args.output_dir, dataset, args.entropy_model_name, path)
        fs, out_local = fsspec.core.url_to_fs(out)
        if not args.overwrite and fs.exists(out_local + ".complete"):
            skipped += 1
            continue
        todo.append((path, out))
    logger.info(
        "rank %d/%d: %d of %d inputs, %d already complete",
        args.rank,
        args.world_size,
        len(mine),
        len(inputs),
        skipped,
    )
    counts = {"written": 0, "skipped": skipped, "documents": 0}
    if not todo:
        return counts
    model = load_entropy_model(args.entropy_model, _model_device(args.device), DTYPES[args.dtype])
    logger.info(
        "entropy model on %s, window %d tokens",
        next(model.parameters()).device,
        args.max_length or model_max_length(model),
    )
    tokenizer = BltTokenizer(add_bos=True, add_eos=True)
    for path, out in todo:
        counts["documents"] += process_shard(path, out, model, tokenizer, args)
        counts["written"] += 1
        logger.info("wrote %s", out)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        counts = run(parse_args(argv))
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2
    logger.info(
        "done: %d shards written, %d skipped, %d documents",
        counts["written"],
        counts["skipped"],
        counts["documents"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
