"""Entropy helpers: entropy math, per-row windows (no bleed), and loading entropy models."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.checkpoint.pretrained import load_entropy_model
from bytelatent.data.entropy import (
    calculate_entropies,
    document_entropies,
    entropy,
)
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs
from tests.paths import CONFORMANCE, require_conformance


def tiny_model(max_seqlen: int = 16, seed: int = 0) -> LMTransformer:
    args = LMTransformerArgs(
        dim=32, n_layers=1, n_heads=2, max_seqlen=max_seqlen, attn_bias_type="causal"
    )
    torch.manual_seed(seed)
    model = LMTransformer(args)
    model.init_weights()
    return model.eval()


def test_entropy_math() -> None:
    uniform = torch.zeros((2, 3, 260))
    assert torch.allclose(entropy(uniform), torch.full((2, 3), math.log(260)))
    peaked = torch.full((5,), -1e4)
    peaked[2] = 0.0
    assert float(entropy(peaked)) == pytest.approx(0.0, abs=1e-6)
    two = torch.tensor([0.0, 0.0, -1e4])
    assert float(entropy(two)) == pytest.approx(math.log(2), abs=1e-6)
    assert entropy(uniform.bfloat16()).dtype == torch.float32


def test_rows_never_bleed_and_windows_reset() -> None:
    model = tiny_model(max_seqlen=16)
    torch.manual_seed(3)
    rows = torch.randint(4, 260, (3, 40))
    batched = calculate_entropies(rows, model, batch_size=4)
    assert batched.shape == (3, 40) and batched.dtype == torch.float32
    with torch.no_grad():
        for index in range(3):
            # windows of max_seqlen=16: [0,16), [16,32), [32,40), each with fresh context
            expected = torch.cat(
                [
                    entropy(model(rows[index : index + 1, start : start + 16]))[0]
                    for start in (0, 16, 32)
                ]
            )
            assert torch.allclose(batched[index], expected, atol=1e-5)
    # an explicit max_length wins over the model's max_seqlen
    whole = calculate_entropies(rows[:1, :12], model, batch_size=1, max_length=6)
    with torch.no_grad():
        restarted = entropy(model(rows[:1, 6:12]))[0]
    assert torch.allclose(whole[0, 6:], restarted, atol=1e-5)


def test_document_entropies_ragged() -> None:
    model = tiny_model(max_seqlen=16)
    docs = [[1, 50, 60, 2], list(range(4, 44)), [1]]
    values = document_entropies(docs, model, batch_size=2)
    assert [v.numel() for v in values] == [4, 40, 1]
    for doc, got in zip(docs, values, strict=True):
        alone = calculate_entropies(torch.tensor([doc]), model, batch_size=1)[0]
        assert torch.allclose(got, alone, atol=1e-5)
    assert document_entropies([[]], model, batch_size=1)[0].numel() == 0


def write_released_layout(model: LMTransformer, directory: Path, subdir: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    params = {
        "name": "tiny",
        "train_entropy_model": True,
        "model": None,
        "entropy_model": model.args.model_dump(mode="json"),
    }
    (directory / "params.json").write_text(json.dumps(params))
    weights = directory / "consolidated" if subdir else directory
    weights.mkdir(exist_ok=True)
    torch.save({"model": model.state_dict()}, weights / "consolidated.pth")


@pytest.mark.parametrize("subdir", [False, True])
def test_load_released_layout(tmp_path: Path, subdir: bool) -> None:
    model = tiny_model()
    write_released_layout(model, tmp_path / "em", subdir=subdir)
    before = torch.get_default_dtype()
    loaded = load_entropy_model(str(tmp_path / "em"), device="cpu")
    assert torch.get_default_dtype() == before
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    tokens = torch.randint(4, 260, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    bf16 = load_entropy_model(str(tmp_path / "em"), device="cpu", dtype=torch.bfloat16)
    assert bf16.output.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == before


def test_load_conformance_entropy_model() -> None:
    require_conformance("cases.pt", "entropy_model")
    model = load_entropy_model(str(CONFORMANCE / "entropy_model"), device="cpu")
    cases = torch.load(CONFORMANCE / "cases.pt", weights_only=True)
    rows = [torch.tensor(case["input_ids"]) for case in cases]
    for case, values in zip(cases, document_entropies(rows, model, batch_size=3), strict=True):
        assert torch.allclose(values, torch.tensor(case["entropies"]), atol=1e-5)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no params.json"):
        load_entropy_model(str(tmp_path), device="cpu")
    model = tiny_model()
    write_released_layout(model, tmp_path / "em")
    (tmp_path / "em" / "consolidated.pth").unlink()
    with pytest.raises(CheckpointError, match="no consolidated.pth"):
        load_entropy_model(str(tmp_path / "em"), device="cpu")
    state = model.state_dict()
    state.pop("norm.weight")
    torch.save({"model": state}, tmp_path / "em" / "consolidated.pth")
    with pytest.raises(CheckpointError, match="do not match"):
        load_entropy_model(str(tmp_path / "em"), device="cpu")
    (tmp_path / "em" / "params.json").write_text(json.dumps({"model": {"dim": 8}}))
    with pytest.raises(CheckpointError, match="no 'entropy_model' section"):
        load_entropy_model(str(tmp_path / "em"), device="cpu")
    shutil.rmtree(tmp_path / "em")


def test_window_longer_than_model_is_rejected() -> None:
    from bytelatent.errors import ConfigError

    with pytest.raises(ConfigError, match="exceeds the entropy model's max_seqlen=16"):
        calculate_entropies(torch.ones((1, 4), dtype=torch.long), tiny_model(), 1, None, 32)


def test_reference_params_are_mapped(tmp_path: Path) -> None:
    """A reference params.json with vocab_size=-1 (filled from the tokenizer there) loads."""
    model = tiny_model()
    write_released_layout(model, tmp_path / "em")
    params = json.loads((tmp_path / "em" / "params.json").read_text())
    params["entropy_model"]["vocab_size"] = -1
    (tmp_path / "em" / "params.json").write_text(json.dumps(params))
    loaded = load_entropy_model(str(tmp_path / "em"), device="cpu")
    assert loaded.args.vocab_size == 260
    params["entropy_model"]["not_a_field"] = 1
    (tmp_path / "em" / "params.json").write_text(json.dumps(params))
    with pytest.raises(CheckpointError, match="not_a_field"):
        load_entropy_model(str(tmp_path / "em"), device="cpu")
