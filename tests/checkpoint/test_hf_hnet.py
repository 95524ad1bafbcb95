"""H-Net export/import (`python -m bytelatent.checkpoint export-hf / import-hf`): a
save_pretrained-style folder with our names and args that imports back into the identical model
(logits equal); what does not fit is one CheckpointError line."""

from __future__ import annotations

import json

import pytest
import torch

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.archs.hnet.model import HNet
from bytelatent.checkpoint.__main__ import main as checkpoint_cli
from bytelatent.checkpoint.hf_folder import export_hf, import_hf
from bytelatent.checkpoint.hf_folder import write_consolidated as _write_consolidated
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.errors import CheckpointError
from bytelatent.model.registry import arch_of

safetensors = pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

ARGS = HNetArgs(
    stages=[dict(dim=32, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=16,
                 target_ratio=3.0),
            dict(dim=48, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=8,
                 target_ratio=2.0)],
    dim=64, n_layers=2, n_heads=4, max_seqlen=64, multiple_of=16,
)  # fmt: skip
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"}  # fmt: skip


@pytest.fixture
def saved(tmp_path) -> tuple[HNet, str]:
    """A trained-looking H-Net (random weights, routers off identity) as a consolidated folder."""
    with torch.device("meta"):
        model = HNet(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # no parameter left at a constant init (zeros, identity)
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    params = {"arch": "hnet", "model": None, "arch_args": ARGS.model_dump(mode="json")}
    ckpt = tmp_path / "ckpt"
    _write_consolidated(ckpt, params, {k: v.clone() for k, v in model.state_dict().items()})
    return model.eval(), str(ckpt)


def tokens() -> torch.Tensor:
    x = torch.randint(4, 260, (2, 64), generator=torch.Generator().manual_seed(3))
    x[0, 30] = 2  # a document end inside a row
    return x


def test_export_then_import_gives_the_identical_model(saved, tmp_path):
    model, ckpt = saved
    out, back = tmp_path / "hf", tmp_path / "back"
    notes = export_hf(ckpt, str(out))
    assert "transformers has no H-Net class" in notes[0]
    assert {p.name for p in out.iterdir()} == FILES
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bytelatent_hnet" and config["stage_hidden_sizes"] == [32, 48]
    from safetensors.torch import load_file

    assert set(load_file(out / "model.safetensors")) == set(model.state_dict())  # our names
    import_hf(str(out), str(back))
    loaded, args, _ = load_any_checkpoint(str(back))
    assert arch_of(loaded).name == "hnet" and args == ARGS
    with torch.no_grad():
        expected, expected_aux = model(tokens())
        got, aux = loaded(tokens())
    assert torch.equal(got, expected)
    assert torch.equal(aux["bytes_per_chunk/stage1"], expected_aux["bytes_per_chunk/stage1"])
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hi").ids == [1, 108, 109]


def test_the_cli_round_trip(saved, tmp_path, capsys):
    _, ckpt = saved
    assert checkpoint_cli(["export-hf", ckpt, str(tmp_path / "hf")]) == 0
    assert checkpoint_cli(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "consolidated.pth").exists()
    assert checkpoint_cli(["export-hf", ckpt, str(tmp_path / "x"), "--entropy-model", ckpt]) == 2
    assert "an H-Net has no entropy model" in capsys.readouterr().err


def test_weights_that_do_not_fit_are_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, ckpt = saved
    out = tmp_path / "hf"
    export_hf(ckpt, str(out))
    weights = load_file(out / "model.safetensors")
    del weights["stages.1.routing_module.q_proj_layer.weight"]
    weights["output.weight"] = weights["output.weight"][:, :16].contiguous()
    weights["extra.bias"] = torch.zeros(3)
    save_file(weights, out / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        import_hf(str(out), str(tmp_path / "back"))
    line = err.value.one_line()
    for part in ("missing stages.1.routing_module.q_proj_layer.weight", "unexpected extra.bias",
                 "output.weight has shape (260, 16), the args need (260, 32)"):  # fmt: skip
        assert part in line, (part, line)
    assert not (tmp_path / "back").exists()  # nothing written
