"""H-Net warm start (`model.global_init`, format hf_llama): a Llama's decoder layers go into
the H-Net's global transformer (the BLT's class and names) through the spec's `warm_start`, the
rest of the model keeps its init, and mismatches and bad folders are named in `model.`."""

from __future__ import annotations

import pytest
import torch

from bytelatent.archs.hnet.model import HNet
from bytelatent.args import TrainArgs
from bytelatent.errors import CheckpointError
from bytelatent.preflight import check_global_init
from bytelatent.trainer.build import warm_start_from_spec
from tests.checkpoint.test_hf_llama import SCALING, save_tiny_llama, transformers

pytest.importorskip("safetensors")


def train_args(llama, **arch_args) -> TrainArgs:
    """An H-Net whose global transformer has the tiny Llama's shape (dim 64, 2 layers, 4 heads,
    2 kv heads, SwiGLU 192)."""
    hnet = dict(
        stages=[dict(dim=32, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=16)],
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, ffn_dim_multiplier=1.0,
        max_seqlen=64, global_init={"path": str(llama)},
    )  # fmt: skip
    return TrainArgs.model_validate({
        "dump_dir": "runs/x", "arch": "hnet", "model": {**hnet, **arch_args},
        "data": {"seq_len": 64, "add_patches": False, "patcher_args": {"patching_mode": "byte"}},
    })  # fmt: skip


def built(args: TrainArgs) -> HNet:
    with torch.device("meta"):
        model = HNet(args.model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def test_warm_start_puts_the_llama_into_the_global_transformer(tmp_path):
    folder = save_tiny_llama(tmp_path / "llama")
    args = train_args(folder)
    model = built(args)
    fresh = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert warm_start_from_spec(model, args)  # the trainer's fresh-start path
    hf = transformers.LlamaModel.from_pretrained(folder).eval()
    hf.norm = torch.nn.Identity()  # our global transformer ends without a norm
    h = torch.randn(2, 48, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.global_transformer(h, torch.zeros(2, 48, dtype=torch.bool))  # one document
        theirs = hf(inputs_embeds=h).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, fresh[n])}
    expected = {n for n in fresh if n.startswith("global_transformer.layers.")}
    assert changed == expected and len(expected) == 2 * 9  # stages, embedding, head untouched
    logits, _ = model(torch.randint(4, 260, (1, 64)))
    assert torch.isfinite(logits).all()


def test_no_global_init_is_no_warm_start(tmp_path):
    args = train_args(None, global_init=None)
    model = built(args)
    before = model.global_transformer.layers[0].attention.wq.weight.clone()
    assert not warm_start_from_spec(model, args)
    assert torch.equal(model.global_transformer.layers[0].attention.wq.weight, before)


def test_mismatches_and_bad_folders_name_the_model_keys(tmp_path):
    folder = save_tiny_llama(tmp_path / "llama")
    args = train_args(folder, dim=96, n_kv_heads=4, rope_theta=500000.0)
    with pytest.raises(CheckpointError) as err:
        warm_start_from_spec(built(args), args)
    line = err.value.one_line()
    for part in (
        "model.global_init",
        "model.dim=96 but hidden_size=64",
        "model.n_kv_heads=4 but num_key_value_heads=2",
        "model.rope_theta=500000.0 but rope_theta=10000.0",
    ):
        assert part in line, (part, line)
    scaled = save_tiny_llama(tmp_path / "scaled", rope_scaling=SCALING)
    with pytest.raises(CheckpointError, match=r"model\.\* has no rope_scaling"):
        warm_start_from_spec(built(train_args(scaled)), train_args(scaled))
    with pytest.raises(CheckpointError, match="model.global_init.path .*: no such folder"):
        check_global_init(str(tmp_path / "nowhere"), "model.global_init")
    with pytest.raises(ValueError, match="model.global_init and checkpoint.init_ckpt_path"):
        TrainArgs.model_validate(
            {**train_args(folder).model_dump(), "checkpoint": {"init_ckpt_path": "x"}}
        )
