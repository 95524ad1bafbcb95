"""The entropy model loads the reference checkpoint layout and reproduces the reference outputs."""

import json

import pytest
import torch

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.model.args import LMTransformerArgs
from tests.paths import CONFORMANCE

FIXTURES = CONFORMANCE
pytestmark = pytest.mark.conformance("entropy_model/params.json")


def entropies(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy in nats of softmax(logits)."""
    log_probs = logits.log_softmax(dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


@pytest.fixture(scope="module")
def entropy_model() -> LMTransformer:
    params = json.loads((FIXTURES / "entropy_model" / "params.json").read_text())
    args = LMTransformerArgs(**params["entropy_model"])
    # the released config: xformers + local_block_causal window 512 (sdpa fallback on CPU)
    assert args.attn_impl == "xformers" and args.attn_bias_type == "local_block_causal"
    with torch.device("meta"):
        model = LMTransformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # recomputes the non-persistent RoPE table
    state = torch.load(FIXTURES / "entropy_model" / "consolidated.pth", weights_only=True)
    model.load_state_dict(state["model"], strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return torch.load(FIXTURES / "cases.pt", weights_only=True)


def test_entropy_logits_and_entropies_match_reference(entropy_model, cases):
    assert len(cases) >= 1
    for case in cases:
        tokens = torch.tensor([case["input_ids"]], dtype=torch.long)
        with torch.no_grad():
            logits = entropy_model(tokens)[0]
        expected = case["entropy_logits"]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < 1e-4, case["text"][:40]
        expected_entropies = torch.as_tensor(case["entropies"], dtype=torch.float32)
        torch.testing.assert_close(entropies(logits), expected_entropies, rtol=0, atol=1e-4)


def test_batched_rows_match_single_rows(entropy_model, cases):
    """Rows of one batch do not leak into each other (the reference's flattened batch did)."""
    rows = [torch.tensor(case["input_ids"]) for case in cases]
    width = min(len(row) for row in rows)
    batch = torch.stack([row[:width] for row in rows])
    with torch.no_grad():
        together = entropy_model(batch)
    for i, case in enumerate(cases):
        torch.testing.assert_close(together[i], case["entropy_logits"][:width], rtol=0, atol=1e-4)
