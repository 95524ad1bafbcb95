"""In-loop and before-training validation, the standalone eval CLI, and bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.test_cli import TINY_BLT, run_cli


def eval_lines(dump_dir: Path) -> list[dict]:
    path = dump_dir / "metrics.eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def debug_run(blt_200_run) -> Path:
    """configs/debug.yaml (tiny widths) for 200 steps with validation every 50 and before training
    (tests/conftest.py: BLT_200_LOOP, one run per test session)."""
    return blt_200_run


@pytest.mark.slow  # a 200-step training run with evaluations (end to end)
def test_loop_eval_logs_val_bpb_at_0_50_100_150_200_and_it_falls(debug_run):
    rows = eval_lines(debug_run)
    assert [r["global_step"] for r in rows] == [0, 50, 100, 150, 200]
    assert [r["eval_mode"] for r in rows] == ["before_training"] + ["loop"] * 4
    for row in rows:
        for key in ("val/bpb", "val/loss", "val/n_bytes", "val/stdlib/bpb", "eval_time_s"):
            assert key in row, key
        assert row["val/bpb"] == row["val/stdlib/bpb"]  # one source
        assert row["val/n_bytes"] == rows[0]["val/n_bytes"] > 0  # the same batches every time
    bpb = [r["val/bpb"] for r in rows]
    assert bpb[-1] < bpb[0] - 1.0 and bpb[-1] < bpb[1], bpb
    # in-loop evaluation does not count as training: the training metrics are untouched by it
    train_steps = [
        json.loads(x)["global_step"] for x in (debug_run / "metrics.jsonl").read_text().splitlines()
    ]
    assert train_steps == [50, 100, 150, 200]


@pytest.mark.slow  # a 200-step training run with evaluations (end to end)
def test_standalone_eval_matches_the_in_loop_eval(debug_run, tmp_path):
    in_loop = eval_lines(debug_run)[-1]
    out = tmp_path / "out"
    res = run_cli(
        "bytelatent.eval", [f"ckpt={debug_run / 'checkpoints' / '0000000200'}", f"dump_dir={out}"]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["global_step"] == 200 and results["eval_mode"] == "standalone"
    assert abs(results["val/bpb"] - in_loop["val/bpb"]) <= 1e-6, (
        results["val/bpb"],
        in_loop["val/bpb"],
    )
    assert results["val/n_bytes"] == in_loop["val/n_bytes"]
    lines = [line for line in res.stdout.splitlines() if line.startswith("eval step 200")]
    assert len(lines) == 1 and "val/bpb" in lines[0] and str(out / "results.json") in lines[0]


@pytest.mark.slow  # a 200-step training run with evaluations (end to end)
def test_standalone_eval_overrides_and_per_source_keys(debug_run, corpus_root, tmp_path):
    held_out = tmp_path / "held_out.jsonl"  # the same documents as stdlib's val file, renamed
    held_out.write_bytes((corpus_root / "stdlib" / "stdlib.val.jsonl").read_bytes())
    out = tmp_path / "out"
    res = run_cli("bytelatent.eval", [
        f"ckpt={debug_run / 'checkpoints' / '0000000200'}", f"dump_dir={out}",
        f"eval.validation.sources=[stdlib,{held_out}]", "eval.validation.max_batches=2",
        "eval.validation.batch_size=1", "eval.progress=true",
    ])  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["val/stdlib/bpb"] == results["val/held_out/bpb"]
    assert results["val/n_bytes"] == 2 * results["val/stdlib/n_bytes"]
    assert results["val/bpb"] == pytest.approx(results["val/stdlib/bpb"], rel=1e-12)
    assert "val stdlib" in res.stderr  # the tqdm bar, asked for


def test_missing_validation_source_is_a_data_error_before_training(tmp_path, corpus_root):
    dump = tmp_path / "run"
    res = run_cli("bytelatent.train", [
        *TINY_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=5", "eval.every=5",
        "eval.validation.sources=[no_such_source.val.jsonl]",
    ])  # fmt: skip
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("data error: eval.validation:"), res.stderr
    assert "no_such_source.val.jsonl" in err[0]
    assert not (dump / "metrics.jsonl").exists()  # nothing trained


def test_bad_eval_config_is_one_line(tmp_path):
    res = run_cli("bytelatent.train", [*TINY_BLT, f"dump_dir={tmp_path}", "eval.tasks=[nope]"])
    assert res.returncode == 2 and res.stderr.startswith("config error: eval.tasks"), res.stderr
    res = run_cli("bytelatent.eval", [f"ckpt={tmp_path / 'missing'}", f"dump_dir={tmp_path}"])
    assert res.returncode == 2 and res.stderr.startswith("checkpoint error:"), res.stderr


@pytest.mark.slow  # 50 training steps with evaluations
def test_early_stop_acts_on_val_bpb(tmp_path, corpus_root):
    dump = tmp_path / "run"
    # min_delta 100: no evaluation after the first can improve, so patience 1 stops at the second
    res = run_cli("bytelatent.train", [
        *TINY_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=50", "eval.every=5",
        "eval.before_training=true", "eval.validation.max_batches=2",
        "actions=[{kind: early_stop, metric: val/bpb, patience: 1, min_delta: 100}]",
    ])  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["global_step"] for r in eval_lines(dump)] == [0, 5]
    assert (dump / "checkpoints" / f"{5:010d}" / ".complete").exists()
    assert "early stop at step 5: val/bpb" in res.stdout


@pytest.mark.slow  # a 200-step training run with evaluations (end to end)
def test_standalone_eval_of_a_consolidated_folder_gives_the_same_bpb(debug_run, tmp_path):
    from bytelatent.checkpoint.__main__ import main as checkpoint_main

    step_dir = debug_run / "checkpoints" / "0000000200"
    # in this process (tests/checkpoint/test_consolidate_cli.py runs the command); into the step
    # folder, the default, whose name gives the evaluation its step
    assert checkpoint_main(["consolidate", str(step_dir)]) == 0
    res = run_cli("bytelatent.eval", [f"ckpt={step_dir / 'consolidated'}", f"dump_dir={tmp_path}"])
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["global_step"] == 200
    assert abs(results["val/bpb"] - eval_lines(debug_run)[-1]["val/bpb"]) <= 1e-6
