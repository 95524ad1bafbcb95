"""A DCP `.metadata` with a planted payload never runs, wherever a DCP folder is loaded.

The payload is a global whose `__reduce__` writes a file; `manifest.json` is updated to match, as an
attacker sharing a checkpoint would. Every reader must refuse it in one line naming the file.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.__main__ import main as checkpoint_cli
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.dcp_io import load_metadata_bytes, read_metadata
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.checkpoint.verify import verify_step_folder, write_folder_manifest
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.transformer import LMTransformer

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
