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


def test_load_pretrained_reads_a_training_step_folder(tiny_blt_run):
    import bytelatent

    step = tiny_blt_run / "checkpoints" / "0000000020"
    model, args = bytelatent.load_pretrained(str(step))
    expected, expected_args, _ = load_any_checkpoint(str(step))
    assert args == expected_args and not model.training
    assert all(torch.equal(v, expected.state_dict()[k]) for k, v in model.state_dict().items())


def test_folder_without_weights_names_consolidate(tmp_path):
    import json

    from bytelatent.checkpoint.pretrained import read_weights

    (tmp_path / "params.json").write_text(json.dumps({"model": {}}))
    with pytest.raises(CheckpointError, match="checkpoint consolidate STEP_DIR"):
        read_weights(str(tmp_path))


def test_reference_fields_without_effect_warn_in_one_short_line(caplog):
    """A released params.json: dozens of ignored fields, one short warning, the list at DEBUG."""
    import logging

    from bytelatent.checkpoint.pretrained import warn_ignored_fields

    # the notes as bytelatent.archs.blt.reference_compat words them
    many = ["dim=128 (the reference ignores it for BLT; the global transformer uses dim_global)"]
    many += [f"field_{i} (no effect in the reference)" for i in range(60)]
    with caplog.at_level(logging.DEBUG, logger="bytelatent"):
        warn_ignored_fields("run/params.json", many)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len(warnings[0]) < 300, warnings
    assert f"{len(many)} reference field(s)" in warnings[0] and "more)" in warnings[0]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and all(note in debug[0] for note in many)
