"""Multi-process checkpoint tests: FSDP2 resharding (2 -> 1, 1 -> 2), async save on 2 ranks, kill -9 safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from ckpt_launch import start_ranks
from ckpt_worker import build, full_weights

from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.manager import MARKER_FILE, CheckpointManager
from tests.limits import hang_limit

pytestmark = pytest.mark.slow


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_fsdp_two_ranks_to_one_and_back(tmp_path, run_ranks):
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(2, "save", ckpt, out)
    step2 = os.path.join(ckpt, "0000000002")
    files = set(os.listdir(step2))
    assert {
        "__0_0.distcp",
        "__1_0.distcp",
        "train_state_00000.json",
        "train_state_00001.json",
    } <= files
    assert {".metadata", "params.json", MARKER_FILE} <= files
    assert read_json(os.path.join(step2, "train_state_00001.json")) == {
        "step": 2,
        "dp_rank": 1,
    }
    # 2 FSDP ranks -> 1 plain process (no process group): weights exact, next step matches.
    run_ranks(1, "load", ckpt, out)
    result = read_json(os.path.join(out, "load_world1.json"))
    assert result["dp_size_changed"] and result["saved_dp_size"] == 2
    # Consolidated output of the 2-rank save equals the gathered weights.
    released = consolidate(step2, str(tmp_path / "released"))
    payload = torch.load(os.path.join(released, "consolidated.pth"))
    expected = torch.load(os.path.join(out, "expected.pt"))["step2"]
    assert payload.keys() == {"model"}
    for key, value in expected.items():
        assert torch.equal(payload["model"][key], value), key

    # And back: 1 process saves, 2 FSDP ranks load (plus warm starts from DCP and consolidated).
    ckpt1, out1 = str(tmp_path / "ck1"), str(tmp_path / "out1")
    os.makedirs(out1)
    run_ranks(1, "save", ckpt1, out1)
    released1 = consolidate(os.path.join(ckpt1, "0000000002"), str(tmp_path / "released1"))
    run_ranks(2, "load", ckpt1, out1, "--init-from", released1)
    result = read_json(os.path.join(out1, "load_world2.json"))
    assert result["dp_size_changed"] and result["saved_dp_size"] == 1
    assert result["init_format"] == "consolidated"
    run_ranks(2, "load", ckpt1, out1, "--init-from", os.path.join(ckpt1, "0000000002"))
    assert read_json(os.path.join(out1, "load_world2.json"))["init_format"] == "dcp"


def test_async_save_two_ranks(tmp_path, run_ranks):
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(2, "save", ckpt, out, "--async")
    assert os.path.exists(os.path.join(ckpt, "0000000002", MARKER_FILE))
    run_ranks(2, "load", ckpt, out)
    result = read_json(os.path.join(out, "load_world2.json"))
    assert not result["dp_size_changed"] and result["train_state"] == {
        "step": 2,
        "dp_rank": 0,
    }


def kill_during_save(tmp_path, kill_at: str, dim: int = 16) -> tuple[str, str]:
    """Run the kill scenario, SIGKILL the worker at `kill_at`; returns (ckpt, out)."""
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "out")
    os.makedirs(out)
    (proc,) = start_ranks(1, "kill", ckpt, out, "--kill-at", kill_at, "--dim", str(dim))
    ready = os.path.join(out, "ready")
    deadline = time.monotonic() + hang_limit(90)
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"kill worker never reached {kill_at}: {proc.communicate()[0][-3000:]}")
        time.sleep(0.01)
    if kill_at == "random":
        # Kill as soon as the step-2 folder appears: somewhere inside the save.
        step2 = os.path.join(ckpt, "0000000002")
        while not os.path.exists(step2) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=hang_limit(30))
    except subprocess.TimeoutExpired:
        proc.kill()
    return ckpt, out


@pytest.mark.parametrize("kill_at", ["before_metadata", "before_marker", "random"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, kill_at):
    dim = 512 if kill_at == "random" else 16  # larger save so the kill lands mid-write
    ckpt, out = kill_during_save(tmp_path, kill_at, dim)
    manager = CheckpointManager(CheckpointArgs(path=ckpt))
    step1, step2 = manager.step_folder(1), manager.step_folder(2)
    assert os.path.isdir(step2), "the interrupted save should have started"
    completed = os.path.exists(os.path.join(step2, MARKER_FILE))
    if kill_at != "random":
        assert not completed
        assert os.path.exists(os.path.join(step2, ".metadata")) == (kill_at == "before_marker")
    expected_folder = step2 if completed else step1
    assert manager.latest_complete() == expected_folder
    model, optimizer = build(1, seed=42, dim=dim)
    train_state = manager.load(model, optimizer)
    assert train_state == {"step": 2 if completed else 1}
    if not completed:
        want = torch.load(os.path.join(out, "step1.pt"))
        for key, value in full_weights(model).items():
            assert torch.equal(value, want[key]), key
        # The next successful save removes the partial folder.
        manager.save(3, model, optimizer, {"step": 3})
        assert not os.path.exists(step2)
        assert manager.latest_complete() == manager.step_folder(3)


def test_tensor_parallel_save_loads_in_one_process_and_in_tp(tmp_path, run_ranks):
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(2, "save", ckpt, out, "--tp")
    step2 = os.path.join(ckpt, "0000000002")
    # One DP rank (two TP ranks): a single train state, written by TP rank 0.
    assert sorted(n for n in os.listdir(step2) if n.startswith("train_state")) == [
        "train_state_00000.json"
    ]
    run_ranks(1, "load", ckpt, out)
    assert not read_json(os.path.join(out, "load_world1.json"))["dp_size_changed"]
    run_ranks(2, "load", ckpt, out, "--tp", "--init-from", step2)
    assert read_json(os.path.join(out, "load_world2.json"))["init_format"] == "dcp"
