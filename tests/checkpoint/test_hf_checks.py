"""hf_checks.check_weights: one line that names every imported tensor that does not fit."""

import pytest
import torch

from bytelatent.archs.blt.hf_checks import check_weights, expected_shapes, weight_mismatches
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs


def _args() -> LMTransformerArgs:
    return LMTransformerArgs(dim=16, n_layers=1, n_heads=2, vocab_size=260, max_seqlen=32)


def test_fitting_weights_pass():
    args = _args()
    state = {name: torch.zeros(shape) for name, shape in expected_shapes(args).items()}
    assert weight_mismatches(expected_shapes(args), state) == []
    check_weights(args, state, "hf/")


def test_every_mismatch_is_named():
    args = _args()
    shapes = expected_shapes(args)
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    names = sorted(state)
    missing = names[0]
    del state[missing]
    state["extra.weight"] = torch.zeros(2)
    state[names[1]] = torch.zeros(3, 3)  # misshaped
    state[names[2]] = torch.zeros(shapes[names[2]], dtype=torch.int64)
    state[names[3]] = torch.full(shapes[names[3]], float("nan"))
    with pytest.raises(CheckpointError) as info:
        check_weights(args, state, "hf/")
    line = info.value.args[0]
    assert line.startswith("hf/: weights do not match config.json (5 problems: ")
    assert f"missing {missing}" in line and "unexpected extra.weight" in line
    assert f"{names[1]}: shape (3, 3) != {shapes[names[1]]}" in line
    assert f"{names[2]}: dtype int64, not floating point" in line
    assert f"{names[3]}: {torch.Size(shapes[names[3]]).numel()} NaN/inf values" in line
