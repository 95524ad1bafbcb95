"""Single-process CheckpointManager tests: round trip, no-op resave, retention, partial folders, warm start, async."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from ckpt_worker import TinyNet, build, full_weights, train_step

from bytelatent.checkpoint.args import CheckpointArgs, SaveEvery
from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.manager import MARKER_FILE, CheckpointManager
from bytelatent.errors import CheckpointError, ConfigError


def read_json(path: str) -> object:
    with open(path) as f:
        return json.load(f)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def make_manager(tmp_path, **kwargs) -> CheckpointManager:
    return CheckpointManager(CheckpointArgs(**kwargs), dump_dir=str(tmp_path))


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def test_args_defaults_and_forbid_extra():
    args = CheckpointArgs()
    assert (args.dump.every, args.dump.keep, args.eval.every, args.eval.keep) == (
        1000,
        0,
        1000,
        0,
    )
    assert args.path is None and args.async_save is False and args.init_ckpt_strict is True
    with pytest.raises(ValueError):
        CheckpointArgs(dumpp=SaveEvery())
    with pytest.raises(ValueError):
        SaveEvery(every=-1)
    with pytest.raises(ConfigError, match="checkpoint.path"):
        CheckpointManager(CheckpointArgs())


def test_round_trip_is_bitwise(tmp_path):
    model, optimizer = build(1)
    for step in (1, 2, 3):
        train_step(model, optimizer, step, 0, 1)
    manager = make_manager(tmp_path)
    train_state = {"step": 3, "acc_step": 0, "data": {"position": 17, "rng": [1, 2, 3]}}
    folder = manager.save(3, model, optimizer, train_state, {"model": {"dim": 16}})
    assert folder == os.path.join(str(tmp_path), "checkpoints", "0000000003")
    assert sorted(os.listdir(folder)) == sorted(
        [
            ".metadata",
            "__0_0.distcp",
            "train_state_00000.json",
            "params.json",
            "manifest_00000.json",
            "manifest.json",
            MARKER_FILE,
        ]
    )
    assert read_json(os.path.join(folder, "params.json")) == {"model": {"dim": 16}}
    marker = read_json(os.path.join(folder, MARKER_FILE))
    assert marker["step"] == 3 and marker["kinds"] == ["dump"] and marker["dp_size"] == 1
    saved_optim = optimizer_state(optimizer)
    train_step(model, optimizer, 4, 0, 1)
    expected = full_weights(model)

    model2, optimizer2 = build(1, seed=99)
    restored = make_manager(tmp_path).load(model2, optimizer2)
    assert restored == train_state
    for got, want in zip(optimizer_state(optimizer2), saved_optim, strict=True):
        assert torch.equal(got, want)
    train_step(model2, optimizer2, 4, 0, 1)
    for key, value in full_weights(model2).items():
        assert torch.equal(value, expected[key]), key


def test_same_step_twice_is_noop(tmp_path):
    model, optimizer = build(1)
    manager = make_manager(tmp_path)
    manager.save(5, model, optimizer, {"step": 5})
    saved = full_weights(model)
    train_step(model, optimizer, 1, 0, 1)
    manager.save(5, model, optimizer, {"step": 999})
    # Also across a restart (new manager, marker on disk).
    make_manager(tmp_path).save(5, model, optimizer, {"step": 998})
    model2, optimizer2 = build(1, seed=5)
    assert make_manager(tmp_path).load(model2, optimizer2) == {"step": 5}
    for key, value in full_weights(model2).items():
        assert torch.equal(value, saved[key]), key


def test_partial_folder_of_same_step_is_replaced(tmp_path):
    model, optimizer = build(1)
    manager = make_manager(tmp_path)
    stale = manager.step_folder(7)
    os.makedirs(stale)
    write(os.path.join(stale, "__1_0.distcp"), "garbage from a killed 2-rank save")
    assert manager.latest_complete() is None
    manager.save(7, model, optimizer, {"step": 7})
    assert "__1_0.distcp" not in os.listdir(stale)
    assert manager.latest_complete() == stale


def steps_on_disk(manager: CheckpointManager) -> list[int]:
    return sorted(int(name) for name in os.listdir(manager.path))


def test_retention_keeps_last_dumps_and_evals_and_cleans_partials(tmp_path):
    model = TinyNet()
    manager = make_manager(
        tmp_path, dump=SaveEvery(every=10, keep=2), eval=SaveEvery(every=25, keep=1)
    )
    # A partial folder from a killed run, older than what we save next, and one newer.
    for step in (3, 1000):
        os.makedirs(os.path.join(manager.step_folder(step)))
        write(os.path.join(manager.step_folder(step), "train_state_00000.json"), "{}")
    sequence = [
        (10, "dump"),
        (20, "dump"),
        (25, "eval"),
        (30, "dump"),
        (40, "dump"),
        (50, ["dump", "eval"]),
    ]
    for step, kind in sequence:
        manager.save(step, model, None, {"step": step}, kind=kind)
        assert manager.latest_complete() == manager.step_folder(step)
    # Dumps kept: 40, 50; evals kept: 50 (25 dropped); the newer partial (1000) is left alone.
    assert steps_on_disk(manager) == [40, 50, 1000]
    manager.save(55, model, None, {"step": 55}, kind="eval")
    # 50 is still one of the last two dumps, so the eval rule alone cannot delete it.
    assert steps_on_disk(manager) == [40, 50, 55, 1000]
    manager.save(60, model, None, {"step": 60}, kind="final")
    assert steps_on_disk(manager) == [50, 55, 60, 1000]
    # A "preempt" save counts as a dump; the newest complete folder is never deleted.
    manager.save(61, model, None, {"step": 61}, kind="preempt")
    assert steps_on_disk(manager) == [55, 60, 61, 1000]
    assert manager.latest_complete() == manager.step_folder(61)


def test_keep_zero_keeps_everything_and_every_change_is_harmless(tmp_path):
    model = TinyNet()
    manager = make_manager(
        tmp_path, dump=SaveEvery(every=7, keep=0), eval=SaveEvery(every=3, keep=1)
    )
    for step in (5, 10, 15):  # steps unrelated to `every`: kinds come from the marker
        manager.save(step, model, None, {"step": step}, kind="dump")
    manager.save(16, model, None, {"step": 16}, kind="eval")
    manager.save(17, model, None, {"step": 17}, kind="eval")
    assert steps_on_disk(manager) == [5, 10, 15, 17]


def test_bad_kind_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        make_manager(tmp_path).save(1, TinyNet(), None, {}, kind="periodic")


def test_load_errors_are_one_line(tmp_path):
    manager = make_manager(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        manager.load(TinyNet())
    manager.save(1, TinyNet(), None, {"step": 1})
    with pytest.raises(CheckpointError, match="cannot load"):
        manager.load(TinyNet(dim=8))  # shape mismatch
    model, optimizer = build(1)
    with pytest.raises(CheckpointError, match="cannot load"):
        manager.load(model, optimizer)  # saved without optimizer state
    with pytest.raises(CheckpointError, match="step folders"):
        manager.load(TinyNet(), path=manager.path)
    os.remove(os.path.join(manager.step_folder(1), ".metadata"))
    with pytest.raises(CheckpointError, match="no .metadata"):
        manager.load(TinyNet(), path=manager.step_folder(1))


def test_unwritable_path_is_a_checkpoint_error(tmp_path):
    write(str(tmp_path / "file"), "not a folder")
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "file" / "checkpoints")))
    with pytest.raises(CheckpointError, match="cannot write"):
        manager.save(1, TinyNet(), None, {"step": 1})


def test_load_path_and_dp_size_change_flag(tmp_path):
    model, optimizer = build(1)
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")), dp_rank=0, dp_size=1)
    manager.save(1, model, optimizer, {"step": 1})
    manager.save(2, model, optimizer, {"step": 2})
    # Explicit load_path wins over the newest folder.
    pinned = CheckpointManager(
        CheckpointArgs(path=str(tmp_path / "ck"), load_path=manager.step_folder(1))
    )
    assert pinned.load(*build(1)) == {"step": 1}
    assert pinned.last_load.step == 1 and not pinned.last_load.dp_size_changed
    # Rank 3 of 4 reading a 1-rank checkpoint: gets rank 0's state and the flag.
    other = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")), dp_rank=3, dp_size=4)
    assert other.load(*build(1)) == {"step": 2}
    info = other.last_load
    assert info.dp_size_changed and info.saved_dp_size == 1 and info.train_state_rank == 0


def test_resume_path_order(tmp_path):
    init_dir = tmp_path / "init"
    args = CheckpointArgs(path=str(tmp_path / "ck"), init_ckpt_path=str(init_dir))
    assert CheckpointManager(args).resume_path() is None
    args.continue_training_from_init = True
    assert CheckpointManager(args).resume_path() == str(init_dir)
    manager = CheckpointManager(args)
    manager.save(4, TinyNet(), None, {"step": 4})
    assert manager.resume_path() == manager.step_folder(4)


def test_load_init_dcp_and_consolidated_with_rename(tmp_path):
    source, _ = build(1, seed=7)
    manager = make_manager(tmp_path)
    folder = manager.save(1, source, None, {"step": 1})
    want = full_weights(source)

    target = TinyNet()
    report = manager.load_init(target, folder)
    assert report.format == "dcp" and not report.missing and not report.unexpected
    for key, value in full_weights(target).items():
        assert torch.equal(value, want[key]), key

    out = consolidate(folder, str(tmp_path / "released"))
    target = TinyNet()
    assert manager.load_init(target, out).format == "consolidated"
    for key, value in full_weights(target).items():
        assert torch.equal(value, want[key]), key

    # A model whose keys differ by prefix: strict fails with a clear line, rename fixes it.
    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = TinyNet()

    with pytest.raises(CheckpointError, match="init_ckpt_rename"):
        manager.load_init(Wrapped(), folder)
    for path in (folder, out):
        wrapped = Wrapped()
        report = manager.load_init(wrapped, path, rename={"": "inner."})
        assert not report.missing
        for key, value in full_weights(wrapped.inner).items():
            assert torch.equal(value, want[key]), key

    # Non-strict: a checkpoint key with no model counterpart is reported, the rest loads.
    partial = TinyNet()
    report = manager.load_init(partial, out, strict=False, rename={"out.": "head."})
    assert report.unexpected == ["out.bias", "out.weight"]  # checkpoint names
    assert report.missing == ["out.bias", "out.weight"]
    assert torch.equal(partial.emb.weight, want["emb.weight"])
    with pytest.raises(CheckpointError, match="shape"):
        manager.load_init(TinyNet(dim=8), out, strict=False)
    with pytest.raises(CheckpointError, match="neither a DCP folder"):
        manager.load_init(TinyNet(), str(tmp_path))


def test_async_save_overlaps_and_wait_finalizes(tmp_path, monkeypatch):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer_cls = FsspecWriter  # the manager's ManifestWriter writes through it
    original = writer_cls.write_data

    def slow_write(self, *args, **kwargs):
        time.sleep(0.5)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(writer_cls, "write_data", slow_write)
    model, optimizer = build(1)
    train_step(model, optimizer, 1, 0, 1)
    manager = make_manager(tmp_path, async_save=True)
    saved = full_weights(model)
    start = time.perf_counter()
    folder = manager.save(1, model, optimizer, {"step": 1})
    returned_after = time.perf_counter() - start
    # Returned before the (slowed) write finished; the train state is already there, the marker not.
    assert returned_after < 0.4, returned_after
    assert os.path.exists(os.path.join(folder, "train_state_00000.json"))
    assert not os.path.exists(os.path.join(folder, MARKER_FILE))
    assert manager.latest_complete() is None
    # Training goes on and changes the live weights; the checkpoint holds the staged copy.
    train_step(model, optimizer, 2, 0, 1)
    manager.wait()
    assert os.path.exists(os.path.join(folder, MARKER_FILE))
    assert manager.latest_complete() == folder
    # The next save waits for nothing pending and works as usual.
    manager.save(2, model, optimizer, {"step": 2})
    manager.close()
    model2, optimizer2 = build(1, seed=3)
    assert manager.load(model2, optimizer2, path=folder) == {"step": 1}
    for key, value in full_weights(model2).items():
        assert torch.equal(value, saved[key]), key
