"""A 2-rank tensor-parallel training run (the README's TP line, 3 steps) trains and prints no
torch warning: the known-safe ones are filtered where they arise (distributed/parallelize.py,
distributed/clip.py), so any warning that shows up here is new and worth reading."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.limits import hang_limit
from tests.paths import REPO


@pytest.mark.slow
def test_tp_run_trains_without_torch_warnings(tmp_path, corpus_root):
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "bytelatent.train", "config=configs/entropy_debug.yaml", f"dump_dir={tmp_path}",
        f"data.root_dir={corpus_root}", "distributed.tp_size=2", "distributed.dp_shard=1",
        "steps=3", "logging.freq=1", "eval.every=0", "checkpoint.dump.every=0",
    ]  # fmt: skip
    res = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=hang_limit(300),
        env=env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step      3" in res.stdout + res.stderr
    noise = [line for line in res.stderr.splitlines() if "Warning" in line or "]:W" in line]
    assert noise == [], "\n".join(noise)
