"""End to end: a trained entropy model, consolidated; precompute entropies; train a BLT on them."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bytelatent.args import TrainArgs
from bytelatent.checkpoint.__main__ import main as checkpoint_main
from bytelatent.config import parse_args
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, TINY_BLT, run_cli


def consolidate_entropy_model(entropy_run: Path, tmp_path: Path) -> Path:
    """The session's tiny trained entropy model (tests/conftest.py), consolidated into tmp_path."""
    step_dir = entropy_run / "checkpoints" / f"{20:010d}"
    out = tmp_path / "entropy_model"
    # in this process: tests/checkpoint/test_consolidate_cli.py runs the command
    assert checkpoint_main(["consolidate", str(step_dir), "--out", str(out)]) == 0
    return out


def small_raw_source(tmp_path: Path, corpus_root: Path) -> Path:
    """12 short documents in the reference layout: {root}/{source}/{source}.chunk.NN.jsonl."""
    raw = tmp_path / "raw" / "stdlib"
    raw.mkdir(parents=True)
    lines = (corpus_root / "stdlib" / "stdlib.chunk.00.jsonl").read_text().splitlines()
    with open(raw / "stdlib.chunk.00.jsonl", "w") as f:
        for doc in map(json.loads, lines[:12]):
            f.write(json.dumps({"sample_id": doc["sample_id"], "text": doc["text"][:3000]}) + "\n")
    return raw / "stdlib.chunk.00.jsonl"


def preprocess(shard: Path, out: Path, model_dir: Path) -> Path:
    cmd = [sys.executable, "-m", "apps.preprocess_entropies", "--input", str(shard)]
    cmd += [
        "--output-dir",
        str(out),
        "--entropy-model",
        str(model_dir),
        "--device",
        "cpu",
        "--no-progress",
    ]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=hang_limit(600))
    assert res.returncode == 0, res.stderr[-3000:]
    arrow = out / "stdlib" / "transformer_100m" / "stdlib.chunk.00.jsonl.arrow"
    assert Path(f"{arrow}.complete").exists()
    return arrow


def median_entropy(arrow: Path) -> float:
    """A threshold at the median stored entropy makes about half the bytes start a patch."""
    with pa.memory_map(str(arrow)) as source:
        table = pa.ipc.open_file(source).read_all()
    values = [np.asarray(e, dtype=np.float32) for e in table.column("entropies").to_pylist()]
    return float(np.median(np.concatenate(values)))


@pytest.mark.slow
def test_entropy_model_to_entropy_patched_blt(tmp_path, corpus_root, tiny_entropy_run):
    model_dir = consolidate_entropy_model(tiny_entropy_run, tmp_path)
    shard = small_raw_source(tmp_path, corpus_root)
    pre = tmp_path / "preprocessed"
    threshold = median_entropy(preprocess(shard, pre, model_dir))

    blt = tmp_path / "blt"
    argv = [
        *TINY_BLT,
        f"dump_dir={blt}",
        f"data.root_dir={tmp_path / 'raw'}",
        f"data.preprocess_dir={pre}",
        "data.patcher_args.patching_mode=entropy",
        f"data.patcher_args.threshold={threshold}",
    ]
    res = run_cli("bytelatent.train", [*argv, "steps=6"])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (blt / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["bpb"] == r["bpb"] for r in rows)

    # the batches really are entropy-patched: patch lengths vary with the stored entropies
    it = parse_args(TrainArgs, argv).data.build_from_rank(0, 1)
    try:
        batch = next(it)
    finally:
        it.close()
    lengths = batch.patch_lengths[batch.patch_lengths > 0]
    assert len(set(lengths.tolist())) > 3
