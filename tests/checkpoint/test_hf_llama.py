"""model.global_init with format hf_llama: RoPE scaling, layout conversion, parity, mismatches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bytelatent.archs.blt.model import ByteLatentTransformer, ByteLatentTransformerArgs
from bytelatent.checkpoint.hf_llama import check_hf_llama, load_hf_llama
from bytelatent.errors import CheckpointError
from bytelatent.model.args import RopeScalingArgs
from bytelatent.model.layers import precompute_freqs_cis
from tests.extras import lazy_extra
from tests.limits import hang_limit

transformers = lazy_extra("transformers", reason="pip install 'bytelatent[hf]'")
pytest.importorskip("safetensors")

# theta 10000 and head_dim 16 put rotation wavelengths in all three llama3 bands for 32 positions
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def save_tiny_llama(
    folder: Path, gqa: bool = True, rope_scaling: dict | None = None, theta: float = 10000.0
) -> Path:
    """A random LlamaForCausalLM (dim 64, 2 layers, 4 heads) saved in 3+ safetensors shards."""
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if gqa else 4,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        max_position_embeddings=256,
        initializer_range=0.1,  # attention patterns matter; outputs stay O(1)
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so that their copy is tested too
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="40KB", safe_serialization=True)
    return folder


def blt_args(path: Path | None, gqa: bool = True, rope_scaling=None, theta=10000.0, **kw):
    """A small BLT whose global transformer has the tiny Llama's shape (no input projection)."""
    fields = dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads_global=2 if gqa else None,
        multiple_of=32,
        ffn_dim_multiplier=1.0,
        norm_eps=1e-5,
        rope_theta=theta,
        rope_scaling=RopeScalingArgs(**rope_scaling) if rope_scaling else None,
        max_seqlen=64,
        dim_local_encoder=64,
        dim_local_decoder=64,
        n_layers_local_encoder=1,
        n_layers_local_decoder=1,
        n_heads_local_encoder=4,
        n_heads_local_decoder=4,
        max_encoder_seq_length=128,
        global_init={"path": str(path)} if path else None,
    )
    return ByteLatentTransformerArgs(**{**fields, **kw})


def built(args: ByteLatentTransformerArgs) -> ByteLatentTransformer:
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_llama3_rope_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_theta=10000.0, rope_scaling=dict(SCALING)
    )
    hf_freqs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = precompute_freqs_cis(16, 2, 10000.0, scaling=RopeScalingArgs(**SCALING))
    plain = precompute_freqs_cis(16, 2, 10000.0)
    assert attention_factor == 1.0
    # row 1 holds cos/sin of angle = 1 * frequency
    ours_freqs = torch.atan2(ours[1, :, 1, 0], ours[1, :, 0, 0])
    torch.testing.assert_close(ours_freqs, hf_freqs.float(), rtol=1e-6, atol=1e-7)
    high_band, medium_band, low_band = (plain[1, :, 1, 0] != ours[1, :, 1, 0]).tolist()[:3]
    assert not high_band and medium_band and low_band  # every band of the rule is exercised


@pytest.mark.parametrize(
    "gqa, rope_scaling, theta",
    [
        (True, SCALING, 10000.0),
        (False, None, 500000.0),
        (True, None, 10000.0),
        (False, SCALING, 10000.0),
    ],
)
def test_global_transformer_equals_hf_llama(tmp_path, gqa, rope_scaling, theta):
    folder = save_tiny_llama(tmp_path / "llama", gqa, rope_scaling, theta)
    assert len(list(folder.glob("*.safetensors"))) >= 3  # sharded: one file at a time
    args = blt_args(folder, gqa, rope_scaling, theta)
    model = built(args)
    assert load_hf_llama(model, args) == 2 * 9
    hf = transformers.LlamaModel.from_pretrained(folder).eval()
    hf.norm = torch.nn.Identity()  # our global transformer ends without a norm
    h = torch.randn(2, 48, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.global_transformer(h, None)
        theirs = hf(inputs_embeds=h).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - h).abs().mean() > 0.1  # the layers did something


def test_without_the_layout_conversion_parity_fails(tmp_path, monkeypatch):
    import bytelatent.checkpoint.hf_llama as hf_llama

    folder = save_tiny_llama(tmp_path / "llama")
    args = blt_args(folder)
    model = built(args)
    monkeypatch.setattr(hf_llama, "rotate_half_to_interleaved", lambda w, n: w)
    load_hf_llama(model, args)
    hf = transformers.LlamaModel.from_pretrained(folder).eval()
    hf.norm = torch.nn.Identity()
    h = torch.randn(1, 32, 64)
    with torch.no_grad():
        diff = model.global_transformer(h, None) - hf(inputs_embeds=h).last_hidden_state
    assert diff.abs().max() > 1e-3


def test_every_mismatch_is_named_on_one_line(tmp_path):
    folder = save_tiny_llama(tmp_path / "llama", rope_scaling=SCALING)
    args = blt_args(folder, gqa=False, theta=500000.0, dim=96, n_heads=4, norm_eps=1e-6)
    with pytest.raises(CheckpointError) as err:
        check_hf_llama(args)
    line = err.value.one_line()
    assert "\n" not in line and line.startswith("checkpoint error:")
    for part in (
        "model.dim=96 but hidden_size=64",
        "model.n_kv_heads_global=4 but num_key_value_heads=2",
        "model.head_dim=24 but head_dim=16",
        "intermediate_size=192",
        "model.norm_eps=1e-06 but rms_norm_eps=1e-05",
        "model.rope_theta=500000.0 but rope_theta=10000.0",
        "model.rope_scaling=null",
    ):
        assert part in line, (part, line)


def test_other_architectures_and_missing_files_are_refused(tmp_path):
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=64)
    ).save_pretrained(gpt2)
    with pytest.raises(CheckpointError, match="model_type='gpt2'.*LlamaForCausalLM"):
        check_hf_llama(blt_args(gpt2))
    folder = save_tiny_llama(tmp_path / "llama")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (folder / victim).unlink()
    with pytest.raises(CheckpointError, match=f"{victim}: missing"):
        check_hf_llama(blt_args(folder))
    with pytest.raises(CheckpointError, match="config.json: missing"):
        check_hf_llama(blt_args(tmp_path / "nowhere"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_sharded_load_and_frozen_group_on_two_ranks(tmp_path, layout):
    import os
    import subprocess
    import sys

    folder = save_tiny_llama(tmp_path / "llama")
    args = blt_args(folder)
    single = built(args)
    load_hf_llama(single, args)
    out = tmp_path / "result.json"
    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = f"{here.parents[1]}{os.pathsep}{env.get('PYTHONPATH', '')}"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(here / "_hf_llama_worker.py"), str(folder), str(out), layout]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=hang_limit(300))
    assert res.returncode == 0 and out.exists(), (res.stdout + res.stderr)[-4000:]
    result = json.loads(out.read_text())
    expected = {n: p for n, p in single.named_parameters() if n.startswith("global_transformer.l")}
    assert result["loaded"].keys() == expected.keys()
    for name, values in result["loaded"].items():
        assert torch.equal(torch.tensor(values), expected[name].detach()), name
    assert result["unchanged_while_frozen"] and result["frozen_local_grads"]
    assert not result["frozen_global_grads"] and result["open_global_grads"]
    if layout == "fsdp":  # the frozen global layers' FSDP units reduce nothing
        frozen_calls, open_calls = result["reduce_scatters"]
        assert frozen_calls < open_calls, result["reduce_scatters"]
