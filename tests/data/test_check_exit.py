"""`python -m bytelatent.data.check` exits with its own code, never an abort (issue 38, item 10).

The abort ("terminate called without an active exception", rc 134, after the table) came from
Arrow freeing a Parquet column reader on one of its pool threads while the interpreter exited:
the reader held buffers read from a Python file object, and releasing them needs the GIL, which a
thread cannot take during finalization (it exits through a C++ destructor: std::terminate). It
struck about one run in four; several runs per file make a regression visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bytelatent.data.readers import ReadOptions
from bytelatent.data.readers.table import ParquetPosition, ParquetReader
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
RUNS = 4


def _files(tmp_path: Path) -> dict[str, Path]:
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.table({"text": [f"row {i}: plain text" for i in range(200)]}), clean)
    binary = tmp_path / "binary.parquet"
    raw = pa.array([bytes(range(256)) * 4] * 50, pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": raw}), binary)
    return {"clean": clean, "binary": binary}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expected"), [("clean", 0), ("binary", 1)])
def test_data_check_exits_with_its_code_every_time(tmp_path, name, expected):
    path = _files(tmp_path)[name]
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "bytelatent.data.check", f"config={REPO / 'configs' / 'debug.yaml'}",
        "data.sources={}", f"data.dataset_files={json.dumps([str(path)])}",
    ]  # fmt: skip
    codes = []
    for _ in range(RUNS):
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=hang_limit(120)
        )
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        codes.append(done.returncode)
    assert codes == [expected] * RUNS, codes


def test_parquet_reader_releases_its_buffers_on_close(tmp_path):
    """What the fix rests on: a local Parquet file is read through Arrow's own I/O (no
    Python-owned buffers), and close() lets go of the file and its reader at once."""
    path = _files(tmp_path)["clean"]
    shard = type("Shard", (), {"path": str(path), "stride": 1, "offset": 0})()
    reader = ParquetReader(shard, ParquetPosition(), ReadOptions())
    assert isinstance(reader.file, pa.NativeFile)
    assert reader.read().text == "row 0: plain text"
    reader.close()
    assert reader.file.closed and reader._batch is None
