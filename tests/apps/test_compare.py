"""`python -m apps.compare`: a byte LM, a BLT and an H-Net at matched FLOPs per byte, end to end
(a few steps each), its rerun, and the config errors it reports before training anything."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from apps.compare.args import CompareArgs
from apps.compare.report import at_step, cumulative
from apps.compare.sizing import size_runs
from bytelatent.config import parse_args
from bytelatent.errors import ConfigError
from tests.limits import hang_limit
from tests.paths import REPO

CONFIG = f"config={REPO / 'configs' / 'compare_cpu.yaml'}"
# every run a few steps on short rows; the sizing and the tolerance as in the shipped config
TINY = ["steps=4", "evals=2", "val_batches=2", "row_bytes=64", "batch_size=2", "entropy.steps=4",
        "entropy.sample_bytes=5000"]  # fmt: skip


def run_compare(argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "apps.compare", CONFIG, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(180)
    )


@pytest.mark.slow
def test_recipe_end_to_end_and_rerun(tmp_path, corpus_root):
    out = tmp_path / "compare"
    argv = [*TINY, f"out_dir={out}", f"data_root={corpus_root}"]
    res = run_compare(argv)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]

    # the threshold is the one patch_size printed, and the BLT trained with it
    patch_size_out = (out / "patch_size.out").read_text()
    printed = float(re.search(r"^threshold=(\S+)$", patch_size_out, re.MULTILINE).group(1))
    result = json.loads((out / "compare.json").read_text())
    assert result["threshold"] == printed
    blt_argv = json.loads((out / "runs" / "blt" / "done.json").read_text())["argv"]
    assert f"data.patcher_args.threshold={printed!r}" in blt_argv
    assert "data.patcher_args.patching_mode=entropy" in blt_argv

    runs = {r["name"]: r for r in result["runs"]}
    assert sorted(runs) == ["blt", "hnet", "lm"]
    reference = runs["hnet"]["flops_per_byte"]
    for run in runs.values():
        assert abs(run["flops_per_byte"] / reference - 1) <= 0.1, run
        assert math.isfinite(run["final_val_bpb"]) and 0 < run["final_val_bpb"] < 20, run
        assert run["steps"] == [2, 4] and run["train_flops"] > 0 and run["bytes_seen"] > 0
        assert run["flops"] == sorted(run["flops"]), run
    table_rows = [
        line for line in (out / "compare.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| arch")
    ]  # fmt: skip
    assert [row.split("|")[1].strip() for row in table_rows] == ["lm", "blt", "hnet"]

    # a rerun trains nothing and says so; the report is written again
    (out / "compare.md").unlink()
    again = run_compare(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in again.stdout and "compare: training" not in again.stdout
    assert (out / "compare.md").exists()

    # a finished run is never mixed with a run of another command
    changed = run_compare([*argv, "seed=7"])
    assert changed.returncode == 2
    assert (
        changed.stderr.strip().startswith("config error:")
        and len(changed.stderr.strip().splitlines()) == 1
    )


def test_sizing_picks_the_closest_candidate_and_enforces_the_tolerance():
    args = parse_args(CompareArgs, [CONFIG])
    sized = size_runs(args)
    target = sized["hnet"].flops_per_byte
    for name in ("lm", "blt"):
        ratio = sized[name].flops_per_byte / target
        assert abs(ratio - 1) <= args.flops_tolerance, (name, ratio)
        assert sized[name].size.startswith(args.runs[name].size_key + "=")
    with pytest.raises(ConfigError, match="runs.lm: FLOPs per byte"):
        size_runs(parse_args(CompareArgs, [CONFIG, "runs.lm.size_values=[16]"]))


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="multiple of evals"):
        parse_args(CompareArgs, [CONFIG, "steps=10", "evals=3"])
    with pytest.raises(ConfigError, match="size_key and size_values"):
        parse_args(CompareArgs, [CONFIG, "runs.blt.size_values=[]"])


def test_flops_and_seconds_accumulate_over_log_intervals():
    records = [
        {"global_step": 10, "n_bytes": 100, "bytes_per_s": 50.0, "flops_per_s": 1000.0},
        {"global_step": 20, "n_bytes": 100, "bytes_per_s": 100.0, "flops_per_s": 3000.0},
    ]
    steps, flops, seconds = cumulative(records)
    assert steps == [10, 20] and flops == [2000.0, 5000.0] and seconds == [2.0, 3.0]
    assert at_step(15, steps, flops) == 3500.0 and at_step(5, steps, flops) == 1000.0


def test_missing_corpus_is_one_line_before_anything_trains(tmp_path):
    res = run_compare([f"out_dir={tmp_path / 'out'}", f"data_root={tmp_path / 'nowhere'}"])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"data error: {tmp_path / 'nowhere' / 'stdlib'}: no such corpus folder (python -m "
        f"bytelatent.data.prepare --out {tmp_path / 'nowhere' / 'stdlib'})"
    ]
    assert not (tmp_path / "out" / "runs").exists()
