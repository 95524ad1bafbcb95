"""Verified checkpoints: manifests, set-aside of a corrupted newest checkpoint, the verify CLI, and
a save that fails (disk full / unwritable) leaving the previous checkpoint loadable."""

from __future__ import annotations

import builtins
import errno
import json
import os

import pytest
import torch

from bytelatent.checkpoint.__main__ import main as checkpoint_cli
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.verify import MANIFEST_FILE, verify_step_folder
from bytelatent.errors import CheckpointError


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _manager(tmp_path, **kwargs) -> CheckpointManager:
    return CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck"), **kwargs))


def _save_steps(manager, steps) -> dict[int, dict[str, torch.Tensor]]:
    weights = {}
    for step in steps:
        model, optimizer = _model_and_optimizer(step)
        manager.save(step, model, optimizer, {"step": step})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def _shard(manager, step) -> str:
    return os.path.join(manager.step_folder(step), "__0_0.distcp")


def test_manifests_record_every_file(tmp_path):
    manager = _manager(tmp_path)
    _save_steps(manager, [1])
    folder = manager.step_folder(1)
    top = json.loads(open(os.path.join(folder, MANIFEST_FILE)).read())
    assert top["rank_manifests"] == ["manifest_00000.json"]
    assert {".metadata", "train_state_00000.json", "manifest_00000.json"} <= set(top["files"])
    rank = json.loads(open(os.path.join(folder, "manifest_00000.json")).read())
    assert rank["files"]["__0_0.distcp"]["size"] == os.path.getsize(_shard(manager, 1))
    report = verify_step_folder(folder, checksum=True)
    assert report.ok and report.verified and report.n_files == 4


def test_truncated_newest_is_set_aside_and_previous_resumed(tmp_path, caplog):
    manager = _manager(tmp_path)
    weights = _save_steps(manager, [1, 2])
    with open(_shard(manager, 2), "r+b") as f:
        f.truncate(100)
    with caplog.at_level("ERROR"):
        path = manager.resume_path()
    assert path == manager.step_folder(1)
    assert "fails verification: __0_0.distcp: 100 bytes" in caplog.text
    aside = [n for n in os.listdir(manager.path) if n.startswith("0000000002.corrupt-")]
    assert len(aside) == 1 and os.path.getsize(os.path.join(manager.path, aside[0], "__0_0.distcp"))
    model, optimizer = _model_and_optimizer(99)
    assert manager.load(model, optimizer, path)["step"] == 1
    assert all(torch.equal(v, weights[1][k]) for k, v in model.state_dict().items())


def test_bit_flip_is_caught_by_default(tmp_path):
    manager = _manager(tmp_path)
    weights = _save_steps(manager, [1, 2])
    with open(_shard(manager, 2), "r+b") as f:
        f.seek(os.path.getsize(_shard(manager, 2)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))  # one bit
    model, optimizer = _model_and_optimizer(99)
    assert _manager(tmp_path, verify="size").load(model, optimizer)["step"] == 2  # sizes match
    # The default checks CRC32s while loading, then falls back to the previous checkpoint.
    resumed = _manager(tmp_path)
    assert resumed.load(model, optimizer)["step"] == 1
    assert resumed.last_load.path == manager.step_folder(1)
    assert all(torch.equal(v, weights[1][k]) for k, v in model.state_dict().items())
    assert any(n.startswith("0000000002.corrupt-") for n in os.listdir(manager.path))


def test_damaged_marker_fails_verify(tmp_path, capsys):
    manager = _manager(tmp_path)
    _save_steps(manager, [1, 2])
    with open(os.path.join(manager.step_folder(1), ".complete"), "w") as f:
        f.write("{truncated")
    report = verify_step_folder(manager.step_folder(1), checksum=True)
    assert not report.ok and "damaged marker" in report.problems[0]
    assert checkpoint_cli(["verify", manager.path]) == 1
    assert "0000000001  FAILED" in capsys.readouterr().out
    # ... and it is not exempt from retention: the next save removes it like a partial save.
    _save_steps(manager, [3])
    assert sorted(os.listdir(manager.path)) == ["0000000002", "0000000003"]


def test_failed_save_line_is_in_train_log(tmp_path, monkeypatch):
    import logging

    from bytelatent.checkpoint import manager as manager_module

    log = tmp_path / "train.log"
    handler = logging.FileHandler(log)
    logging.getLogger("bytelatent").addHandler(handler)
    manager = _manager(tmp_path)

    def no_space(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager_module.cfs, "makedirs", no_space)
    try:
        with pytest.raises(CheckpointError) as info:
            _save_steps(manager, [1])
    finally:
        logging.getLogger("bytelatent").removeHandler(handler)
        handler.close()
    assert info.value.args[0] in log.read_text()


def test_missing_rank_manifest_and_explicit_load_path(tmp_path):
    manager = _manager(tmp_path)
    _save_steps(manager, [1])
    os.remove(os.path.join(manager.step_folder(1), "manifest_00000.json"))
    report = verify_step_folder(manager.step_folder(1))
    assert not report.ok and "manifest_00000.json: missing" in report.problems[0]
    with pytest.raises(CheckpointError, match="fails verification"):
        _manager(tmp_path, load_path=manager.step_folder(1)).resume_path()
    assert os.path.isdir(manager.step_folder(1))  # a folder the user named is never moved


def test_checkpoint_without_manifest_is_accepted_unverified(tmp_path):
    manager = _manager(tmp_path)
    _save_steps(manager, [1])
    os.remove(os.path.join(manager.step_folder(1), MANIFEST_FILE))
    assert manager.resume_path() == manager.step_folder(1)


def test_verify_cli(tmp_path, capsys):
    manager = _manager(tmp_path)
    _save_steps(manager, [1, 2])
    assert checkpoint_cli(["verify", manager.path]) == 0
    assert "2 checkpoint(s), 0 failed" in capsys.readouterr().out
    with open(_shard(manager, 2), "ab") as f:
        f.write(b"junk")
    assert checkpoint_cli(["verify", manager.path]) == 1
    out = capsys.readouterr().out
    assert "0000000001  ok" in out and "0000000002  FAILED" in out and "the manifest says" in out
    assert checkpoint_cli(["verify", manager.step_folder(1), "--sizes-only"]) == 0
    assert checkpoint_cli(["verify", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("checkpoint error:")


@pytest.mark.parametrize("victim", ["__0_", "manifest_", ".complete"])
def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, victim):
    """The write of the shard, a manifest or the marker of step 2 fails with ENOSPC."""
    manager = _manager(tmp_path)
    weights = _save_steps(manager, [1])
    folder2 = manager.step_folder(2)
    real_open = builtins.open

    def full(path, mode="r", *args, **kwargs):
        name = os.path.basename(str(path))
        if str(path).startswith(folder2) and name.startswith(victim) and "w" in str(mode):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)  # fsspec's local files open through it too
    model, optimizer = _model_and_optimizer(2)
    with pytest.raises(CheckpointError) as info:
        manager.save(2, model, optimizer, {"step": 2})
    monkeypatch.undo()
    line = info.value.one_line()
    assert "No space left on device" in line and "\n" not in line
    assert f"{manager.step_folder(1)} is intact" in line
    assert not os.path.exists(folder2)  # the partial save is removed, freeing the space
    assert verify_step_folder(manager.step_folder(1), checksum=True).ok
    reloaded, optimizer = _model_and_optimizer(5)
    _manager(tmp_path).load(reloaded, optimizer)
    assert all(torch.equal(v, weights[1][k]) for k, v in reloaded.state_dict().items())
