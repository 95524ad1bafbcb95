"""Small synthetic corpora for the data-pipeline tests (imported by test modules and conftest)."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from bytelatent.data.batch import Batch


def doc_text(source: str, index: int) -> str:
    """Distinct, variable-length text (so windows cross document boundaries at many offsets)."""
    rng = np.random.default_rng(index)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta,", "eta.", "θ", "☃"]
    body = " ".join(words[i] for i in rng.integers(0, len(words), size=3 + index % 17))
    return f"<{source}:{index}> {body}"


def write_jsonl(path: Path, source: str, ids: range, extra: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in ids:
            record = {"sample_id": f"{source}-{i}", "text": doc_text(source, i)} | (extra or {})
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_arrow(
    path: Path,
    source: str,
    ids: range,
    batch_rows: int = 4,
    entropies: bool = True,
    stream: bool = False,
    seed: int = 0,
) -> Path:
    """An Arrow IPC file (or stream) in the entropy-preprocessing schema, several record batches."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    texts = [doc_text(source, i) for i in ids]
    columns = {"sample_id": [f"{source}-{i}" for i in ids], "text": texts}
    fields = [pa.field("sample_id", pa.string()), pa.field("text", pa.string())]
    if entropies:
        columns["entropies"] = [
            rng.uniform(0, 3, size=len(t.encode()) + 2).astype(np.float16) for t in texts
        ]
        fields.append(pa.field("entropies", pa.list_(pa.float16())))
    schema = pa.schema(fields)
    table = pa.Table.from_pydict(columns, schema=schema)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, opener(sink, schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


def batches_equal(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(x.equals(y) for x, y in zip(a, b))
