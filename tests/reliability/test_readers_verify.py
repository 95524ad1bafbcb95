"""eval, generate and consolidate verify the DCP folder they load: a truncated or partial folder
is one line naming what is wrong, not a traceback."""

from __future__ import annotations

import os

import pytest
import torch

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.checkpoint.__main__ import main as checkpoint_cli
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.errors import CheckpointError
from bytelatent.generate import main as generate_cli
from bytelatent.model.args import LMTransformerArgs

ARGS = {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seqlen": 16}


def _saved(tmp_path) -> str:
    torch.manual_seed(0)
    model = LMTransformer(LMTransformerArgs(**ARGS))
    model.init_weights()
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))
    params = {"train_entropy_model": True, "entropy_model": ARGS}
    return manager.save(1, model, torch.optim.AdamW(model.parameters()), {"step": 1}, params)


def _truncate(folder: str) -> None:
    with open(os.path.join(folder, "__0_0.distcp"), "r+b") as f:
        f.truncate(100)


def _interrupt(folder: str) -> None:
    """As if killed after the data was written, before manifest.json and the marker."""
    os.remove(os.path.join(folder, ".complete"))
    os.remove(os.path.join(folder, "manifest.json"))


@pytest.mark.parametrize(
    ("damage", "says"),
    [(_truncate, "__0_0.distcp: 100 bytes, the manifest says"), (_interrupt, "partial save")],
)
def test_readers_say_what_is_wrong_in_one_line(tmp_path, capsys, damage, says):
    folder = _saved(tmp_path)
    assert isinstance(load_any_checkpoint(folder)[0], LMTransformer)
    damage(folder)
    with pytest.raises(CheckpointError, match=says) as info:
        load_any_checkpoint(folder)  # what `bytelatent.eval` and `bytelatent.generate` load with
    assert str(info.value).startswith(f"{folder}: not loadable:") and "\n" not in str(info.value)
    for cli in (
        lambda: checkpoint_cli(["consolidate", folder]),
        lambda: generate_cli([f"ckpt={folder}", "prompt=hi", "max_new_bytes=2"]),
    ):
        assert cli() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("checkpoint error:") and says in err[0]
