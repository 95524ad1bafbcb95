"""Byteify end to end: a tiny random Llama -> the debug BLT's global transformer, frozen for 20
steps (bitwise the converted HF weights, loss falls), then 20 steps at lr_scale 0.1 change it;
resuming before, at and after the unfreeze step is bitwise the uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.distributed.env import detect_env
from bytelatent.trainer.build import build_model
from bytelatent.trainer.trainer import Trainer
from tests.extras import lazy_extra
from tests.trainer.test_cli import REPO, TINY_BLT, metrics, run_cli

transformers = lazy_extra("transformers", reason="pip install 'bytelatent[hf]'")
pytest.importorskip("safetensors")

GLOBAL = "global_transformer.layers.*"


def save_llama(folder) -> None:
    """The TINY_BLT global shape: dim 32, 1 layer, 2 heads (1 kv head), SwiGLU 256, theta 5e5."""
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="30KB")


def argv(dump, corpus_root, llama, *extra) -> list[str]:
    return [
        *TINY_BLT,
        "model.n_kv_heads_global=1",
        f"model.global_init.path={llama}",
        f"optim.groups=[{{params: '{GLOBAL}', lr_scale: 0.1, freeze_until_step: 20}}]",
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "distributed.model_dtype=fp32",
        "steps=40",
        "optim.warmup=5",
        "checkpoint.dump.every=20",
        *extra,
    ]


def global_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if n.startswith("global_transformer.layers")
    }


def converted_hf(args: TrainArgs) -> dict[str, torch.Tensor]:
    from bytelatent.checkpoint.hf_llama import load_hf_llama

    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    load_hf_llama(model, args.model)
    return global_weights(model)


def train(args_list: list[str]) -> tuple[Trainer, dict]:
    trainer = Trainer(parse_args(TrainArgs, args_list), detect_env())
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, global_weights(trainer.model)


def test_frozen_global_keeps_hf_weights_then_unfrozen_changes_them(
    tmp_path, corpus_root, monkeypatch
):
    monkeypatch.chdir(REPO)
    llama = tmp_path / "llama"
    save_llama(llama)
    dump = tmp_path / "run"
    first, at_20 = train(argv(dump, corpus_root, llama, "max_steps=20"))
    expected = converted_hf(first.args)
    assert at_20.keys() == expected.keys() and len(at_20) == 9
    for name, tensor in expected.items():
        assert torch.equal(at_20[name], tensor), name  # frozen: bitwise the HF weights
    losses = [row["loss"] for row in metrics(dump)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    frozen = list(first.model.global_transformer.layers.parameters())
    assert not any(p in first.optimizer.state for p in frozen)  # no AdamW state
    assert "group=0:global_transformer.layers.*" in (dump / "model-info.txt").read_text()

    resumed, at_40 = train(argv(dump, corpus_root, llama))  # resumes at 20: the HF folder unused
    assert resumed.state.step == 40
    changed = [n for n in expected if not torch.equal(at_40[n], expected[n])]
    assert changed == list(expected), "unfrozen global weights must move"


@pytest.mark.slow
def test_resume_before_at_and_after_the_unfreeze_is_bitwise(tmp_path, corpus_root, monkeypatch):
    monkeypatch.chdir(REPO)
    llama = tmp_path / "llama"
    save_llama(llama)
    dump = tmp_path / "run"
    for stop in (15, 20, 30):  # resumes at 15 (frozen), 20 (the unfreeze), 30 (AdamW state)
        train(argv(dump, corpus_root, llama, f"max_steps={stop}", "checkpoint.dump.every=5"))
    chained, at_40 = train(argv(dump, corpus_root, llama))
    straight, straight_40 = train(argv(tmp_path / "straight", corpus_root, llama))
    for name in at_40:
        assert torch.equal(at_40[name], straight_40[name]), name
    for a, b in zip(chained.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)
        state_a, state_b = chained.optimizer.state[a], straight.optimizer.state[b]
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.slow
def test_mismatched_checkpoint_fails_in_one_line_before_training(tmp_path, corpus_root):
    llama = tmp_path / "llama"
    save_llama(llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    dump = tmp_path / "run"
    res = run_cli("bytelatent.train", argv(dump, corpus_root, llama))
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("checkpoint error:") and "model.dim=32 but hidden_size=48" in line
    assert not (dump / "metrics.jsonl").exists()


def test_blt_from_llama_global_layers_have_llama_3_2_1b_shape():
    from bytelatent.checkpoint.hf_llama import architecture_mismatches

    args = parse_args(
        TrainArgs,
        [f"config={REPO / 'configs/blt_from_llama.yaml'}", "dump_dir=x", "data.root_dir=x"]
        + ["data.sources={s: 1.0}", "data.preprocess_dir=x"],
    )
    with torch.device("meta"):
        model = build_model(args)
    layers = sum(p.numel() for p in model.global_transformer.layers.parameters())
    # Llama-3.2-1B: 1,235,814,400 parameters - 262,668,288 embedding - 2,048 final norm
    assert layers == 973_144_064
    assert model.global_transformer.token_embedding_projection is None
    llama_3_2_1b = {  # config.json of meta-llama/Llama-3.2-1B (the fields the check reads)
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    assert architecture_mismatches(llama_3_2_1b, args.model) == []
