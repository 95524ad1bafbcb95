"""`load_any_checkpoint` reads a DCP step folder and its consolidated copy to the same model."""

from __future__ import annotations

import pytest
import torch

from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.errors import CheckpointError


@pytest.mark.parametrize("run", ["tiny_blt_run", "tiny_entropy_run"])
def test_dcp_and_consolidated_give_the_same_model(run, request, tmp_path):
    step = request.getfixturevalue(run) / "checkpoints" / "0000000020"
    model, args, params = load_any_checkpoint(str(step))
    assert params["steps"] == 20 and not model.training
    consolidated = consolidate(str(step), str(tmp_path / "cons"))
    model2, args2, _ = load_any_checkpoint(consolidated)
    assert args == args2
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    for key in sd1:
        assert torch.equal(sd1[key], sd2[key]), key


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_any_checkpoint(str(tmp_path / "nope"))
