"""End to end: train an entropy model, consolidate it, precompute entropies, train a BLT on them."""

import json
import subprocess
import sys

import pytest

from tests.trainer.test_cli import REPO, TINY_BLT, TINY_ENTROPY, run_cli


@pytest.mark.slow
def test_entropy_model_to_entropy_patched_blt(tmp_path, corpus_root):
    ent = tmp_path / "entropy"
    res = run_cli(
        "bytelatent.train",
        [*TINY_ENTROPY, f"dump_dir={ent}", f"data.root_dir={corpus_root}", "steps=10"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    step_dir = ent / "checkpoints" / f"{10:010d}"
    res = run_cli("bytelatent.checkpoint", ["consolidate", str(step_dir)])
    assert res.returncode == 0, res.stderr[-3000:]
    consolidated = step_dir / "consolidated"

    # a small raw source in the reference layout: {root}/{source}/{source}.chunk.NN.jsonl
    raw = tmp_path / "raw" / "stdlib"
    raw.mkdir(parents=True)
    lines = (corpus_root / "stdlib" / "stdlib.chunk.00.jsonl").read_text().splitlines()
    docs = [json.loads(line) for line in lines[:12]]
    with open(raw / "stdlib.chunk.00.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"sample_id": doc["sample_id"], "text": doc["text"][:3000]}) + "\n")
    pre = tmp_path / "preprocessed"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.preprocess_entropies",
            "--input",
            str(raw / "stdlib.chunk.00.jsonl"),
            "--output-dir",
            str(pre),
            "--entropy-model",
            str(consolidated),
            "--device",
            "cpu",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (pre / "stdlib" / "transformer_100m" / "stdlib.chunk.00.jsonl.arrow.complete").exists()

    # threshold at the median stored entropy, so that about half the bytes start a patch
    import numpy as np
    import pyarrow as pa

    with pa.memory_map(
        str(pre / "stdlib" / "transformer_100m" / "stdlib.chunk.00.jsonl.arrow")
    ) as source:
        table = pa.ipc.open_file(source).read_all()
    entropies = np.concatenate(
        [np.asarray(e, dtype=np.float32) for e in table.column("entropies").to_pylist()]
    )
    threshold = float(np.median(entropies))

    blt = tmp_path / "blt"
    res = run_cli(
        "bytelatent.train",
        [
            *TINY_BLT,
            f"dump_dir={blt}",
            f"data.root_dir={tmp_path / 'raw'}",
            f"data.preprocess_dir={pre}",
            "data.patcher_args.patching_mode=entropy",
            f"data.patcher_args.threshold={threshold}",
            "steps=6",
        ],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (blt / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["bpb"] == r["bpb"] for r in rows)

    # the batches really are entropy-patched: patch lengths vary and follow the stored entropies
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args

    args = parse_args(
        TrainArgs,
        [
            *TINY_BLT,
            f"dump_dir={blt}",
            f"data.root_dir={tmp_path / 'raw'}",
            f"data.preprocess_dir={pre}",
            "data.patcher_args.patching_mode=entropy",
            f"data.patcher_args.threshold={threshold}",
        ],
    )
    it = args.data.build_from_rank(0, 1)
    try:
        batch = next(it)
    finally:
        it.close()
    lengths = batch.patch_lengths[batch.patch_lengths > 0]
    assert len(set(lengths.tolist())) > 3
