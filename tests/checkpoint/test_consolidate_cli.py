"""`python -m bytelatent.checkpoint consolidate` end to end: output loads with torch.load and matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_worker import build, full_weights, train_step

from bytelatent.checkpoint.__main__ import main
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.manager import CheckpointManager
from tests.limits import hang_limit

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "bytelatent.checkpoint", *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )


def saved_checkpoint(
    tmp_path,
) -> tuple[str, dict[str, torch.Tensor], torch.optim.Optimizer]:
    model, optimizer = build(1, seed=4)
    train_step(model, optimizer, 1, 0, 1)
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))
    folder = manager.save(1, model, optimizer, {"step": 1}, {"model": {"dim": 16}, "seed": 4})
    return folder, full_weights(model), optimizer


def test_cli_consolidate_outputs_loadable_weights(tmp_path):
    folder, want, _ = saved_checkpoint(tmp_path)
    out = str(tmp_path / "released")
    proc = run_cli("consolidate", folder, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == out
    # --progress auto off a terminal: no bar, one line as the reading starts (a long read then
    # prints a line every LINE_EVERY_S)
    reading = [line for line in proc.stderr.splitlines() if "consolidate: reading" in line]
    assert reading == ["consolidate: reading: started"], proc.stderr
    assert sorted(os.listdir(out)) == ["consolidated.pth", "params.json"]
    with open(os.path.join(out, "params.json")) as f:
        assert json.load(f) == {"model": {"dim": 16}, "seed": 4}
    payload = torch.load(os.path.join(out, "consolidated.pth"), weights_only=True)
    assert list(payload) == ["model"]  # no optimizer unless asked
    assert payload["model"].keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(payload["model"][key], value), key


def test_consolidate_default_location_and_optimizer(tmp_path):
    folder, want, optimizer = saved_checkpoint(tmp_path)
    out = consolidate(folder, with_optim=True)
    assert out == os.path.join(folder, "consolidated")
    payload = torch.load(os.path.join(out, "consolidated.pth"), weights_only=True)
    exp_avg = payload["optim"]["state"]["out.weight"]["exp_avg"]
    out_param = dict(build(1)[0].named_parameters())["out.weight"]
    assert exp_avg.shape == out_param.shape
    live = [s["exp_avg"] for s in optimizer.state.values() if s["exp_avg"].shape == exp_avg.shape]
    assert any(torch.equal(exp_avg, t) for t in live)
    assert torch.equal(payload["model"]["emb.weight"], want["emb.weight"])


def test_cli_errors_are_one_line(tmp_path, capsys):
    # In-process main() (the subprocess wiring is covered above): exit code 2 and one line.
    folder, _, _ = saved_checkpoint(tmp_path)
    os.makedirs(tmp_path / "empty")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "ck"): "holds step folders, pass one of them",
        str(tmp_path / "empty"): "no .metadata",
    }
    for path, message in cases.items():
        assert main(["consolidate", path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("checkpoint error: ") and message in err[0], err
    assert main(["consolidate", folder, "--with-optim"]) == 0
    payload = torch.load(os.path.join(folder, "consolidated", "consolidated.pth"))
    assert set(payload) == {"model", "optim"}


def test_consolidate_progress_bar_counts_every_stored_byte(tmp_path, capsys):
    pytest.importorskip("tqdm")
    folder, _, _ = saved_checkpoint(tmp_path)
    consolidate(folder, str(tmp_path / "out"), with_optim=True, progress="on")
    err = capsys.readouterr().err
    assert "consolidate: reading" in err and "100%" in err, err
