"""BLT loaded from reference-format weights computes the reference's logits (shared/conformance)."""

import json

import pytest
import torch

from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.blt.patch_utils import (
    decoder_patch_ids_from_lengths,
    patch_ids_from_lengths,
)
from bytelatent.archs.blt.reference_compat import (
    adapt_reference_blt_state_dict,
    blt_args_from_reference,
)
from tests.paths import CONFORMANCE

BLT_DIR = CONFORMANCE / "blt"

needs_fixtures = pytest.mark.conformance("blt/params.json", "cases.pt")


@pytest.fixture(scope="module")
def reference_model() -> tuple[ByteLatentTransformer, list[str]]:
    params = json.loads((BLT_DIR / "params.json").read_text())
    args, ignored = blt_args_from_reference(params["model"])
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    checkpoint = torch.load(BLT_DIR / "consolidated.pth", weights_only=True, map_location="cpu")
    state_dict, _ = adapt_reference_blt_state_dict(checkpoint["model"], args)
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), ignored


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return torch.load(CONFORMANCE / "cases.pt", weights_only=True)


@needs_fixtures
@pytest.mark.parametrize("structured", [True, False], ids=["structured", "dense"])
def test_logits_match_reference(reference_model, cases, structured: bool) -> None:
    model, _ = reference_model
    model.structured_cross_attn = structured
    try:
        for case in cases:
            tokens = torch.as_tensor(case["input_ids"])[None]
            patch_lengths = torch.as_tensor(case["patch_lengths"])[None]
            with torch.no_grad():
                logits = model(tokens, patch_lengths)
            assert logits.dtype == torch.float32
            assert logits.shape == (1, tokens.shape[1], 260)
            diff = (logits[0] - case["blt_logits"]).abs().max().item()
            assert diff < 1e-4, f"{case['text'][:30]!r}: max abs diff {diff}"
    finally:
        model.structured_cross_attn = True


@needs_fixtures
def test_include_next_token_lengths_give_same_logits(reference_model, cases) -> None:
    """Rows summing to N+1 (the patcher's include_next_token) change only the last byte's logits.

    Summing to N says byte N starts a new patch, so byte N-1 may read its own (complete) patch;
    summing to N+1 puts byte N in the last patch, so byte N-1 reads the one before.
    """
    model, _ = reference_model
    case = cases[0]
    tokens = torch.as_tensor(case["input_ids"])[None]
    lengths = torch.as_tensor(case["patch_lengths"]).clone()
    lengths[-1] += 1
    with torch.no_grad():
        logits = model(tokens, lengths[None])
    assert (logits[0, :-1] - case["blt_logits"][:-1]).abs().max().item() < 1e-4
    assert (logits[0, -1] - case["blt_logits"][-1]).abs().max().item() > 1e-3


@needs_fixtures
def test_reference_config_notes(reference_model) -> None:
    model, ignored = reference_model
    args = model.args
    assert (args.dim, args.n_layers, args.n_heads) == (
        128,
        2,
        4,
    )  # from dim_global etc.
    assert any(note.startswith("dim=128") for note in ignored)
    assert any(note.startswith("n_layers=8") for note in ignored)
    assert any(note.startswith("patching_mode") for note in ignored)
    assert any(note.startswith("recompute_attn") for note in ignored)


def test_patch_ids_verified_example() -> None:
    lengths = torch.tensor([[1, 4, 3, 2]])
    assert patch_ids_from_lengths(lengths, 9).tolist() == [[0, 1, 1, 1, 1, 2, 2, 2, 3]]
    assert decoder_patch_ids_from_lengths(lengths, 9).tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2]]
