"""`python -m apps.compare`: the quick preset end to end (every row, matched FLOPs, the same bpb for
the same seed, the rerun, a changed config), and the pieces it is built from."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

from apps.compare.__main__ import check_config, middle_first
from apps.compare.args import CompareArgs
from apps.compare.report import at_step, cumulative, mean_std
from apps.compare.sizing import size_rows
from apps.compare.splits import write_splits
from bytelatent.config import parse_args
from bytelatent.errors import ConfigError
from tests.limits import hang_limit
from tests.paths import REPO

CPU = f"config={REPO / 'configs' / 'compare_cpu.yaml'}"
QUICK = f"config={REPO / 'configs' / 'compare_quick.yaml'}"
ROWS = ["lm", "blt_entropy", "blt_space", "blt_static", "hnet_1stage", "hnet_2stage"]


def run_compare(argv: list[str], config: str = QUICK) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "apps.compare", config, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(900)
    )


def preset_config(tmp_path, rows: dict[str, list[float] | None], **keys) -> str:
    """A test-only preset: configs/compare_quick.yaml with some of its rows (the shipped ones,
    read from compare_cpu.yaml; each with its own lrs, or None for the preset's) and `keys` set;
    the `config=` argument."""
    shipped = yaml.safe_load((REPO / "configs" / "compare_cpu.yaml").read_text())["rows"]
    for name, lrs in rows.items():
        if lrs is not None:
            shipped[name]["lrs"] = lrs
    base = tmp_path / "base.yaml"  # rows: null drops the quick preset's rows (a dict is merged)
    base.write_text(f"config: {REPO / 'configs' / 'compare_quick.yaml'}\nrows: null\n")
    config = tmp_path / "preset.yaml"
    body = {"config": str(base), **keys, "rows": {n: shipped[n] for n in rows}}
    config.write_text(yaml.safe_dump(body, sort_keys=False))
    return f"config={config}"


@pytest.mark.slow
def test_quick_preset_end_to_end_rerun_and_changed_config(tmp_path, corpus_root):
    """The quick preset's recipe on three rows with the fewest runs that still take every path:
    the byte LM (the reference) swept over 2 rates and trained twice (determinism); the entropy
    BLT (its entropy model, threshold, on-the-fly patching; calibrated: its patches come out
    shorter than on the threshold's sample) and the 1-stage H-Net (its router's chunks at 6 steps
    need not hold the target: matched or reported off, never silently) at one rate each.
    Every row of the quick preset is sized within 3% in test_sizing_matches_every_row...; CI's
    doc-command runner trains the whole quick preset (docs/compare.md)."""
    rows = {"lm": [2.0e-3, 4.0e-3], "blt_entropy": [4.0e-3], "hnet_1stage": [4.0e-3]}
    config = preset_config(tmp_path, rows)
    out = tmp_path / "compare"
    argv = [f"out_dir={out}", f"data_root={corpus_root}"]
    res = run_compare(argv, config)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((out / "compare.json").read_text())
    by_row = {r["row"]: r for r in result["rows"]}
    assert list(by_row) == list(rows)
    for r in by_row.values():
        # matched on the runs' own counts (calibrated where the counts moved), or said so
        assert r["flops_matched"] == (abs(r["flops_ratio"] - 1) <= 0.03), r["row"]
        warned = any(f"WARNING: {r['row']} trained at" in line for line in result["checks"])
        assert warned == (not r["flops_matched"]), (r["row"], result["checks"])
        assert r["seeds"] == [0, 1] and len(r["val_bpb"]) == 2
        assert len(r["lr_sweep"]) == len(rows[r["row"]])
        assert all(math.isfinite(v) and 0 < v < 20 for v in r["val_bpb"] + r["ood_bpb"]), r
        assert str(r["lr"]) in {str(float(x)) for x in r["lr_sweep"]}
        assert r["val_bpb"][0] != r["val_bpb"][1], f"{r['row']}: seeds gave the same bpb"
    assert abs(by_row["lm"]["flops_ratio"] - 1) <= 0.03 and by_row["lm"]["flops_matched"]
    assert any("same to 1e-6" in line for line in result["checks"]), result["checks"]
    assert "start lm" in res.stdout and "run(s) left" in res.stdout
    assert "calibration 1:" in res.stdout
    assert (out / "compare.md").exists() and (out / "compare.png").exists()

    again = run_compare(argv, config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in again.stdout and "] start " not in again.stdout
    assert json.loads((out / "compare.json").read_text())["rows"] == result["rows"]

    changed = run_compare([*argv, "steps=8"], config)
    assert changed.returncode == 2
    lines = changed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error:") and "steps" in lines[0]


def test_quick_preset_has_every_row_of_the_cpu_preset():
    """The sizing test below (CPU preset) covers the quick preset's rows: same rows, same rows
    of bytes, so the same sizes."""
    quick, cpu = (parse_args(CompareArgs, [c]) for c in (QUICK, CPU))
    assert list(quick.rows) == ROWS and quick.rows == cpu.rows
    assert quick.row_bytes == cpu.row_bytes and quick.bytes_per_patch == cpu.bytes_per_patch
    assert quick.calibration_rounds >= 1 and len(quick.seeds) >= 2 and quick.repeat_check


@pytest.fixture(scope="module")
def sized_cpu(tmp_path_factory, corpus_root):
    """The CPU preset's splits and sizes (built once: ~100 candidate models on the meta device)."""
    out = tmp_path_factory.mktemp("sized")
    argv = [CPU, f"out_dir={out}", f"data_root={corpus_root}"]
    args = parse_args(CompareArgs, argv)
    splits = write_splits(args)
    return argv, splits, size_rows(args, splits)


def test_sizing_matches_every_row_and_refuses_an_unmatchable_one(sized_cpu):
    argv, splits, sized = sized_cpu
    assert list(sized) == ROWS
    target = sized["lm"].flops_per_byte
    for s in sized.values():
        assert abs(s.flops_per_byte / target - 1) <= 0.03, s
    assert sized["blt_static"].bytes_per_patch == 4.0 and sized["hnet_2stage"].variant == "2-stage"
    args = parse_args(CompareArgs, [*argv, "rows.blt_entropy.size_values=[16]"])
    with pytest.raises(ConfigError, match="rows.blt_entropy: FLOPs per byte"):
        size_rows(args, splits)


def test_calibration_resizes_a_row_from_its_real_flops(sized_cpu):
    argv, splits, sized = sized_cpu
    args = parse_args(CompareArgs, argv)
    real = {n: s.flops_per_byte for n, s in sized.items()}
    real["hnet_1stage"] *= 0.8  # its chunks came out longer than the target: fewer FLOPs
    again = size_rows(args, splits, previous=sized, real=real)
    assert again["lm"].size == sized["lm"].size and again["blt_space"] is sized["blt_space"]
    assert again["hnet_1stage"].flops_per_byte > sized["hnet_1stage"].flops_per_byte * 1.15
    # an untrained router's chunks (~25 bytes, target 4): no width is predicted to match
    real["hnet_1stage"] = sized["hnet_1stage"].flops_per_byte * 0.4
    assert size_rows(args, splits, previous=sized, real=real)["hnet_1stage"] is sized["hnet_1stage"]


def test_splits_are_disjoint_held_out_and_out_of_domain(tmp_path, corpus_root):
    args = parse_args(CompareArgs, [CPU, f"out_dir={tmp_path}", f"data_root={corpus_root}"])
    paths = write_splits(args)
    docs = {
        s: [json.loads(x)["text"] for x in p.read_text().splitlines()] for s, p in paths.items()
    }
    assert docs["tune"] and docs["test"] and docs["ood"]
    assert not set(docs["tune"]) & set(docs["test"])
    training = "".join(p.read_text() for p in (corpus_root / "stdlib").glob("*.chunk.*.jsonl"))
    assert all(json.dumps(d)[1:200] not in training for d in docs["test"] + docs["ood"])
    assert "def " not in docs["ood"][0][:2000]  # prose, not Python
    with pytest.raises(ConfigError, match="ood_files"):
        write_splits(parse_args(CompareArgs, [CPU, f"out_dir={tmp_path / 'b'}",
                                              f"data_root={corpus_root}", "ood_files=[/nowhere]"]))  # fmt: skip


def test_a_changed_config_is_refused_in_one_line(tmp_path):
    args = parse_args(CompareArgs, [CPU, f"out_dir={tmp_path}"])
    check_config(args)
    check_config(parse_args(CompareArgs, [CPU, f"out_dir={tmp_path}", "parallel=1"]))
    refused = re.escape(f"another config (lrs: {args.lrs} ->")  # the preset's own rates
    with pytest.raises(ConfigError, match=refused):
        check_config(parse_args(CompareArgs, [CPU, f"out_dir={tmp_path}", "lrs=[0.1]"]))
    # a key a newer recipe added is no change at its default (older out_dirs lack it)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["calibration_rounds"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_config(parse_args(CompareArgs, [CPU, f"out_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"calibration_rounds: None -> 0"):
        check_config(parse_args(CompareArgs, [CPU, f"out_dir={tmp_path}", "calibration_rounds=0"]))


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="multiple of evals"):
        parse_args(CompareArgs, [CPU, "steps=10", "evals=3"])
    with pytest.raises(ConfigError, match="size_key and size_values"):
        parse_args(CompareArgs, [CPU, "rows.blt_space.size_values=[]"])
    with pytest.raises(ConfigError, match="repeats a seed"):
        parse_args(CompareArgs, [CPU, "seeds=[1, 1]"])
    with pytest.raises(ConfigError, match="static patching needs an integer"):
        parse_args(CompareArgs, [CPU, "bytes_per_patch=3.5"])


def test_flops_seconds_and_spread():
    records = [
        {"global_step": 10, "n_bytes": 100, "bytes_per_s": 50.0, "flops_per_s": 1000.0},
        {"global_step": 20, "n_bytes": 100, "bytes_per_s": 100.0, "flops_per_s": 3000.0},
    ]
    steps, flops, seconds = cumulative(records)
    assert steps == [10, 20] and flops == [2000.0, 5000.0] and seconds == [2.0, 3.0]
    assert at_step(15, steps, flops) == 3500.0 and at_step(5, steps, flops) == 1000.0
    assert mean_std([1.0, 3.0]) == (2.0, math.sqrt(2.0)) and mean_std([2.0]) == (2.0, 0.0)
    assert middle_first([1, 2, 3]) == [2, 1, 3] and middle_first([1, 2, 3, 4]) == [3, 1, 2, 4]


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_time_and_trains_nothing(tmp_path, corpus_root):
    res = run_compare(
        [f"out_dir={tmp_path}", f"data_root={corpus_root}", "dry_run=true"], config=CPU
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "sizing: every row matches lm's" in res.stdout and "h of training" in res.stdout
    assert not (tmp_path / "runs").exists()


def test_missing_corpus_is_one_line_before_anything_trains(tmp_path):
    res = run_compare([f"out_dir={tmp_path / 'out'}", f"data_root={tmp_path / 'nowhere'}"])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"data error: {tmp_path / 'nowhere' / 'stdlib'}: no such corpus folder (python -m "
        f"bytelatent.data.prepare --out {tmp_path / 'nowhere' / 'stdlib'})"
    ]
    assert not (tmp_path / "out" / "runs").exists()
