"""Checkpoints on a real S3 endpoint (moto server): save/load/retention/consolidate/warm start via s3://."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ckpt_worker import TinyNet, build, full_weights, train_step

from bytelatent.checkpoint.args import CheckpointArgs, SaveEvery
from bytelatent.checkpoint.consolidate import consolidate, load_consolidated_state_dict
from bytelatent.checkpoint.fs import get_fs
from bytelatent.checkpoint.manager import MARKER_FILE, CheckpointManager

pytestmark = pytest.mark.s3


def test_save_load_retention_on_s3(s3_bucket):
    path = f"{s3_bucket}/run1/checkpoints"
    args = CheckpointArgs(path=path, dump=SaveEvery(every=1, keep=2))
    manager = CheckpointManager(args)
    model, optimizer = build(1)
    for step in (1, 2, 3):
        train_step(model, optimizer, step, 0, 1)
        manager.save(step, model, optimizer, {"step": step}, {"run": 1})
    saved = full_weights(model)
    fs = get_fs(path)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    assert names == ["0000000002", "0000000003"]
    files = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/0000000003", detail=False)}
    assert {
        ".metadata",
        "__0_0.distcp",
        "train_state_00000.json",
        "params.json",
        MARKER_FILE,
    } <= files

    # A partial folder (no marker) is ignored by a fresh manager and cleaned by the next save.
    with fs.open(f"{path}/0000000004/train_state_00000.json", "w") as f:
        f.write("{}")
    fresh = CheckpointManager(args)
    assert fresh.latest_complete() == f"{path}/0000000003"
    model2, optimizer2 = build(1, seed=8)
    assert fresh.load(model2, optimizer2) == {"step": 3}
    for key, value in full_weights(model2).items():
        assert torch.equal(value, saved[key]), key
    fresh.save(5, model2, optimizer2, {"step": 5})
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    assert names == ["0000000003", "0000000005"]


def test_consolidate_and_warm_start_on_s3(s3_bucket, tmp_path):
    manager = CheckpointManager(CheckpointArgs(path=f"{s3_bucket}/run2/checkpoints"))
    source, optimizer = build(1, seed=11)
    train_step(source, optimizer, 1, 0, 1)
    folder = manager.save(1, source, optimizer, {"step": 1}, {"model": {"dim": 16}})
    want = full_weights(source)

    out = consolidate(folder, with_optim=True)
    assert out == f"{folder}/consolidated"
    fs = get_fs(out)
    assert json.loads(fs.cat(f"{out}/params.json")) == {"model": {"dim": 16}}
    with fs.open(f"{out}/consolidated.pth", "rb") as f:
        payload = torch.load(f)
    assert set(payload) == {"model", "optim"}
    for key, value in want.items():
        assert torch.equal(payload["model"][key], value), key
    assert torch.equal(load_consolidated_state_dict(out)["out.weight"], want["out.weight"])

    # s3 -> local consolidation, and warm starts from both formats on s3.
    local = consolidate(folder, str(tmp_path / "local"))
    assert os.path.exists(os.path.join(local, "consolidated.pth"))
    for init_path in (folder, out):
        target = TinyNet()
        manager.load_init(target, init_path)
        for key, value in full_weights(target).items():
            assert torch.equal(value, want[key]), (init_path, key)


@pytest.mark.slow
def test_two_rank_fsdp_save_on_s3_loads_in_one_process(s3_bucket, tmp_path, run_ranks):
    ckpt, out = f"{s3_bucket}/run3/checkpoints", str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(2, "save", ckpt, out)
    run_ranks(1, "load", ckpt, out)
    with open(os.path.join(out, "load_world1.json")) as f:
        assert json.load(f)["saved_dp_size"] == 2
