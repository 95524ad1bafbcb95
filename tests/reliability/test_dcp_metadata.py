"""A DCP `.metadata` with a planted payload never runs, wherever a DCP folder is loaded.

The payload is a global whose `__reduce__` writes a file; `manifest.json` is updated to match, as an
attacker sharing a checkpoint would. Every reader must refuse it in one line naming the file.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.__main__ import main as checkpoint_cli
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.dcp_io import load_metadata_bytes, read_metadata
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.checkpoint.verify import (
    rank_manifest_name,
    verify_step_folder,
    write_folder_manifest,
    write_manifest,
)
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs

ARGS = {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seqlen": 16}


class _Planted:
    """Unpickling this runs `exec`, which writes `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('the payload ran')",))


def _model() -> LMTransformer:
    torch.manual_seed(0)
    model = LMTransformer(LMTransformerArgs(**ARGS))
    model.init_weights()
    return model


def _save(tmp_path) -> tuple[CheckpointManager, str]:
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    params = {"train_entropy_model": True, "entropy_model": ARGS}
    return manager, manager.save(1, model, optimizer, {"step": 1}, params)


def _plant(folder: str, sentinel: str) -> None:
    metadata = read_metadata(folder)
    metadata.planner_data["planted"] = _Planted(sentinel)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    write_folder_manifest(cfs.get_fs(folder), folder, 1)  # the manifest matches the payload


@pytest.fixture
def planted(tmp_path):
    manager, folder = _save(tmp_path)
    model, _, _ = load_any_checkpoint(folder)  # the folder loads before it is tampered with
    assert isinstance(model, LMTransformer)
    sentinel = str(tmp_path / "PWNED")
    _plant(folder, sentinel)
    yield manager, folder, sentinel
    assert not os.path.exists(sentinel), "the planted payload ran"


def test_unpickler_refuses_foreign_globals_in_one_line(tmp_path):
    sentinel = str(tmp_path / "PWNED")
    with pytest.raises(CheckpointError) as info:
        load_metadata_bytes(pickle.dumps(_Planted(sentinel)), "D/.metadata")
    assert str(info.value).startswith("D/.metadata: refusing to load builtins.exec")
    assert "\n" not in str(info.value) and not os.path.exists(sentinel)


def test_readers_refuse_the_payload(planted, capsys):
    manager, folder, sentinel = planted
    readers = {
        "eval/generate": lambda: load_any_checkpoint(folder),
        "consolidate": lambda: consolidate(folder, str(manager.path) + "/out"),
        "load_path": lambda: CheckpointManager(
            CheckpointArgs(path=manager.path, load_path=folder)
        ).resume_path(),
        "init_ckpt_path": lambda: manager.load_init(_model(), folder),
        "load": lambda: manager.load(_model(), None, folder),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError, match="refusing to load builtins.exec") as info:
            read()
        assert "\n" not in str(info.value), name
        assert not os.path.exists(sentinel), name
    assert checkpoint_cli(["consolidate", folder]) == 2
    assert "refusing to load builtins.exec" in capsys.readouterr().err


def test_verify_and_resume_refuse_the_payload(planted, capsys):
    manager, folder, sentinel = planted
    report = verify_step_folder(folder, checksum=True)
    assert not report.ok and "refusing to load builtins.exec" in report.problems[0]
    assert checkpoint_cli(["verify", folder]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert manager.resume_path() is None  # the only checkpoint fails: set aside, start fresh
    assert any(".corrupt-" in name for name in os.listdir(manager.path))


# --- byte items: DCP stores non-tensor state (the optimizer's param_groups) as pickles ----------

LR_ITEM = "optim.param_groups.0.lr"


def _plant_item(folder: str, sentinel: str) -> None:
    """Append a pickle to the shard and point the optimizer's lr and a model weight at it.

    `.metadata` itself stays plain DCP metadata (it passes the restricted unpickler), and the
    manifests are rewritten: only the loads of the byte items stand between the payload and
    whoever reads the folder.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_metadata(folder)
    shard = next(info.relative_path for info in metadata.storage_data.values())
    payload = __import__("io").BytesIO()
    torch.save(_Planted(sentinel), payload)
    path = os.path.join(folder, shard)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(payload.getvalue())
    weight = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    metadata.state_dict_metadata[weight] = BytesStorageMetadata()
    for index in list(metadata.storage_data):
        if index.fqn in (LR_ITEM, weight):
            del metadata.storage_data[index]
            info = type(next(iter(metadata.storage_data.values())))
            metadata.storage_data[type(index)(index.fqn)] = info(
                shard, offset, len(payload.getvalue())
            )
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    fs = cfs.get_fs(folder)
    write_manifest(fs, folder, rank_manifest_name(0), [shard], rank=0)
    write_folder_manifest(fs, folder, 1)


@pytest.fixture
def planted_item(tmp_path):
    manager, folder = _save(tmp_path)
    sentinel = str(tmp_path / "PWNED")
    _plant_item(folder, sentinel)
    yield manager, folder, sentinel
    assert not os.path.exists(sentinel), "the planted payload ran"


def test_byte_item_loader_refuses_a_pickled_global_in_one_line(tmp_path):
    from bytelatent.checkpoint.dcp_io import load_byte_item

    sentinel = str(tmp_path / "PWNED")
    payload = __import__("io").BytesIO()
    torch.save(_Planted(sentinel), payload)
    with pytest.raises(CheckpointError) as info:
        load_byte_item(payload.getvalue(), "D/__0_0.distcp: optim.param_groups.0.lr")
    line = str(info.value)
    assert line.startswith("D/__0_0.distcp: optim.param_groups.0.lr: refusing to load")
    assert "exec" in line and "\n" not in line and not os.path.exists(sentinel)
    plain = __import__("io").BytesIO()
    torch.save({"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a.weight"], "foreach": None}, plain)
    assert load_byte_item(plain.getvalue(), "D")["betas"] == (0.9, 0.95)


def test_verify_and_every_reader_refuse_a_planted_byte_item(planted_item, capsys):
    manager, folder, sentinel = planted_item
    report = verify_step_folder(folder, checksum=True)
    assert not report.ok and "refusing to load a non-tensor item" in report.problems[0]
    assert checkpoint_cli(["verify", folder]) == 1
    readers = {
        "eval/generate": lambda: load_any_checkpoint(folder),
        "consolidate": lambda: consolidate(folder, str(manager.path) + "/out"),
        "init_ckpt_path": lambda: manager.load_init(_model(), folder),
        "load": lambda: manager.load(_model(), None, folder),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError, match="refusing to load a non-tensor item") as info:
            read()
        assert "\n" not in str(info.value), name
        assert not os.path.exists(sentinel), name
    assert manager.resume_path() is None  # the only checkpoint fails: set aside, start fresh


def test_loads_refuse_a_planted_byte_item_even_unverified(planted_item, monkeypatch):
    """The second guard: with the folder checks out of the way (a folder without manifests, or a
    check that missed it), the load itself reads byte items restricted."""
    import bytelatent.checkpoint.dcp_io as dcp_io

    manager, folder, sentinel = planted_item
    monkeypatch.setattr(dcp_io, "_load_byte_items", lambda *a: None)
    assert verify_step_folder(folder, checksum=True).ok  # the folder check is blind now
    model = _model()
    state = {
        "model": model.state_dict(),
        "optim": torch.optim.AdamW(model.parameters()).state_dict(),
    }
    loads = {
        "resume (dcp_load)": lambda: dcp_io.dcp_load(state, folder, "cannot load"),
        "consolidate": lambda: consolidate(folder, str(manager.path) + "/out"),
    }
    for name, load in loads.items():
        with pytest.raises(CheckpointError, match="refusing to load a non-tensor item") as info:
            load()
        assert "\n" not in str(info.value), name
        assert not os.path.exists(sentinel), name


def test_reading_with_torchs_default_planner_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from bytelatent.checkpoint.dcp_io import SafeFsspecReader

    _manager, folder = _save(tmp_path)
    state = {"model": _model().state_dict()}
    with pytest.raises(BaseException) as info:  # DCP wraps it in its CheckpointException
        dcp.load(state, storage_reader=SafeFsspecReader(folder))
    assert "unpickles byte items unrestricted" in str(info.value)
