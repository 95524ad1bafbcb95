"""`python -m apps.compare launcher=slurm`: the runs of each phase go to the test cluster as one
job array written by the project's launcher, and the recipe collects them into its table.

Skips without SLURM (scripts/ci_slurm_setup.sh installs it; CI sets BYTELATENT_REQUIRE_SLURM=1)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT, child_env
from slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 (the fixture)

from tests.limits import hang_limit

# the fewest runs that still make two arrays (the sweep, then the seeds) of two rows: one rate each
# (the sweep's choice is tested locally, tests/apps/test_compare.py)
ROWS = """rows:
  lm:
    config: configs/entropy_debug.yaml
    lrs: [4.0e-3]
    overrides: [entropy_model.dim=52, entropy_model.n_heads=2, entropy_model.multiple_of=16,
                entropy_model.max_seqlen=256, entropy_model.sliding_window=256,
                distributed.model_dtype=fp32]
  blt_static:
    config: configs/debug.yaml
    patching: static
    lrs: [4.0e-3]
    overrides: [model.n_layers_local_decoder=1, model.dim_local_encoder=32,
                model.dim_local_decoder=32, model.n_heads_local_encoder=2,
                model.n_heads_local_decoder=2, model.cross_attn_nheads=2, model.multiple_of=16,
                model.n_heads=2, distributed.model_dtype=fp32]
    size_key: model.dim
    size_values: [76, 80, 84, 88, 92]
"""


@pytest.mark.slow
@pytest.mark.slurm
def test_compare_runs_as_a_slurm_array(slurm_cluster: SlurmCluster, corpus_root, tmp_path: Path):
    # two rows of the quick preset: drop its rows (null replaces a dict), then give two
    base = tmp_path / "base.yaml"
    base.write_text(f"config: {REPO_ROOT / 'configs' / 'compare_quick.yaml'}\nrows: null\n")
    config = tmp_path / "two_rows.yaml"
    config.write_text(f"config: {base}\n{ROWS}")
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "apps.compare", f"config={config}", f"out_dir={out}",
        f"data_root={corpus_root}", "launcher=slurm", "poll_s=1", "repeat_check=false",
        f"slurm.workdir={REPO_ROOT}", f"slurm.python={sys.executable}", "slurm.cpus_per_task=1",
    ]  # fmt: skip
    res = subprocess.run(
        cmd, cwd=REPO_ROOT, env=child_env(slurm_cluster.env()), capture_output=True, text=True,
        timeout=hang_limit(600),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + slurm_cluster.logs()
    arrays = re.findall(r"submitted (\d+) run\(s\) as SLURM array job (\d+)", res.stdout)
    assert [n for n, _ in arrays] == ["2", "2"], res.stdout  # the sweep, then one more seed each
    for _, job_id in arrays:
        assert slurm_cluster.job(job_id + "_0").get("JobState") in (None, "COMPLETED")
    rows = {r["row"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    assert list(rows) == ["lm", "blt_static"]
    for r in rows.values():
        assert r["seeds"] == [0, 1] and len(r["lr_sweep"]) == 1 and r["lr"] == 4.0e-3
        assert abs(r["flops_ratio"] - 1) <= 0.03
    again = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(slurm_cluster.env()),
                           capture_output=True, text=True, timeout=hang_limit(300))  # fmt: skip
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-2000:]
